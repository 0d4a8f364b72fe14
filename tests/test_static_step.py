"""Static steps (model.compile): bucket padding, the scratch page, and identical output with
compile on and off for every speculation mode, under preemption and with stop strings.

Most tests trace with dynamo's "eager" backend: the padding, bucketing and graph guards are the
code that runs, in seconds. One test compiles with inductor, as users run it."""
import pytest
import torch
from torch._dynamo.utils import counters

import moespec.static_step as static_step
from moespec import LLM, SamplingParams
from moespec.batch import Span, pack_spans
from moespec.config import ConfigError, build_config
from moespec.model_runner import ModelRunner
from moespec.models import load_model
from moespec.static_step import StaticSpec, batch_buckets, pad_batch, uniform_shape


@pytest.fixture
def traced(monkeypatch):
    """Dynamo's "eager" backend, and a clean dynamo cache (guards of earlier engines pile up)."""
    monkeypatch.setattr(static_step, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def prompts(lengths, vocab=120, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def generate(path, batch, params, **options):
    opts = dict(page_size=4, num_kv_pages=256, max_num_seqs=8)
    opts.update(options)
    llm = LLM(model=path, **opts)
    return [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)], llm


GREEDY = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 7, 1, 16, 20, 3)]
BATCH = prompts([5, 23, 9, 17, 30, 2], seed=3)


def test_batch_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(1) == (1,)


def test_pad_batch_puts_padded_requests_on_the_scratch_page():
    spans = [Span([3, 4], 5, [11, 12, 13]), Span([7], 1, [21, 22, 23])]  # verify-like: Q = 3, every row sampled
    batch = pack_spans(spans, 4, "verify")
    assert uniform_shape(batch) == (3, 3)
    padded = pad_batch(batch, 4, scratch_page=99)
    assert padded.input_ids.tolist() == [11, 12, 13, 21, 22, 23] + [0] * 6
    assert padded.positions.tolist()[6:] == [1, 2, 3, 1, 2, 3]  # the scratch page's last Q slots
    assert padded.qo_indptr.tolist() == [0, 3, 6, 9, 12]
    assert padded.kv_indices.tolist() == [3, 4, 7, 99, 99]
    assert padded.kv_indptr.tolist() == [0, 2, 3, 4, 5] and padded.kv_last_page_len.tolist() == [4, 4, 4, 4]
    assert padded.sample_indices.tolist() == list(range(12)) and padded.qo_bounds == (0, 3, 6, 9, 12)
    decode = pack_spans([Span([1, 2], 6, [5])], 4, "decode", sampled=[True])
    padded = pad_batch(decode, 2, scratch_page=99)
    assert padded.sample_indices.tolist() == [0, 1] and padded.kv_last_page_len.tolist() == [3, 4]
    # a ragged batch (a prefill chunk beside a decode row) is not uniform: it runs eager
    assert uniform_shape(pack_spans([Span([1], 0, [1, 2]), Span([2], 3, [4])], 4, "mixed", [True, True])) is None


def test_static_forward_matches_eager_and_leaves_real_kv_alone(traced, llama_pair):
    """Three decode requests padded to four: the same logits and hidden states as eager, the
    same KV in every real page; the padded request wrote only into the scratch page."""
    model = load_model(llama_pair[0], show_progress=False)
    eager, static = ModelRunner(model, 16, 4), ModelRunner(model, 16, 4, static=StaticSpec((1, 4)))
    assert len(static.cache.layers[0].k) == 17  # the scratch page is page 16
    outputs = []
    for runner in (eager, static):
        for L in (6, 7, 8):  # three decode steps of three requests with 5 tokens of KV already there
            spans = [Span([3 * b, 3 * b + 1, 3 * b + 2], L, [10 + b + L]) for b in range(3)]
            batch = pack_spans(spans, 4, "decode", sampled=[True] * 3)
            ctx = runner.plan(batch)
            assert (ctx.static is not None) == (runner is static)
            hidden, logits = runner.forward(batch, ctx)
        outputs.append((hidden, logits))
    assert outputs[0][1].shape == outputs[1][1].shape == (3, 120)
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], rtol=1e-5, atol=1e-5)
    for mine, ref in zip(static.cache.layers, eager.cache.layers):
        torch.testing.assert_close(mine.k[:16], ref.k, rtol=1e-5, atol=1e-5)
    assert static.static.shapes == {(4, 4, 4)}  # one shape across three KV lengths


