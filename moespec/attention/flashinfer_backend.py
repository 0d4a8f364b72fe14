"""FlashInfer attention for CUDA, behind the same plan/run interface as the torch backend.

- Standard attention (Llama, GQA): `BatchPrefillWithPagedKVCacheWrapper` serves prefill
  chunks, decode and multi-token verify alike (queries are always the last q_len positions of
  their request's KV, FlashInfer's causal alignment), and tree verify through `custom_mask`.
- MLA (DeepSeek, values = first C dims of the latent cache): `BatchMLAPagedAttentionWrapper`
  over the latent (C) and rope-key (R) parts of the cache; causal only (no custom mask).

FlashInfer needs the head layout at plan time, which the model reveals at its first layer:
`plan()` records the batch metadata and the wrapper is planned on the first `run()` of the
step; every later layer (and the MTP layer on the same batch) reuses it. The wrapper is planned
from the batch's host copy (`AttentionMetadata.host`), so planning never reads the device. New
keys/values are written into the cache with one index_put per layer, as in the torch backend.
The workspace lives on the model's device (never on bare "cuda": that is GPU 0 for every rank).

This path needs a CUDA machine; it has not yet run on one (tests/test_gpu.py checks it against
the torch backend there).
"""
from __future__ import annotations

import torch

from moespec.attention.base import AttentionMetadata, LayerKV

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttention:
    def __init__(self, device: str | torch.device = "cuda") -> None:
        import flashinfer  # imported only when configured

        self.flashinfer = flashinfer
        self.device = torch.device(device)
        self.workspace: torch.Tensor | None = None
        self.wrappers: dict[str, object] = {}
        self.meta: AttentionMetadata | None = None
        self.planned: tuple | None = None

    def wrapper(self, kind: str):
        if self.workspace is None:
            self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        if kind not in self.wrappers:
            if kind == "mla":
                self.wrappers[kind] = self.flashinfer.BatchMLAPagedAttentionWrapper(self.workspace)
            else:
                self.wrappers[kind] = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self.wrappers[kind]

    def plan(self, meta: AttentionMetadata) -> None:
        S = meta.page_size
        request = torch.repeat_interleave(torch.arange(meta.num_requests, device=meta.positions.device),
                                          meta.q_lens())
        page = meta.kv_indices[meta.kv_indptr[request] + meta.positions // S]
        self.slots = page * S + meta.positions % S  # [T]
        self.meta = meta
        self.planned = None

    def plan_wrapper(self, q: torch.Tensor, cache: LayerKV, scale: float, v_dim: int) -> None:
        meta, int32 = self.meta.host or self.meta, torch.int32  # host tensors: no copy back from the device
        H, Dk = q.shape[1], q.shape[2]
        key = (H, cache.k.shape[2], Dk, v_dim, scale, cache.v is None)
        if self.planned == key:
            return
        qo, kv, idx = meta.qo_indptr.to(int32), meta.kv_indptr.to(int32), meta.kv_indices.to(int32)
        if cache.v is None:
            if meta.custom_mask is not None:
                raise NotImplementedError("FlashInfer MLA attention has no custom (tree) mask; use the torch backend")
            self.wrapper("mla").plan(qo, kv, idx, meta.kv_lens().to(int32), H, v_dim, Dk - v_dim, meta.page_size,
                                     True, scale, q.dtype, cache.k.dtype)
        else:
            self.wrapper("paged").plan(qo, kv, idx, meta.kv_last_page_len.to(int32), H, cache.k.shape[2], Dk,
                                       meta.page_size, head_dim_vo=v_dim, custom_mask=meta.custom_mask,
                                       causal=meta.custom_mask is None, sm_scale=scale, q_data_type=q.dtype,
                                       kv_data_type=cache.k.dtype)
        self.planned = key

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cache: LayerKV | None,
            scale: float, v_dim: int) -> torch.Tensor:
        k_rows = cache.k.view(-1, *cache.k.shape[2:])  # [P*S, Hk, Dk]
        k_rows[self.slots] = k.to(k_rows.dtype)
        if cache.v is not None:
            cache.v.view(-1, *cache.v.shape[2:])[self.slots] = v.to(cache.v.dtype)
        self.plan_wrapper(q, cache, scale, v_dim)
        if cache.v is None:
            latent = cache.k[:, :, 0]  # [P, S, C+R]
            return self.wrapper("mla").run(q[..., :v_dim], q[..., v_dim:], latent[..., :v_dim], latent[..., v_dim:])
        return self.wrapper("paged").run(q, (cache.k, cache.v))
