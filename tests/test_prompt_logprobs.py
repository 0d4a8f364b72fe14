"""Prompt logprobs (SamplingParams.prompt_logprobs) from the prefill: each prompt token's float32
log-probability equals transformers' for the same tokens, in one prefill and across chunks, with
prefix caching on (cached pages are not reused for them), with MTP, and across ranks."""
import pytest
import torch

from moespec.llm import LLM
from moespec.parallel.local_launch import run_ranks
from moespec.sampling import MAX_LOGPROBS, SamplingParams
from tiny_models import save_tiny_deepseek, save_tiny_llama

PROMPTS = [[3, 40, 7, 9, 1, 55, 2, 90, 14, 14, 6, 101, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17],
           [60, 61]]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(path, transformers model in float32) for a tiny DeepSeek-V3 with MTP and a tiny Llama."""
    ds, llama = tmp_path_factory.mktemp("pl-ds"), tmp_path_factory.mktemp("pl-llama")
    return {"deepseek": (str(ds), save_tiny_deepseek(ds, mtp=True).float()),
            "llama": (str(llama), save_tiny_llama(llama).float())}


def reference_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log_softmax at each position [L, V] (row p scores token p + 1)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)


def check_against_reference(prompt_logprobs, hf_model, prompt: list[int], num_top: int) -> None:
    ref = reference_logprobs(hf_model, prompt)
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for p, entry in enumerate(prompt_logprobs[1:], start=1):
        expected = ref[p - 1]
        assert entry.token_id == prompt[p]
        assert abs(entry.logprob - expected[prompt[p]].item()) < TOLERANCE, (p, entry.logprob)
        assert entry.rank == int((expected > expected[prompt[p]]).sum()) + 1
        top_ids = expected.topk(num_top).indices.tolist()
        assert list(entry.top) == top_ids
        for token, lp in entry.top.items():
            assert abs(lp - expected[token].item()) < TOLERANCE


@pytest.mark.parametrize("name,options", [
    ("deepseek", {}),
    ("deepseek", {"max_num_batched_tokens": 5, "speculation": {"mode": "mtp", "num_speculative_tokens": 2}}),
    ("llama", {"max_num_batched_tokens": 4}),
    ("deepseek", {"max_num_batched_tokens": 6, "overlap": True,
                  "speculation": {"mode": "mtp", "num_speculative_tokens": 1}}),
])
def test_prompt_logprobs_equal_transformers(checkpoints, name, options):
    """One prefill, and chunked prefill (chunks of 4-5 tokens, several requests in a step)."""
    path, hf_model = checkpoints[name]
    llm = LLM(model=path, dtype="float32", page_size=4, num_kv_pages=64, **options)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        check_against_reference(out.prompt_logprobs, hf_model, prompt, 4)
        assert len(out.token_ids) == 3


def test_prefix_cache_is_not_reused_for_prompt_logprobs(checkpoints):
    """A prompt whose pages are cached computes its whole prompt again when it wants prompt
    logprobs (cached pages have no logits); without prompt logprobs it reuses them."""
    path, hf_model = checkpoints["deepseek"]
    llm = LLM(model=path, dtype="float32", page_size=4, num_kv_pages=64)
    prompt = PROMPTS[1]
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    scored = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    check_against_reference(scored.prompt_logprobs, hf_model, prompt, 0)
    again = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 16 and again.prompt_logprobs is None


@pytest.mark.parametrize("overlap", [False, True])
def test_max_tokens_zero_scores_the_prompt_only(checkpoints, overlap):
    """Beside requests that generate (overlap: steps prepared while the one before runs)."""
    path, hf_model = checkpoints["llama"]
    llm = LLM(model=path, dtype="float32", page_size=4, num_kv_pages=64, overlap=overlap)
    params = [SamplingParams(max_tokens=0, prompt_logprobs=1), SamplingParams(max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=0, prompt_logprobs=0)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out, p in zip(PROMPTS, outputs, params):
        assert len(out.token_ids) == p.max_tokens and out.finish_reason == "length"
        if p.max_tokens == 0:
            assert out.text == ""
            check_against_reference(out.prompt_logprobs, hf_model, prompt, p.prompt_logprobs)


def test_bounds_name_the_field():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_tokens.*prompt_logprobs"):
        SamplingParams(max_tokens=0)


def rank_main(rank: int, path: str, requests: list[tuple[list[int], int]]):
    """EP=2, data-parallel attention: rank 0 adds every request (they spread over both ranks)
    and returns each one's prompt logprobs and outputs; rank 1 serves."""
    from moespec.config import build_config
    from moespec.distributed import join_ranks
    from moespec.engine import Engine
    config = build_config({"model": {"path": path, "dtype": "float32"},
                           "cache": {"page_size": 4, "num_kv_pages": 64},
                           "scheduler": {"max_num_batched_tokens": 6},
                           "parallel": {"ep_size": 2, "timeout_s": 30, "attention": "dp"}}, {})
    ranks = join_ranks(config)
    try:
        engine = Engine(config, ranks=ranks)
        if not ranks.ctx.leader:
            engine.serve_forever()
            return None
        seqs = [engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          prompt_logprobs=2, ignore_eos=True))
                for prompt, max_tokens in requests]
        while engine.has_unfinished():
            engine.step()
        engine.stop_ranks()
        return [(seq.prompt_logprobs, seq.output_ids) for seq in seqs]
    finally:
        ranks.close()


def test_prompt_logprobs_across_ranks(checkpoints):
    """Requests placed on both ranks (chunked prefill there) bring their prompt logprobs back to
    rank 0, equal to transformers'; max_tokens 0 among them."""
    path, hf_model = checkpoints["deepseek"]
    requests = [(PROMPTS[0], 2), (PROMPTS[1], 0), (PROMPTS[2], 3), (PROMPTS[0][:7], 1)]
    results = run_ranks(rank_main, 2, path, requests, timeout_s=120)
    for result in results:
        assert result.error is None, result.error
    for (prompt, max_tokens), (prompt_logprobs, outputs) in zip(requests, results[0].value):
        check_against_reference(prompt_logprobs, hf_model, prompt, 2)
        assert len(outputs) == max_tokens
