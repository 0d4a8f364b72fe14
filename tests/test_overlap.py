"""Overlap scheduling (scheduler.overlap): the same tokens as the serial engine, one step behind,
with every KV page returned."""
import pytest
import torch

from moespec import LLM, SamplingParams
from moespec.config import ConfigError, build_config
from moespec.overlap import PENDING


def prompts(lengths, vocab=120, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def generate(path, batch, params, **options):
    opts = dict(page_size=4, num_kv_pages=256, max_num_seqs=4, max_num_batched_tokens=16)
    opts.update(options)
    llm = LLM(model=path, **opts)
    outs = llm.generate(batch, params, use_tqdm=False)
    return outs, llm


BATCH = prompts([5, 23, 9, 17, 30, 2, 11], seed=3)
LENGTHS = (20, 7, 1, 16, 20, 3, 12)


@pytest.fixture(params=["llama", "deepseek"])
def model(request, llama_pair, deepseek_mtp):
    return llama_pair[0] if request.param == "llama" else deepseek_mtp


def sampling(kind: str, lengths: tuple[int, ...]) -> list[SamplingParams]:
    """One request per output length: greedy, greedy with logprobs, or seeded sampling."""
    def params(n, i):
        base = dict(max_tokens=n, ignore_eos=True)
        if kind == "greedy":
            return SamplingParams(temperature=0.0, **base)
        if kind == "logprobs":
            return SamplingParams(temperature=0.0, logprobs=2, **base)
        return SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, **base)
    return [params(n, i) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "logprobs"])
