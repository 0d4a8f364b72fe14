"""Prefix caching: the page allocator's cache and eviction order, page keys, greedy identity with
caching on and off for every speculation mode (hits on and off page boundaries, multi-turn hits
on pages written by speculative steps, preemption, n > 1), memory pressure, the HTTP usage field."""
import pytest
import torch

from moespec import LLM, SamplingParams
from moespec.kv_cache import PageAllocator, PageKeys
from moespec.sequence import Sequence


def tokens(n, seed, vocab=120):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# ---------------------------------------------------------------------- allocator and keys

def test_cached_pages_are_evicted_least_recently_used_and_leaves_first():
    a = PageAllocator(6, 4)
    first, second = a.allocate(3), a.allocate(2)  # two requests: pages [0, 1, 2] and [3, 4]
    for page, key in zip(first + second, [b"a0", b"a1", b"a2", b"b0", b"b1"]):
        assert a.publish(page, key)
    a.free(first)  # a2 (the leaf), a1, a0: in eviction order
    a.free(second)
    assert a.num_free == 6 and a.num_cached == 5 and not any(a.refs)
    assert a.lookup([b"a0", b"a1", b"x", b"a2"]) == first[:2]
    a.take(first[:2])  # a hit: a0 and a1 are used again ...
    a.free(first[:2])  # ... and let go: now the most recently used, a1 before a0
    got = a.allocate(6)  # the free page, then evictions in order
    assert got[1:] == [first[2], second[1], second[0], first[1], first[0]]
    assert a.num_cached == 0 and a.lookup([b"a0"]) == []


def test_a_key_is_published_once_and_used_pages_are_never_evicted():
    a = PageAllocator(3, 2)
    pages = a.allocate(2)
    assert a.publish(pages[0], b"k") and not a.publish(pages[1], b"k")  # a twin stays private
    a.take([pages[0]])  # a second user
    a.free(pages)
    assert a.refs[pages[0]] == 1 and a.num_free == 2  # the twin went back to the free list
    a.free([pages[0]])
    with pytest.raises(RuntimeError, match="freed more times"):
        a.free([pages[0]])


def test_page_keys_chain_over_earlier_pages_salt_and_lookahead():
    def keys(ids, lookahead=0, salt=None):
        seq = Sequence("r", ids, SamplingParams(cache_salt=salt))
        return PageKeys(4, lookahead, "model").update(seq)

    base = keys(list(range(12)))
    assert len(base) == 3 and len(set(base)) == 3
    assert keys(list(range(12)) + [5, 6])[:3] == base  # later tokens do not change earlier pages
    changed = keys([99] + list(range(1, 12)))
    assert all(x != y for x, y in zip(changed, base))  # a page's key covers every page before it
    assert keys(list(range(12)), salt="tenant")[0] != base[0]
    ahead = keys(list(range(12)), lookahead=1)
    assert len(ahead) == 2  # the last page's key needs the token after it
    assert keys(list(range(12)) + [7], lookahead=1)[2] != keys(list(range(12)) + [8], lookahead=1)[2]


# ---------------------------------------------------------------------- engine: greedy identity

def shared_prefix_batch(prefix_len: int, count: int = 6) -> list[list[int]]:
    """Prompts sharing a prefix with distinct tails, one equal to the prefix, one a repeat."""
    prefix = tokens(prefix_len, seed=1)
    batch = [prefix + tokens(3 + i, seed=10 + i) for i in range(count)]
    return batch + [prefix, list(batch[0])]


MODES = {
    "none": None,
    "mtp1": {"mode": "mtp", "num_speculative_tokens": 1, "adaptive": False},
    "mtp2": {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False},
    "mtp3": {"mode": "mtp", "num_speculative_tokens": 3, "adaptive": False},
    "draft": {"mode": "draft", "num_speculative_tokens": 4, "adaptive": False},
}


def run(path, spec, batch, params=GREEDY, caching=True, **options):
    opts = dict(page_size=4, num_kv_pages=256, prefix_caching=caching)
    opts.update(options)
    llm = LLM(model=path, speculation=spec, **opts)
    return llm.generate(batch, params, use_tqdm=False), llm


def model_for(mode, deepseek_mtp, llama_pair):
    if mode != "draft":
        return deepseek_mtp, MODES[mode]
    return llama_pair[0], {**MODES[mode], "draft_model": llama_pair[1]}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("prefix_len", [16, 18])  # the shared prefix ends on a page boundary, then mid-page
