"""Runs one model over a packed batch: plan attention on the host, forward, project the rows
that get sampled. The model's KV cache lives here; a draft model gets its own runner that
shares the page ids (and, for MTP, the plan) of the target's.

Shapes legend: T tokens, N sampled rows, M hidden, V vocab.
"""
from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import torch
from torch import nn

from moespec.attention import ForwardContext, create_backend, plan_forward
from moespec.batch import Batch
from moespec.kv_cache import KVCache
from moespec.models.layers import pack_linears, reserve_rope_positions
from moespec.static_step import StaticSpec, StaticSteps, model_step


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """Size of the CPU's largest cache (Linux sysfs), or `default` where it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=default)


def set_single_row_padding(model: nn.Module, pad: bool) -> None:
    """One-row linears of `model` as GEMMs (layers.linear): faster when the weights come from memory."""
    for module in model.modules():
        if hasattr(module, "pad_single_row"):
            module.pad_single_row = pad


class ModelRunner:
    def __init__(self, model: nn.Module, num_pages: int, page_size: int, attention_backend: str = "torch",
                 device: str | torch.device = "cpu", weights_stream: bool | None = None,
                 static: StaticSpec | None = None, pack: bool = False) -> None:
        """`weights_stream`: whether the weights are read from memory at each forward rather than
        from cache; None decides by size (larger than the last-level cache). A draft model runs
        between target forwards that evict it, so its speculator passes True. `static`: uniform
        batches are padded to its batch sizes and run compiled or captured (moespec.static_step);
        the cache then has one more page, the padded requests' scratch page. `pack`: on the CPU,
        linears run over weights packed for oneDNN (layers.Linear.pack, model.pack_linears)."""
        self.model = model
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        scratch = 1 if static else 0
        self.cache = KVCache(model.kv_cache_spec(), num_pages + scratch, page_size, self.dtype, self.device)
        reserve_rope_positions(model, (num_pages + scratch) * page_size)  # every position the cache can hold
        self.backend = create_backend(attention_backend, self.device)
        self.static = (StaticSteps(functools.partial(model_step, model), self.cache.layers, attention_backend,
                                   self.device, static, num_pages, page_size) if static else None)
        self.sync = None  # distributed.Lockstep when experts are sharded over ranks
        if weights_stream is None:
            weights_stream = weight_bytes(model) > last_level_cache_bytes()
        set_single_row_padding(model, self.device.type == "cpu" and weights_stream)
        if pack:
            pack_linears(model)

    @property
    def static_spec(self) -> StaticSpec | None:
        """How its uniform batches run static (the speculators' static steps follow it)."""
        return self.static.spec if self.static is not None else None

    def plan(self, batch: Batch) -> ForwardContext:
        """Host work for a batch: attention indices and masks (FlashInfer's plan). A batch that
        runs static is planned padded only (`ctx.static`: its plan serves the MTP layer's
        re-run too), and then `ctx.backend` is None."""
        static = self.static.plan(batch) if self.static is not None else None
        if static is not None:
            ctx = ForwardContext(None, self.cache.layers)
            ctx.static = static
            return ctx
        split = self.sync.two_batch_split(batch) if self.sync is not None else None
        return plan_forward(self.backend, batch.attention_metadata(), self.cache.layers, split)

    def warm_up(self, shapes: list[tuple[str, int, int]]) -> float:
        """Compile or capture the static steps (mode, Q, sampled rows per request) of every
        bucket now; returns the seconds it took (0 without static steps)."""
        if self.static is None:
            return 0.0
        start = time.perf_counter()
        self.static.warm_up(shapes)
        return time.perf_counter() - start

    @torch.inference_mode()
    def forward(self, batch: Batch, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [T, M], logits [N, V] float32 at batch.sample_indices)."""
        with self.sync.target(batch) if self.sync is not None else contextlib.nullcontext():
            if ctx.static is not None:  # across ranks its MoE layers exchange the real rows only (compiled)
                return self.static.forward(ctx.static, batch.input_ids,
                                           fixed_exchange=self.sync is None or self.sync.low_latency)
            hidden = self.model(batch.input_ids, batch.positions, ctx)
        logits = self.model.compute_logits(hidden[batch.sample_indices]).float()
        return hidden, logits
