"""A stand-in for the `flashinfer` module on the CPU: the two wrappers moespec's FlashInfer
backend uses, with the contract read from FlashInfer's sources (flashinfer/prefill.py,
flashinfer/mla/_core.py), computed in plain torch.

What it holds the caller to, as FlashInfer does or needs:
- `plan` never runs inside torch.compile (nor inside a CUDA graph's capture);
- index tensors are int32; q and the cache are float16 or bfloat16, of the dtypes given to
  `plan`; head dims FlashInfer compiles (64, 128, 256; MLA: 512 latent + 64 rope);
- queries are the last q_len positions of their request's KV (causal alignment);
- with `use_cuda_graph=True`, index buffers are given at construction and `plan` copies into
  them: the batch size is the buffers', the pages at most theirs, the tokens at most the first
  plan's; `run` reads the buffers alone, with shapes fixed by their sizes and no host read, so a
  captured step replays correctly only when it was planned again before the replay.

- a plan stages its schedule in the wrapper's one pinned host buffer, copied to the device
  asynchronously: with `FakeWrapper.async_staging`, planning a wrapper again before an event
  recorded after its last plan was waited on (`FakeEvent`) is an error;
- the float workspace is a uint8 tensor; `FakeWrapper.workspaces` keeps the distinct ones
  handed to wrappers (FlashInfer keeps a reference and writes its partial results there).

Install with `install(monkeypatch)`; `FakeWrapper.runs` counts runs per mode.
"""
from __future__ import annotations

import sys
import types

import torch

HALF = (torch.float16, torch.bfloat16)


def check_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")