def test_same_tokens_as_the_serial_engine(model, kind):
    """More requests than slots (a finished request's slot is refilled while the next step is in
    flight), chunked prefill beside decode rows, outputs of 1 to 20 tokens. Seeded draws are
    keyed by position, so they are the same tokens too."""
    batch_params = sampling(kind, LENGTHS)
    ref, _ = generate(model, BATCH, batch_params)
    got, llm = generate(model, BATCH, batch_params, overlap=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(PENDING not in o.token_ids for o in got)
    if kind == "logprobs":
        assert [[(lp.token_id, round(lp.logprob, 4)) for lp in o.outputs[0].logprobs] for o in got] == \
               [[(lp.token_id, round(lp.logprob, 4)) for lp in o.outputs[0].logprobs] for o in ref]
    assert llm.engine.in_flight is None and llm.engine.stats.decode_wall_s > 0


def test_random_sampling_follows_the_model(llama_pair):
    """Unseeded sampling under overlap (a request that finished still takes a row, and its
    draw, in the step after): three tokens of 600 requests, 64 at a time, follow the model's
    joint distribution over the 27 cells of top-k 3 (chi-square)."""
    from reference import exact_joint, joint_pvalue
    prompt, n = prompts([6], seed=7)[0], 600
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    outs, _ = generate(llama_pair[0], [prompt] * n, params, overlap=True, max_num_seqs=64, num_kv_pages=1024,
                       max_num_batched_tokens=256)
    assert joint_pvalue(exact_joint(llama_pair[0], prompt, params, 3), [o.token_ids for o in outs]) > 1e-3


def test_same_tokens_under_preemption(model):
    batch = prompts([7, 13, 21, 4, 11, 16], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref, _ = generate(model, batch, params, max_num_seqs=8)
    got, _ = generate(model, batch, params, overlap=True, num_kv_pages=14, max_num_batched_tokens=32, max_num_seqs=8)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_penalties_and_grammars_run_serially_with_the_same_tokens(llama_pair):
    """A request whose next step needs its previous token on the host (penalties) runs in
    serial steps while it is there; the others overlap before and after."""
    penalized = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    params[3] = penalized
    ref, _ = generate(llama_pair[0], BATCH, params)
    got, _ = generate(llama_pair[0], BATCH, params, overlap=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.parametrize("path, spec", [("checkpoints/tiny-llama", None),
                                        ("checkpoints/tiny-deepseek-v3", {"mode": "mtp", "num_speculative_tokens": 2})])
def test_stop_strings_and_eos_end_a_request_one_step_early(path, spec):
    """A request that stops at step n was already scheduled in n+1: that token is dropped (a
    speculative step: prepared again without it). The trained tiny models with their tokenizer,
    tiny-deepseek-v3 with its MTP layer."""
    free, _ = generate(path, ["def main():"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                       page_size=8)
    text = free[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0.0, max_tokens=40)]  # stops at EOS, if it samples one
    ref, _ = generate(path, ["def main():", "import os"], params, page_size=8, speculation=spec)
    got, llm = generate(path, ["def main():", "import os"], params, page_size=8, overlap=True, speculation=spec)
    assert llm.engine.stats.ahead_steps > 0 and (llm.engine.stats.shifted_steps > 0) == (spec is not None)
    assert got[0].finish_reason == "stop" and got[0].text == text[: text.index(stop)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason)
                                                                       for o in ref]


@pytest.mark.parametrize("spec", [None, {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}],
                         ids=["plain", "mtp"])
def test_abort_while_a_step_is_in_flight(llama_pair, deepseek_mtp, spec):
    """A plain step: the aborted request's placeholder goes. A speculative one: its prepared step
    is prepared again without it. The other's tokens are the serial engine's, every page back."""
    path = llama_pair[0] if spec is None else deepseek_mtp
    llm = LLM(model=path, page_size=4, num_kv_pages=64, overlap=True, speculation=spec)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    keep = engine.add_request(prompts([9])[0], params)
    drop = engine.add_request(prompts([14], seed=5)[0], params)
    for _ in range(4 if spec is None else 5):
        engine.step()
    assert engine.in_flight is not None
    assert engine.in_flight.speculative if spec else drop.output_ids[-1] == PENDING
    engine.abort(drop.request_id)
    assert drop.is_finished and PENDING not in drop.output_ids
    while engine.has_unfinished():
        engine.step()
    ref = LLM(model=path, page_size=4, num_kv_pages=64, speculation=spec).generate([prompts([9])[0]], params,
                                                                                  use_tqdm=False)
    assert keep.output_ids == ref[0].token_ids


def test_overlap_with_compiled_steps(llama_pair, monkeypatch):
    import moespec.static_step as static_step
    monkeypatch.setattr(static_step, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    ref, _ = generate(llama_pair[0], BATCH, params)
    got, llm = generate(llama_pair[0], BATCH, params, overlap=True, compile=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert llm.engine.runner.static.shapes
    torch._dynamo.reset()


def test_config_refuses_overlap_where_it_cannot_run():
    with pytest.raises(ConfigError, match="model.attention_backend: torch"):
        build_config({}, {"model": "m", "overlap": True, "attention_backend": "flashinfer",
                          "speculation": {"mode": "mtp"}})
    assert build_config({}, {"model": "m", "overlap": True, "speculation": {"mode": "mtp"}}).scheduler.overlap
    assert build_config({}, {"model": "m", "overlap": True, "parallel": {"ep_size": 2}}).scheduler.overlap


SPEC_LENGTHS = (24, 7, 1, 19, 24, 2, 13)


SPECS = {
    "mtp-k1": ("deepseek", {"mode": "mtp", "num_speculative_tokens": 1, "adaptive": False}),
    "mtp-k3": ("deepseek", {"mode": "mtp", "num_speculative_tokens": 3, "adaptive": False}),
    "mtp-adaptive": ("deepseek", {"mode": "mtp", "num_speculative_tokens": 2}),
    "mtp-tree": ("deepseek", {"mode": "mtp", "num_speculative_tokens": 3, "adaptive": False,
                              "tree": {"top_k": 2, "depth": 3, "num_draft_tokens": 5}}),
    "draft-k2": ("llama", {"mode": "draft", "num_speculative_tokens": 2, "adaptive": False}),
    "self-draft-k3": ("llama", {"mode": "draft", "num_speculative_tokens": 3, "adaptive": False}),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_speculation_overlapped_gives_the_same_tokens(llama_pair, deepseek_mtp, name, kind):
    """The next verify step is planned for the longest outcome of the one in flight and shifted
    back on the device: the same tokens as the serial engine, for every mode, with accept
    lengths from none (a random draft) to all (the target as its own draft), more requests than
    slots and outputs of 1 to 24 tokens."""
    which, spec = SPECS[name]
    path = deepseek_mtp if which == "deepseek" else llama_pair[0]
    if spec["mode"] == "draft":
        spec = {**spec, "draft_model": llama_pair[0] if name.startswith("self") else llama_pair[1]}
    params = sampling(kind, SPEC_LENGTHS)
    ref, _ = generate(path, BATCH, params, speculation=spec)
    got, llm = generate(path, BATCH, params, speculation=spec, overlap=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    stats = llm.engine.stats
    assert llm.engine.in_flight is None and stats.spec_steps > 0
    # steps were prepared while the one before was in flight (whether the two threads then really ran
    # at once depends on the machine's load: benchmarks measure that, as decode_hidden_share)
    assert stats.ahead_steps > 0


def test_speculative_sampling_overlapped_follows_the_model(deepseek_mtp):
    """Unseeded rejection sampling under overlap, MTP k = 2: three tokens of 600 requests, 64 at
    a time, follow the target's joint distribution over the 27 cells of top-k 3 (chi-square)."""
    from reference import exact_joint, joint_pvalue
    prompt, n = prompts([6], seed=7)[0], 600
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    outs, llm = generate(deepseek_mtp, [prompt] * n, params, overlap=True, max_num_seqs=64, num_kv_pages=1024,
                         max_num_batched_tokens=512,
                         speculation={"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    assert llm.engine.spec_stats.steps > 0
    assert joint_pvalue(exact_joint(deepseek_mtp, prompt, params, 3), [o.token_ids for o in outs]) > 1e-3


def test_speculation_overlapped_under_preemption_and_compiled(deepseek_mtp, monkeypatch):
    """Too few pages: a step prepared ahead never preempts (it waits for the outcome instead)
    and preemption by recompute still gives the serial tokens; compiled static steps shift
    their padded plans the same way."""
    import moespec.static_step as static_step
    monkeypatch.setattr(static_step, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    spec = {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    batch = prompts([7, 13, 21, 4, 11, 16], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref, _ = generate(deepseek_mtp, batch, params, max_num_seqs=8, speculation=spec)
    got, llm = generate(deepseek_mtp, batch, params, overlap=True, num_kv_pages=16, max_num_batched_tokens=32,
                        max_num_seqs=8, speculation=spec)
    assert sum(o.metrics.num_preemptions for o in got) > 0 and llm.engine.stats.shifted_steps > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    got, llm = generate(deepseek_mtp, batch, params, overlap=True, compile=True, speculation=spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref] and llm.engine.stats.shifted_steps > 0
    assert any(Q == 3 * B for B, Q, _ in llm.engine.runner.static.shapes)  # verify steps ran static
    torch._dynamo.reset()