def test_config_checks():
    with pytest.raises(ConfigError, match="model.compile_batch_sizes"):
        build_config({}, {"model": "m", "compile": True, "compile_batch_sizes": [4, 0]})
    with pytest.raises(ConfigError, match="model.compile_batch_sizes\\[1\\]"):
        build_config({}, {"model": "m", "compile_batch_sizes": [4, "x"]})
    assert build_config({}, {"model": "m", "compile": True, "parallel": {"ep_size": 2}}).model.compile
    assert build_config({}, {"model": "m", "compile_batch_sizes": [1, 8]}).model.compile_batch_sizes == [1, 8]


def speculation(mode, llama_pair, tmp_path):
    if mode == "none":
        return None
    spec = {"mode": "mtp" if mode == "mtp-head" else mode, "num_speculative_tokens": 3}
    if mode == "draft":
        spec["draft_model"] = llama_pair[1]
    if mode == "mtp-head":
        from tiny_models import save_random_mtp_head
        spec["mtp_head"] = save_random_mtp_head(llama_pair[0], tmp_path / "head")
    return spec


@pytest.mark.parametrize("mode", ["none", "mtp", "draft", "mtp-head"])
def test_greedy_identical_with_compile(traced, deepseek_mtp, llama_pair, tmp_path, mode):
    """Mixed lengths (requests finish at different steps, so buckets change), adaptive draft
    lengths, chunked prefill beside decode rows: the same tokens with compile on and off."""
    path, spec = deepseek_mtp if mode == "mtp" else llama_pair[0], speculation(mode, llama_pair, tmp_path)
    ref, _ = generate(path, BATCH, GREEDY, speculation=spec, max_num_batched_tokens=16)
    got, llm = generate(path, BATCH, GREEDY, speculation=spec, max_num_batched_tokens=16, compile=True,
                        compile_batch_sizes=[2, 8])
    assert got == ref
    shapes = llm.engine.runner.static.shapes
    assert len({s[0] for s in shapes}) > 1  # several buckets ran
    if mode == "draft":
        assert llm.engine.speculator.runner.static.shapes  # the draft model's decode ran static too
    if mode in ("mtp", "mtp-head"):  # the MTP layer's verify re-run (one row per request) and chain steps too
        mtp_shapes = llm.engine.speculator.static.shapes
        assert any(s[1] > s[0] == s[2] for s in mtp_shapes) and any(s[0] == s[1] == s[2] for s in mtp_shapes)
    if spec is not None:
        assert llm.engine.spec_stats.steps > 0 and any(s[1] > s[0] for s in shapes)  # verify steps ran static


@pytest.mark.parametrize("switch", ["compile", "cuda_graph"])
def test_tree_steps_with_compile(traced, deepseek_mtp, switch):
    """A tree's verify and draft levels run eager (tree masks); the MTP re-run over its accepted
    path, laid out as a chain's verify batch, runs static (compiled or captured): the same tokens
    as without."""
    spec = {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False,
            "tree": {"top_k": 2, "depth": 2, "num_draft_tokens": 4}}
    ref, _ = generate(deepseek_mtp, BATCH, GREEDY)
    got, llm = generate(deepseek_mtp, BATCH, GREEDY, speculation=spec, compile_batch_sizes=[2, 8], **{switch: True})
    assert got == ref
    assert llm.engine.spec_stats.by_tree["2x2x4"][0] > 0
    assert any(s[1] == 3 * s[0] == 3 * s[2] for s in llm.engine.speculator.static.shapes)  # D+1 rows each