def test_greedy_identical_with_caching_on_and_off(deepseek_mtp, llama_pair, mode, prefix_len):
    path, spec = model_for(mode, deepseek_mtp, llama_pair)
    batch = shared_prefix_batch(prefix_len)
    ref, _ = run(path, spec, batch, caching=False)
    got, llm = run(path, spec, batch)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    cached = [o.num_cached_tokens for o in got]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])  # the rest waited for the first's pages
    lookahead = 1 if mode.startswith("mtp") else 0  # the MTP layer's KV at a page's end reads the next token
    assert max(cached[1:-2]) == (prefix_len - lookahead) // 4 * 4
    assert cached[-2] == (prefix_len - 1) // 4 * 4  # the whole prompt cached: its last token is recomputed
    if spec is not None:
        assert llm.engine.spec_stats.steps > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_next_turn_hits_pages_written_by_speculative_steps(deepseek_mtp, llama_pair, mode):
    """Turn 2 = turn 1's prompt and output plus a new message: its hit covers pages whose KV (the
    target's, the draft's, the MTP layer's) came from verify steps and draft re-runs; only
    accepted tokens were published, or its output would differ."""
    path, spec = model_for(mode, deepseek_mtp, llama_pair)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    firsts = [tokens(7, seed=3), tokens(10, seed=4)]
    outputs = {}
    for caching in (False, True):
        llm = LLM(model=path, speculation=spec, page_size=4, num_kv_pages=256, prefix_caching=caching)
        turn1 = llm.generate(firsts, params, use_tqdm=False)
        seconds = [p + o.token_ids + tokens(5, seed=20 + i) for i, (p, o) in enumerate(zip(firsts, turn1))]
        turn2 = llm.generate(seconds, params, use_tqdm=False)
        outputs[caching] = ([o.token_ids for o in turn1 + turn2], [o.num_cached_tokens for o in turn2])
    assert outputs[True][0] == outputs[False][0]
    assert all(c >= 20 for c in outputs[True][1]) and outputs[False][1] == [0, 0]


@pytest.mark.parametrize("mode", ["none", "mtp1", "draft"])
def test_hits_under_preemption_and_memory_pressure(deepseek_mtp, llama_pair, mode):
    """A cache far smaller than the working set: hits, preemptions (a preempted request finds its
    own pages), evictions; the same tokens as with a large cache and caching off."""
    path, spec = model_for(mode, deepseek_mtp, llama_pair)
    batch = shared_prefix_batch(12, count=5) + shared_prefix_batch(20, count=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref, _ = run(path, spec, batch, params, caching=False)
    got, llm = run(path, spec, batch, params, num_kv_pages=24)  # 96 slots for ~16 requests of ~40 tokens
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert sum(o.num_cached_tokens > 0 for o in got) >= 8
    assert llm.engine.allocator.num_cached > 0  # idle: pages are free or cached (conftest: none used)


@pytest.mark.parametrize("mode", ["mtp2", "draft"])
def test_hits_with_chunked_prefill(deepseek_mtp, llama_pair, mode):
    """Prefill chunks of 6 tokens: the rest after a hit is chunked too, and pages are published
    (and waited for) chunk by chunk."""
    path, spec = model_for(mode, deepseek_mtp, llama_pair)
    batch = shared_prefix_batch(26, count=4)
    ref, _ = run(path, spec, batch, caching=False, max_num_batched_tokens=6)
    got, _ = run(path, spec, batch, max_num_batched_tokens=6)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(o.num_cached_tokens >= 20 for o in got[1:])


def test_abort_lets_shared_pages_go_and_keeps_them_cached(deepseek_mtp):
    """Aborting requests mid-prefill and mid-decode frees their own pages, leaves the pages they
    share with others in use, and what they computed stays cached for a later request."""
    llm = LLM(model=deepseek_mtp, page_size=4, num_kv_pages=64, max_num_batched_tokens=8,
              speculation=MODES["mtp1"])
    engine, prefix = llm.engine, tokens(16, seed=9)
    seqs = [engine.add_request(prefix + tokens(6, seed=30 + i), GREEDY) for i in range(3)]
    for _ in range(4):
        engine.step()
    assert seqs[0].output_ids and not seqs[2].output_ids  # one decodes, one still prefills
    engine.abort(seqs[0].request_id)
    engine.abort(seqs[2].request_id)
    assert not seqs[0].pages and not seqs[2].pages
    assert all(engine.allocator.refs[p] == 1 for p in seqs[1].pages)  # only its own user left
    while engine.has_unfinished():
        engine.step()
    later = llm.generate([prefix + tokens(6, seed=30)], GREEDY, use_tqdm=False)[0]
    assert later.num_cached_tokens == 20  # the aborted request's prompt pages (its 22nd token: not a page)


def test_n_completions_share_their_prompt_pages(deepseek_mtp):
    prompt = tokens(21, seed=5)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6)
    (out,), _ = run(deepseek_mtp, None, [prompt], params)
    assert sorted(o.metrics.num_cached_tokens for o in out.outputs) == [0, 20, 20, 20]
    (ref,), _ = run(deepseek_mtp, None, [prompt], params, caching=False)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]


