"""Engine end to end (no speculation): greedy equals transformers, batch/preemption independence."""
import pytest
import torch

from moespec import LLM, SamplingParams
from tiny_models import save_tiny_deepseek, save_tiny_llama


@pytest.fixture(scope="module", params=["deepseek_v3", "llama"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_deepseek(path) if request.param == "deepseek_v3" else save_tiny_llama(path)
    return str(path), hf


def prompts(lengths, vocab=120, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def hf_greedy(hf, prompt, max_tokens):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_with_chunked_prefill(tiny):
    path, hf = tiny
    batch = prompts([5, 23, 9, 17])
    llm = LLM(model=path, page_size=4, num_kv_pages=128, max_num_batched_tokens=16)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 12)
        assert out.finish_reason == "length"


def test_output_independent_of_batch_and_preemption(tiny):
    path, _ = tiny
    batch = prompts([7, 13, 21, 4, 11, 16], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [LLM(model=path, page_size=4, num_kv_pages=64).generate([p], params, use_tqdm=False)[0].token_ids
             for p in batch[:2]]
    # 14 pages of 4 tokens cannot hold six requests of up to 41 tokens: preemption must happen
    tight = LLM(model=path, page_size=4, num_kv_pages=14, max_num_batched_tokens=32)
    outs = tight.generate(batch, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    roomy = LLM(model=path, page_size=4, num_kv_pages=256).generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert [o.token_ids for o in outs[:2]] == alone


def test_penalties_keep_counts_across_steps_and_preemption(tiny, monkeypatch):
    """A penalized request's token counts are made once and caught up at each step, dropped when
    it is preempted and made again when it runs; its tokens equal greedy decoding with the
    penalties counted from the whole token lists at every step."""
    from reference import paged_forward

    import moespec.sequence as sequence
    from moespec.sampling import SamplingBatch, greedy_tokens
    path, _ = tiny
    made = []

    class Counted(sequence.TokenCounts):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(sequence, "TokenCounts", Counted)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, repetition_penalty=1.6,
                            frequency_penalty=0.4, presence_penalty=0.3)
    batch = prompts([7, 13, 21, 4], seed=2)
    llm = LLM(model=path, page_size=4, num_kv_pages=12, max_num_batched_tokens=32)
    outs = llm.generate(batch, params, use_tqdm=False)
    preemptions = sum(o.metrics.num_preemptions for o in outs)
    assert preemptions > 0
    # once per request and once more per preemption after which it sampled again (here: each),
    # not once per step (14 each)
    assert len(batch) < len(made) <= len(batch) + preemptions
    model, V = llm.engine.model, llm.engine.vocab_size
    for prompt, out in zip(batch, outs):
        expected = []
        for _ in range(params.max_tokens):
            logits = paged_forward(model, [prompt + expected])[0][-1:].float()
            rows = SamplingBatch.build([params], [prompt], [list(expected)], V, "cpu")
            expected.append(int(greedy_tokens(logits, rows)[0]))
        assert out.token_ids == expected


def test_seeded_sampling_reproducible_regardless_of_batch(tiny):
    path, _ = tiny
    llm = LLM(model=path, page_size=4, num_kv_pages=128)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    target = prompts([9])[0]
    alone = llm.generate([target], seeded, use_tqdm=False)[0].token_ids
    mixed = llm.generate(prompts([5, 12]) + [target], [other, other, seeded], use_tqdm=False)[2].token_ids
    assert alone == mixed


def test_n_completions_and_max_model_len(tiny):
    path, _ = tiny
    llm = LLM(model=path, page_size=4, num_kv_pages=64, max_model_len=20)
    out = llm.generate(prompts([15]), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in out.outputs)  # 15 + 5 = max_model_len
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts([25]), GREEDY, use_tqdm=False)


def test_stop_token_ids_and_logprobs(tiny):
    path, hf = tiny
    prompt = prompts([10], seed=3)[0]
    expected = hf_greedy(hf, prompt, 12)
    stop_at = expected[5]
    llm = LLM(model=path, page_size=4, num_kv_pages=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at], logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    first = expected.index(stop_at)
    assert out.token_ids == expected[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + expected[:first + 1]])).logits[0].float(), -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert list(lp.top) == row.topk(3).indices.tolist()


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A random Llama over the project's tokenizer (vocab 4096), so text paths run for real."""
    import shutil
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("llama-tok")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=1, bos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"checkpoints/tokenizer/{f}", path / f)
    return str(path)


def test_stop_strings_truncate_text_exactly(tiny_with_tokenizer):
    llm = LLM(model=tiny_with_tokenizer, page_size=8, num_kv_pages=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = llm.generate(["def main():"], params, use_tqdm=False)[0]
    assert free.text and free.text == llm.get_tokenizer().decode(free.token_ids, skip_special_tokens=True)
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 3]
    cut = free.text.index(stop)
    for include in (False, True):
        out = llm.generate(["def main():"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                           stop=[stop], include_stop_str_in_output=include),
                           use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert out.text == free.text[: cut + (len(stop) if include else 0)]
        assert out.token_ids == free.token_ids[: len(out.token_ids)]


def test_abort_frees_pages_and_others_continue(tiny):
    path, _ = tiny
    llm = LLM(model=path, page_size=4, num_kv_pages=64)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    keep = engine.add_request(prompts([9])[0], params)
    drop = engine.add_request(prompts([14], seed=5)[0], params)
    for _ in range(5):
        engine.step()
    assert drop.pages and len(drop.output_ids) > 0
    engine.abort(drop.request_id)
    assert drop.finish_reason == "abort" and not drop.pages
    while engine.has_unfinished():
        engine.step()
    assert keep.finish_reason == "length" and len(keep.output_ids) == 30
    alone = LLM(model=path, page_size=4, num_kv_pages=64).generate([prompts([9])[0]], params, use_tqdm=False)
    assert keep.output_ids == alone[0].token_ids