class FakeWrapper:
    runs = {"graph": 0, "eager": 0}
    workspaces: dict[int, torch.Tensor] = {}  # data_ptr -> each distinct float workspace given
    async_staging = False  # model the device's asynchronous copy of each plan's pinned staging buffer
    staging: set = set()  # wrappers whose last plan's staged copy may not have run yet

    def keep_workspace(self, workspace: torch.Tensor) -> None:
        if not torch.is_tensor(workspace) or workspace.dtype != torch.uint8:
            raise ValueError("float_workspace_buffer must be a uint8 tensor")
        self.workspace = workspace
        FakeWrapper.workspaces[workspace.data_ptr()] = workspace

    def init_buffers(self, use_cuda_graph: bool, buffers: dict[str, torch.Tensor | None]) -> None:
        self.use_cuda_graph = use_cuda_graph
        self.buffers: dict[str, torch.Tensor] = {}
        self.max_rows = None
        if use_cuda_graph:
            for name, buf in buffers.items():
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} should be a torch.Tensor in CUDA graph mode")
            self.buffers = dict(buffers)
            self.batch_size = len(self.buffers["qo_indptr"]) - 1

    def fill(self, **values: torch.Tensor) -> None:
        """plan's index tensors: copied into the fixed buffers (CUDA graph mode), else kept. Never
        inside torch.compile ("The plan method cannot be used in Cuda Graph or in torch.compile")."""
        if torch.compiler.is_compiling():
            raise RuntimeError("a FlashInfer wrapper's plan cannot run inside torch.compile")
        if self in FakeWrapper.staging:
            raise RuntimeError("planned again before its last plan's staged schedule was copied to the device: the "
                               "pinned staging buffer is overwritten under the copy still queued")
        if FakeWrapper.async_staging:
            FakeWrapper.staging.add(self)
        check_int32(**values)
        if not self.use_cuda_graph:
            self.buffers = {name: v.clone() for name, v in values.items()}
            return
        batch = len(values["qo_indptr"]) - 1
        if batch != self.batch_size:
            raise ValueError(f"the batch size should be fixed in cuda graph mode: {batch} != {self.batch_size}")
        if len(values["kv_indices"]) > len(self.buffers["kv_indices"]):
            raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
        rows = int(values["qo_indptr"][-1])
        if self.max_rows is not None and rows > self.max_rows:
            raise ValueError("the total number of rows exceeds the first plan's in cuda graph mode")
        self.max_rows = rows if self.max_rows is None else self.max_rows
        for name, v in values.items():
            self.buffers[name][: len(v)].copy_(v)

    def count_run(self) -> None:
        FakeWrapper.runs["graph" if self.use_cuda_graph else "eager"] += 1

    def rows_and_mask(self, T: int, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the cache row of each KV position of each token's request [T, L] and which of them
        the token attends [T, L], L = every page the index buffer holds: fixed shapes, no host read."""
        qo, kv_indptr, indices = self.buffers["qo_indptr"].long(), self.buffers["kv_indptr"].long(), \
            self.buffers["kv_indices"].long()
        S = self.page_size
        token = torch.arange(T, device=qo.device)
        request = torch.searchsorted(qo[1:], token, right=True)  # [T]
        q_lens = qo[1:] - qo[:-1]
        q_pos = kv_lens.long()[request] - q_lens[request] + token - qo[request]  # [T] causal alignment
        kv_pos = torch.arange(indices.numel() * S, device=qo.device)  # [L]
        page = (kv_indptr[request][:, None] + kv_pos[None] // S).clamp(max=indices.numel() - 1)  # [T, L]
        rows = indices[page] * S + kv_pos[None] % S
        attend = (kv_pos[None] < kv_lens.long()[request][:, None]) & (kv_pos[None] <= q_pos[:, None])
        return rows, attend

    def check_dtypes(self, q: torch.Tensor, kv: torch.Tensor) -> None:
        if q.dtype not in HALF or q.dtype != self.q_dtype or kv.dtype != self.kv_dtype:
            raise ValueError(f"q {q.dtype} / kv {kv.dtype} differ from the planned {self.q_dtype} / {self.kv_dtype} "
                             "(float16 or bfloat16)")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend_mask: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [T, H, D], keys [T, L, Hk, D], values [T, L, Hk, Dv], mask [T, L] -> [T, H, Dv] (float32 math)."""
    T, H, _ = q.shape
    Hk = keys.shape[2]
    keys = keys.float().repeat_interleave(H // Hk, dim=2)
    values = values.float().repeat_interleave(H // Hk, dim=2)
    scores = torch.einsum("thd,tlhd->thl", q.float(), keys) * scale
    probs = scores.masked_fill(~attend_mask[:, None], float("-inf")).softmax(-1)
    return torch.einsum("thl,tlhd->thd", probs, values).to(q.dtype)


class BatchPrefillWithPagedKVCacheWrapper(FakeWrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto"):
        if kv_layout != "NHD":
            raise ValueError("only NHD here")
        self.keep_workspace(float_workspace_buffer)
        self.init_buffers(use_cuda_graph, {"qo_indptr": qo_indptr_buf, "kv_indptr": paged_kv_indptr_buf,
                                           "kv_indices": paged_kv_indices_buf,
                                           "kv_last_page_len": paged_kv_last_page_len_buf})

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             sm_scale=None, q_data_type=torch.float16, kv_data_type=None, **kwargs) -> None:
        if custom_mask is not None or packed_custom_mask is not None:
            raise NotImplementedError("the fake has no custom mask")
        if head_dim_qk not in (64, 128, 256) or (head_dim_vo or head_dim_qk) != head_dim_qk:
            raise ValueError(f"head dim {head_dim_qk}/{head_dim_vo} is not compiled")
        if not causal:
            raise ValueError("moespec plans causal attention")
        self.fill(qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, kv_indices=paged_kv_indices,
                  kv_last_page_len=paged_kv_last_page_len)
        self.page_size, self.heads = page_size, (num_qo_heads, num_kv_heads, head_dim_qk)
        self.scale = sm_scale if sm_scale is not None else head_dim_qk ** -0.5
        self.q_dtype, self.kv_dtype = q_data_type, kv_data_type or q_data_type

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache  # [P, S, Hk, D] each
        self.check_dtypes(q, k_cache)
        if (q.shape[1], k_cache.shape[2], q.shape[2]) != self.heads:
            raise ValueError(f"heads {tuple(q.shape[1:])}, {k_cache.shape[2]} differ from the planned {self.heads}")
        self.count_run()
        b = self.buffers
        num_pages = b["kv_indptr"][1:] - b["kv_indptr"][:-1]
        kv_lens = (num_pages - 1) * self.page_size + b["kv_last_page_len"]  # [B]
        rows, mask = self.rows_and_mask(q.shape[0], kv_lens)
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[rows]  # [T, L, Hk, D]
        values = v_cache.reshape(-1, *v_cache.shape[2:])[rows]
        return attend(q, keys, values, mask, self.scale)


class BatchMLAPagedAttentionWrapper(FakeWrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend: str = "auto"):
        self.keep_workspace(float_workspace_buffer)
        self.init_buffers(use_cuda_graph, {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
                                           "kv_len_arr": kv_len_arr})

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False) -> None:
        if (head_dim_ckv, head_dim_kpe) != (512, 64):
            raise ValueError(f"MLA head dims {head_dim_ckv}/{head_dim_kpe}: FlashInfer's are 512/64")
        if not causal:
            raise ValueError("moespec plans causal attention")
        self.fill(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        self.page_size, self.heads, self.scale = page_size, num_heads, sm_scale
        self.q_dtype, self.kv_dtype = q_data_type, kv_data_type

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, C], q_pe [T, H, R], ckv [P, S, C], kpe [P, S, R] -> [T, H, C]."""
        self.check_dtypes(q_nope, ckv_cache)
        if q_nope.shape[1] != self.heads:
            raise ValueError(f"{q_nope.shape[1]} heads differ from the planned {self.heads}")
        self.count_run()
        rows, mask = self.rows_and_mask(q_nope.shape[0], self.buffers["kv_len_arr"])
        ckv = ckv_cache.reshape(-1, ckv_cache.shape[-1])[rows][:, :, None]  # [T, L, 1, C]
        kpe = kpe_cache.reshape(-1, kpe_cache.shape[-1])[rows][:, :, None]  # [T, L, 1, R]
        q = torch.cat([q_nope, q_pe], dim=-1)
        return attend(q, torch.cat([ckv, kpe], dim=-1), ckv, mask, self.scale)


class FakeEvent:
    """torch.cuda.Event for the staging model: a plan's staged copy has run once an event recorded
    after it has been waited on."""

    def record(self) -> None:
        self.after = set(FakeWrapper.staging)

    def synchronize(self) -> None:
        FakeWrapper.staging -= self.after


def install(monkeypatch) -> types.ModuleType:
    """Put the fake in sys.modules as `flashinfer` for one test."""
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    FakeWrapper.runs = {"graph": 0, "eager": 0}
    FakeWrapper.workspaces = {}
    FakeWrapper.async_staging, FakeWrapper.staging = False, set()
    return module