def test_cache_salt_keeps_requests_apart(deepseek_mtp):
    prompt = tokens(17, seed=6)
    llm = LLM(model=deepseek_mtp, page_size=4, num_kv_pages=64)
    llm.generate([prompt], SamplingParams(max_tokens=2, cache_salt="a"), use_tqdm=False)
    other, same = (llm.generate([prompt], SamplingParams(max_tokens=2, cache_salt=salt), use_tqdm=False)[0]
                   for salt in ("b", "a"))
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 16
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


class Drafter:
    """A speculator's view for the scheduler: which positions its caches hold."""

    def __init__(self, from_tokens: bool, held: int) -> None:
        self.kv_from_tokens, self.held = from_tokens, held

    def kv_tokens(self, seq) -> int:
        return self.held


@pytest.mark.parametrize("from_tokens", [True, False])
def test_a_hit_takes_pages_without_speculator_kv_only_if_it_can_compute_that_kv(from_tokens):
    """A draft model can fill its KV of a cached page from the tokens; the MTP layer cannot (it
    needs the target's hidden states), so it takes only pages its KV was cached with."""
    from moespec.config import SchedulerSection
    from moespec.scheduler import Scheduler

    allocator = PageAllocator(16, 4)
    drafter = Drafter(from_tokens, held=4)  # the first writer's speculator holds one page
    scheduler = Scheduler(SchedulerSection(), allocator, 64, PageKeys(4, 0, "m"), drafter)
    first = Sequence("a", list(range(13)), GREEDY)
    scheduler.add(first)
    scheduler.schedule()
    first.num_computed = 13
    scheduler.finish(first)  # publishes 3 full pages, one of them with speculator KV
    assert allocator.num_cached == 3 and len(allocator.ready) == 1
    second = Sequence("b", list(range(14)), GREEDY)
    scheduler.add(second)
    out = scheduler.schedule()
    assert out.hits == [(second, 4)]  # the speculator starts at the ready page's end
    assert second.num_computed == (12 if from_tokens else 4)
    scheduler.finish(second)


@pytest.mark.parametrize("mode", ["none", "mtp", "draft"])
def test_a_shared_system_prompt_is_served_from_the_cache(mode):
    """64 requests sharing a 512-token system prompt, distinct user turns, 16 at a time: after the
    first request, at least 95% of the system prompt's tokens come from the cache in every mode
    (with MTP a page's key includes the token after it, so the last system page, followed by a
    different turn each time, is recomputed: 496 of 512)."""
    path = "checkpoints/tiny-llama" if mode == "draft" else "checkpoints/tiny-deepseek-v3"
    spec = {"none": None, "mtp": {"mode": "mtp", "num_speculative_tokens": 2},
            "draft": {"mode": "draft", "draft_model": "checkpoints/tiny-llama-draft", "num_speculative_tokens": 3}}
    system = tokens(512, seed=8, vocab=4096)
    turns = [tokens(16 + i % 24, seed=100 + i, vocab=4096) for i in range(64)]
    llm = LLM(model=path, speculation=spec[mode], max_num_seqs=16, num_kv_pages=256)
    outs = llm.generate([system + t for t in turns], SamplingParams(max_tokens=4), use_tqdm=False)
    served = sum(min(o.num_cached_tokens, 512) for o in outs[1:]) / (512 * 63)
    assert served >= (496 / 512 if mode == "mtp" else 1.0) >= 0.95
    assert outs[0].num_cached_tokens == 0


@pytest.mark.parametrize("mode", ["mtp2", "draft"])
def test_a_request_preempted_with_all_but_its_last_token_cached_resumes(deepseek_mtp, llama_pair, mode):
    """A request preempted after some outputs, whose computed tokens fill whole pages, comes back
    with every page but its last token cached: that one-token chunk is its prefill, not a decode
    step to speculate on (the MTP layer has no hidden state for it yet). Greedy output is
    unchanged."""
    path, spec = model_for(mode, deepseek_mtp, llama_pair)
    prompt, params = tokens(9, seed=3), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref, _ = run(path, spec, [prompt], params, caching=False)
    llm = LLM(model=path, speculation=spec, page_size=4, num_kv_pages=64, prefix_caching=True)
    engine = llm.engine
    seq = engine.add_request(prompt, params)
    while not (seq.output_ids and (seq.num_tokens - 1) % 4 == 0 and len(seq.output_ids) < 20):
        engine.step()
        assert not seq.is_finished
    engine.scheduler.preempt(seq)
    engine.speculator.release(seq)
    scheduled = engine.schedule()  # what the next step runs, seen first
    assert [(c.start, c.num_tokens) for c in scheduled.chunks] == [(seq.num_tokens - 1, 1)], scheduled.chunks
    assert not scheduled.is_decode_only
    engine.scheduler.preempt(seq)  # and put back as it was
    engine.speculator.release(seq)
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == ref[0].token_ids
