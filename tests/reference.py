"""Helpers that build random tiny HF checkpoints with transformers and run our models over them."""
from __future__ import annotations

import torch

from moespec.attention import AttentionMetadata, ForwardContext, TorchPagedAttention
from moespec.kv_cache import KVCache, PageAllocator


def randomize_routing(hf_model: torch.nn.Module, seed: int = 0) -> None:
    """transformers initializes e_score_correction_bias to zeros; make it matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)


def paged_forward(model, prompts: list[list[int]], page_size: int = 4, chunk: int | None = None,
                  num_pages: int = 256) -> list[torch.Tensor]:
    """Run prompts through the paged cache in chunks of `chunk` tokens per request per step
    (all requests in one batch each step); returns each prompt's logits [L, V]."""
    allocator = PageAllocator(num_pages, page_size)
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.kv_cache_spec(), num_pages, page_size, dtype)
    pages = [allocator.allocate(allocator.pages_for(len(p))) for p in prompts]
    done = [0] * len(prompts)
    outputs: list[list[torch.Tensor]] = [[] for _ in prompts]
    chunk = chunk or max(len(p) for p in prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        ids, positions, qo, kv, indices, last = [], [], [0], [0], [], []
        for i in active:
            end = min(done[i] + chunk, len(prompts[i]))
            ids += prompts[i][done[i]:end]
            positions += list(range(done[i], end))
            qo.append(qo[-1] + end - done[i])
            used = allocator.pages_for(end)
            indices += pages[i][:used]
            kv.append(kv[-1] + used)
            last.append(end - (used - 1) * page_size)
        meta = AttentionMetadata(torch.tensor(qo), torch.tensor(kv), torch.tensor(indices), torch.tensor(last),
                                 torch.tensor(positions), page_size)
        backend = TorchPagedAttention()
        backend.plan(meta)
        with torch.no_grad():
            logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions),
                                                ForwardContext(backend, cache.layers)))
        for j, i in enumerate(active):
            outputs[i].append(logits[qo[j]:qo[j + 1]])
            done[i] += qo[j + 1] - qo[j]
    return [torch.cat(o) for o in outputs]


def exact_joint(path, prompt: list[int], params, length: int) -> dict[tuple[int, ...], float]:
    """Distribution of the first `length` sampled tokens, from the target alone (no engine)."""
    from moespec.models import load_model
    from moespec.sampling import SamplingBatch, compute_probs
    model = load_model(path, show_progress=False)
    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, p in joint.items():
            logits = paged_forward(model, [prompt + list(seq)])[0][-1:]
            batch = SamplingBatch.build([params], [prompt], [list(seq)], logits.shape[-1], "cpu")
            probs = compute_probs(logits, batch)[0]
            for t in torch.nonzero(probs).flatten().tolist():
                nxt[seq + (t,)] = p * probs[t].item()
        joint = nxt
    return joint


def joint_pvalue(joint: dict[tuple[int, ...], float], outputs: list[list[int]]) -> float:
    """Chi-square p-value of sampled token sequences against `joint`; every output must lie in
    its support."""
    from scipy import stats
    counts: dict[tuple[int, ...], int] = {}
    for ids in outputs:
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    assert set(counts) <= set(joint), "a sampled sequence outside the target's support"
    cells = sorted(joint)
    total = sum(joint.values())
    return stats.chisquare([counts.get(c, 0) for c in cells], [joint[c] / total * len(outputs) for c in cells]).pvalue