@pytest.mark.parametrize("mode", ["none", "mtp"])
def test_greedy_identical_with_compile_under_preemption(traced, deepseek_mtp, mode):
    spec = {"mode": "mtp", "num_speculative_tokens": 2} if mode == "mtp" else None
    batch = prompts([7, 13, 21, 4, 11, 16], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref, _ = generate(deepseek_mtp, batch, params, speculation=spec)
    tight = LLM(model=deepseek_mtp, page_size=4, num_kv_pages=16, max_num_batched_tokens=32, max_num_seqs=8,
                speculation=spec, compile=True, compile_batch_sizes=[2, 8])
    outs = tight.generate(batch, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("switch", ["compile", "cuda_graph"])
def test_stop_strings_with_compile(traced, switch):
    """The trained tiny Llama with its tokenizer: text cut at a stop string the same way, with
    steps compiled or captured (model.cuda_graph: checked replays on the CPU)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free, _ = generate("checkpoints/tiny-llama", ["def main():"], params, page_size=8)
    llm = LLM(model="checkpoints/tiny-llama", page_size=8, num_kv_pages=64, **{switch: True},
              speculation={"mode": "mtp", "mtp_head": "checkpoints/tiny-llama-mtp-head", "num_speculative_tokens": 2})
    text = llm.get_tokenizer().decode(free[0], skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate(["def main():"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert out.token_ids == free[0][: len(out.token_ids)]
    assert llm.engine.runner.static.shapes


@pytest.mark.parametrize("switch", ["compile", "cuda_graph"])
def test_sampling_with_compile_follows_the_model(traced, llama_pair, switch):
    """Random sampling through a padded static step, compiled or captured: 600 requests prefill
    in one step, then decode in one step padded to the bucket of 608; the two tokens follow the
    model's joint distribution (chi-square over the 3 x 3 cells of top-k 3)."""
    from reference import exact_joint, joint_pvalue
    prompt, n = prompts([6], seed=7)[0], 600
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=2, ignore_eos=True)
    llm = LLM(model=llama_pair[0], page_size=4, num_kv_pages=2048, max_num_seqs=n, max_num_batched_tokens=4096,
              compile_batch_sizes=[608], **{switch: True})
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    assert llm.engine.runner.static.shapes == {(608, 608, 608)}
    assert joint_pvalue(exact_joint(llama_pair[0], prompt, params, 2), [o.token_ids for o in outs]) > 1e-3


def test_warm_up_compiles_every_bucket_before_serving(traced, llama_pair):
    llm = LLM(model=llama_pair[0], page_size=4, num_kv_pages=64, max_num_seqs=4, compile=True,
              speculation={"mode": "draft", "draft_model": llama_pair[1], "num_speculative_tokens": 2})
    assert llm.engine.warm_up() > 0
    assert llm.engine.runner.static.shapes == {(b, b * q, b * q) if q > 1 else (b, b, b)
                                               for b in (1, 2, 4) for q in (1, 2, 3)}
    assert llm.engine.speculator.runner.static.shapes == {(b, b, b) for b in (1, 2, 4)}
    before = llm.engine.runner.static.compile_s
    graphs = counters["stats"]["unique_graphs"]
    llm.generate(prompts([5, 9, 3]), GREEDY[:3], use_tqdm=False)
    assert llm.engine.runner.static.compile_s == before  # nothing compiled while serving
    assert counters["stats"]["unique_graphs"] == graphs  # not even a bucket again, for a failed guard
    assert LLM(model=llama_pair[0], page_size=4, num_kv_pages=64).engine.warm_up() == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_warm_up_covers_mtp_chains_and_shifted_verify_steps(traced, deepseek_mtp, overlap):
    """MTP k = 2: chain steps plan inside inference mode, verify steps outside, and overlap
    scheduling shifts planned verify steps on the device; after the warm-up, serving compiles
    no graph (dynamo guards on tensor kinds and aliasing, not only shapes)."""
    llm = LLM(model=deepseek_mtp, page_size=4, num_kv_pages=256, max_num_seqs=4, compile=True, overlap=overlap,
              speculation={"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    llm.engine.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm.generate(prompts([9, 30, 5, 12, 8, 3], seed=2), params, use_tqdm=False)
    assert llm.engine.stats.spec_steps > 0 and counters["stats"]["unique_graphs"] == graphs


def test_inductor_compiled_steps_give_the_same_tokens(llama_pair):
    """With inductor, as users run it: decode at one bucket, verify at another."""
    batch = prompts([9, 9, 9], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref, _ = generate(llama_pair[0], batch, params)
    got, llm = generate(llama_pair[0], batch, params, compile=True, compile_batch_sizes=[4])
    assert got == ref and llm.engine.runner.static.shapes == {(4, 4, 4)}
