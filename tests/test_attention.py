"""The paged torch attention backend against a direct per-request computation: prefill chunks,
decode, multi-token verify, custom (tree) masks, GQA and MLA-style shared K/V."""
import pytest
import torch

from moespec.attention import AttentionMetadata, LayerKV, TorchPagedAttention
from moespec.kv_cache import PageAllocator

S = 4


def metadata(requests, pages, custom_mask=None):
    """requests: list of (start position, q_len); pages: each request's page list."""
    qo, kv, indices, last, positions = [0], [0], [], [], []
    for (start, q_len), own in zip(requests, pages):
        end = start + q_len
        used = -(-end // S)
        qo.append(qo[-1] + q_len)
        kv.append(kv[-1] + used)
        indices += own[:used]
        last.append(end - (used - 1) * S)
        positions += range(start, end)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return AttentionMetadata(t(qo), t(kv), t(indices), t(last), t(positions), S, custom_mask)


def reference(q, keys, values, mask, scale):
    """q [n,H,D], keys/values [L,Hk,D] for one request, mask [n,L] -> [n,H,Dv]."""
    rep = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("mla", [False, True])
def test_paged_attention_matches_direct_computation(mla):
    torch.manual_seed(0)
    H, Hk, D, Dv = (4, 1, 12, 8) if mla else (4, 2, 8, 8)
    allocator = PageAllocator(64, S)
    cache = LayerKV(torch.zeros(64, S, Hk, D), None if mla else torch.zeros(64, S, Hk, Dv))
    history = [9, 3, 14]  # tokens already cached per request
    pages = [allocator.allocate(6) for _ in history]
    pages = [p[::-1] for p in pages]  # non-contiguous page order
    all_k = [torch.randn(n + 3, Hk, D) for n in history]
    all_v = [k[..., :Dv] if mla else torch.randn(k.shape[0], Hk, Dv) for k in all_k]
    backend = TorchPagedAttention()
    # step 1: prefill the history in one batch
    backend.plan(metadata([(0, n) for n in history], pages))
    q0 = torch.randn(sum(history), H, D)
    out0 = backend.run(q0, torch.cat([k[:n] for k, n in zip(all_k, history)]),
                       None if mla else torch.cat([v[:n] for v, n in zip(all_v, history)]), cache, 0.3, Dv)
    offset = 0
    for k, v, n in zip(all_k, all_v, history):
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        assert torch.allclose(out0[offset:offset + n], reference(q0[offset:offset + n], k[:n], v[:n], causal, 0.3),
                              atol=1e-5)
        offset += n
    # step 2: verify (3 tokens), decode (1 token), and a tree-masked verify (3 tokens)
    q_lens = [3, 1, 3]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two siblings under one root
    masks = []
    for n, q_len in zip(history, q_lens):
        m = torch.ones(q_len, n + q_len, dtype=torch.bool)
        m[:, n:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        masks.append(m)
    masks[2][:, history[2]:] = tree
    custom = torch.cat([m.flatten() for m in masks])
    for use_custom in (False, True):
        backend.plan(metadata(list(zip(history, q_lens)), pages, custom if use_custom else None))
        assert len(backend.groups) == (1 if use_custom else 2)  # the decode request is planned apart
        q = torch.randn(sum(q_lens), H, D)
        new_k = torch.cat([k[n:n + q] for k, n, q in zip(all_k, history, q_lens)])
        new_v = None if mla else torch.cat([v[n:n + q] for v, n, q in zip(all_v, history, q_lens)])
        out = backend.run(q, new_k, new_v, cache, 0.3, Dv)
        offset = 0
        for b, (k, v, n, q_len) in enumerate(zip(all_k, all_v, history, q_lens)):
            mask = masks[b] if use_custom else torch.ones(q_len, n + q_len, dtype=torch.bool).tril(n)
            ref = reference(q[offset:offset + q_len], k[:n + q_len], v[:n + q_len], mask, 0.3)
            assert torch.allclose(out[offset:offset + q_len], ref, atol=1e-5)
            offset += q_len


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("lengths", [[7], [8], [5, 12, 1]])
@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("capacity", [0, 40])
def test_uniform_plan_matches_direct_computation(mla, lengths, Q, capacity):
    """Batches where every request has Q queries (decode, verify) take the uniform plan: one
    group, causal within the new tokens, no mask at all for a single decode query. With a KV
    capacity (captured steps) every request reads that many positions, the rest masked, and a
    captured copy of the plan refilled in place attends the same."""
    torch.manual_seed(1)
    H, Hk, D, Dv = (4, 1, 12, 8) if mla else (4, 2, 8, 8)
    cache = LayerKV(torch.zeros(32, S, Hk, D), None if mla else torch.zeros(32, S, Hk, Dv))
    pages = [list(range(8 * b + 7, 8 * b - 1, -1)) for b in range(len(lengths))]
    all_k = [torch.randn(n + Q, Hk, D) for n in lengths]
    all_v = [k[..., :Dv] if mla else torch.randn(k.shape[0], Hk, Dv) for k in all_k]
    backend = TorchPagedAttention(capacity)
    backend.plan(metadata([(0, n) for n in lengths], pages))
    backend.run(torch.randn(sum(lengths), H, D), torch.cat([k[:-Q] for k in all_k]),
                None if mla else torch.cat([v[:-Q] for v in all_v]), cache, 0.3, Dv)
    backend.plan(metadata([(n, Q) for n in lengths], pages))
    assert len(backend.groups) == 1 and backend.groups[0].shape == (len(lengths), Q)
    assert (backend.groups[0].mask is None) == (len(lengths) == Q == 1 and not capacity)
    if capacity:
        assert backend.groups[0].kv_slots.shape == (len(lengths), capacity)
        captured = TorchPagedAttention(capacity)
        captured.plan(metadata([(n - 1, Q) for n in lengths], pages))  # another step's plan, same shapes
        captured = captured.static_plan()
        tensors = [t.data_ptr() for t in captured.plan_tensors()]
        captured.load_plan(backend)
        assert [t.data_ptr() for t in captured.plan_tensors()] == tensors
        backend = captured
    q = torch.randn(len(lengths) * Q, H, D)
    out = backend.run(q, torch.cat([k[-Q:] for k in all_k]), None if mla else torch.cat([v[-Q:] for v in all_v]),
                      cache, 0.3, Dv)
    for b, (k, v, n) in enumerate(zip(all_k, all_v, lengths)):
        causal = torch.ones(Q, n + Q, dtype=torch.bool).tril(n)
        ref = reference(q[b * Q:(b + 1) * Q], k, v, causal, 0.3)
        assert torch.allclose(out[b * Q:(b + 1) * Q], ref, atol=1e-5)


@pytest.mark.parametrize("split", [1, 2])
def test_halves_planned_alone_match_the_whole_batch(split):
    """Two-batch overlap plans each half's requests alone (custom tree mask included): running each
    half on its own rows gives the whole batch's output, and writes the same KV."""
    from moespec.attention import plan_forward
    torch.manual_seed(1)
    H, D = 4, 8
    history, q_lens = [9, 3, 14], [3, 1, 3]
    allocator = PageAllocator(64, S)
    pages = [allocator.allocate(6)[::-1] for _ in history]
    caches = [LayerKV(torch.randn(64, S, 1, D), torch.randn(64, S, 1, D)) for _ in range(2)]
    caches[1] = LayerKV(caches[0].k.clone(), caches[0].v.clone())
    masks = [torch.ones(q, n + q, dtype=torch.bool).tril(n) for n, q in zip(history, q_lens)]
    masks[2][:, history[2]:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    meta = metadata(list(zip(history, q_lens)), pages, torch.cat([m.flatten() for m in masks]))
    q, k, v = torch.randn(7, H, D), torch.randn(7, 1, D), torch.randn(7, 1, D)
    ctx = plan_forward(TorchPagedAttention(), meta, [caches[0]], split)
    whole = ctx.backend.run(q, k, v, caches[0], 0.3, D)
    rows = [half.rows for half in ctx.halves]
    assert [h.requests for h in ctx.halves] == [slice(0, split), slice(split, 3)]
    assert rows == [slice(0, sum(q_lens[:split])), slice(sum(q_lens[:split]), 7)]
    halves = [ctx.half(i).backend.run(q[r], k[r], v[r], caches[1], 0.3, D) for i, r in enumerate(rows)]
    assert torch.allclose(torch.cat(halves), whole, atol=1e-6)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
