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

Captured steps (`model.cuda_graph`, moespec.static_step.CapturedStep) take `static_plan()`: a
copy whose wrappers are FlashInfer's CUDA-graph ones (`use_cuda_graph=True`), reading index
buffers fixed at construction, sized for the step's batch at `kv_capacity` positions per
request. `load_plan()` plans them again before each replay, outside the graph: FlashInfer copies
the new indices into those buffers and its schedule into its workspace, where the captured
kernels read them. Their shapes do not depend on the KV length, so one graph per batch shape
serves every length (`shapes_follow_kv_length`).

This path needs a CUDA machine; it has not yet run on one (tests/test_gpu.py checks it against
the torch backend there). On the CPU, tests/fake_flashinfer.py stands in for the library.
"""
from __future__ import annotations

import torch

from moespec.attention.base import AttentionMetadata, LayerKV

WORKSPACE_BYTES = 128 * 1024 * 1024
INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # each wrapper's own (FlashInfer allocates it), as much pinned on the host


class FlashInferAttention:
    shapes_follow_kv_length = False  # a captured step's shapes are the same at every KV length

    def __init__(self, device: str | torch.device = "cuda", workspace: torch.Tensor | None = None,
                 graph_shape: tuple[int, int] | None = None) -> None:
        """`graph_shape` (requests B, most pages): CUDA-graph wrappers over index buffers of
        those sizes (`static_plan`); `workspace`: the float workspace to share (graphs replay one
        at a time on one stream, as eager steps run), else this backend's own, made here so that
        every copy of it (a static step's plan is a shallow copy) and every captured plan shares it."""
        import flashinfer  # imported only when configured

        self.flashinfer = flashinfer
        self.device = torch.device(device)
        self.workspace = (workspace if workspace is not None else
                          torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device))
        self.graph_shape = graph_shape
        self.kv_capacity = 0  # captured steps: the KV positions per request their index buffers hold
        self.wrappers: dict[str, object] = {}
        self.meta: AttentionMetadata | None = None
        self.slots: torch.Tensor | None = None  # [T] cache rows this step's keys and values go to
        self.planned: tuple | None = None  # the head layout the wrappers are planned for
        # each wrapper's last plan, an event after it (CUDA): a plan stages its schedule in the
        # wrapper's one pinned host buffer and copies it to the device asynchronously (prefill.py
        # `_pin_memory_int_workspace_buffer`), so the next plan of that wrapper waits for the copy
        self.staged: dict[str, object] = {}
        self.new_event = (lambda: torch.cuda.Event()) if self.device.type == "cuda" else None

    def wrapper(self, kind: str):
        if kind not in self.wrappers:
            self.wrappers[kind] = self.new_wrapper(kind)
        return self.wrappers[kind]

    def new_wrapper(self, kind: str):
        workspace = self.workspace
        if self.graph_shape is None:
            if kind == "mla":
                return self.flashinfer.BatchMLAPagedAttentionWrapper(workspace)
            return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        B, pages = self.graph_shape

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        if kind == "mla":
            return self.flashinfer.BatchMLAPagedAttentionWrapper(
                workspace, use_cuda_graph=True, qo_indptr=buffer(B + 1), kv_indptr=buffer(B + 1),
                kv_indices=buffer(pages), kv_len_arr=buffer(B))
        return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=buffer(B + 1), paged_kv_indptr_buf=buffer(B + 1),
            paged_kv_indices_buf=buffer(pages), paged_kv_last_page_len_buf=buffer(B))

    def plan(self, meta: AttentionMetadata) -> None:
        """The rows this step's keys and values go to, from device tensors without reading them: the
        token count is the host's (without `output_size`, repeat_interleave waits for the device)."""
        S = meta.page_size
        request = torch.repeat_interleave(torch.arange(meta.num_requests, device=meta.positions.device),
                                          meta.q_lens(), output_size=meta.positions.shape[0])  # [T]
        page = meta.kv_indices[meta.kv_indptr[request] + meta.positions // S]
        self.slots = page * S + meta.positions % S  # [T]
        self.meta = meta
        self.planned = None

    def plan_wrapper(self, layout: tuple) -> None:
        """Plan the wrapper of this batch for a head layout (H, Hk, Dk, Dv, scale, MLA, q dtype,
        cache dtype), from the host copy of the metadata: no copy back from the device."""
        meta, int32 = self.meta.host or self.meta, torch.int32
        H, Hk, Dk, v_dim, scale, mla, q_dtype, kv_dtype = layout
        qo, kv, idx = meta.qo_indptr.to(int32), meta.kv_indptr.to(int32), meta.kv_indices.to(int32)
        kind = "mla" if mla else "paged"
        self.wait_staged(kind)
        if mla:
            if meta.custom_mask is not None:
                raise NotImplementedError("FlashInfer MLA attention has no custom (tree) mask; use the torch backend")
            self.wrapper(kind).plan(qo, kv, idx, meta.kv_lens().to(int32), H, v_dim, Dk - v_dim, meta.page_size,
                                    True, scale, q_dtype, kv_dtype)
        else:
            self.wrapper(kind).plan(qo, kv, idx, meta.kv_last_page_len.to(int32), H, Hk, Dk, meta.page_size,
                                    head_dim_vo=v_dim, custom_mask=meta.custom_mask,
                                    causal=meta.custom_mask is None, sm_scale=scale, q_data_type=q_dtype,
                                    kv_data_type=kv_dtype)
        if self.new_event is not None:
            self.staged[kind] = self.new_event()
            self.staged[kind].record()
        self.planned = layout

    def wait_staged(self, kind: str) -> None:
        """Before a wrapper is planned again: wait until its last plan's staged schedule has been
        copied to the device (a draft chain plans one wrapper several times a step, with nothing
        else waiting on the device in between)."""
        event = self.staged.pop(kind, None)
        if event is not None:
            event.synchronize()

    def static_plan(self) -> FlashInferAttention:
        """A copy of this plan for a captured step: CUDA-graph wrappers over index buffers for
        this batch's requests at `kv_capacity` positions each, its own written slots, the shared
        workspace. The wrappers are planned at the step's first (uncaptured) run."""
        host = self.meta.host or self.meta
        if not self.kv_capacity:
            raise ValueError("a captured FlashInfer step needs kv_capacity, the KV positions its buffers hold")
        pages = host.num_requests * -(-self.kv_capacity // host.page_size)
        fixed = FlashInferAttention(self.device, self.workspace, (host.num_requests, pages))
        fixed.meta, fixed.slots = self.meta, self.slots.clone()
        return fixed

    def load_plan(self, other: FlashInferAttention) -> None:
        """Make `other`'s plan (a batch of the same shape) this one's: its written slots copied
        into this one's, and the CUDA-graph wrappers planned again for its batch."""
        if other.slots.shape != self.slots.shape:
            raise ValueError(f"plan written slots {tuple(other.slots.shape)} differ from the captured "
                             f"{tuple(self.slots.shape)}")
        self.slots.copy_(other.slots)
        self.meta = other.meta
        if self.planned is not None:
            self.plan_wrapper(self.planned)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cache: LayerKV | None,
            scale: float, v_dim: int) -> torch.Tensor:
        k_rows = cache.k.view(-1, *cache.k.shape[2:])  # [P*S, Hk, Dk]
        k_rows[self.slots] = k.to(k_rows.dtype)
        if cache.v is not None:
            cache.v.view(-1, *cache.v.shape[2:])[self.slots] = v.to(cache.v.dtype)
        layout = (q.shape[1], cache.k.shape[2], q.shape[2], v_dim, scale, cache.v is None, q.dtype, cache.k.dtype)
        if self.planned != layout:
            self.plan_wrapper(layout)
        if cache.v is None:
            latent = cache.k[:, :, 0]  # [P, S, C+R]
            return self.wrapper("mla").run(q[..., :v_dim], q[..., v_dim:], latent[..., :v_dim], latent[..., v_dim:])
        return self.wrapper("paged").run(q, (cache.k, cache.v))
