"""Attention backend interface, shaped like FlashInfer: `plan(metadata)` once per batch on the
host, `run(...)` once per layer.

Shapes legend: T tokens (flattened batch), B requests, H query heads, Hk kv heads, Dk key dim,
Dv value dim, P pages, S page size.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where each request's queries sit in the flat batch and which KV pages it reads.

    Tokens of one request are contiguous in the flat batch; request b owns queries
    qo_indptr[b]:qo_indptr[b+1] and pages kv_indices[kv_indptr[b]:kv_indptr[b+1]]; its KV length
    (after this step's tokens are written) is (num_pages - 1) * S + kv_last_page_len[b].
    A query at position p attends KV positions <= p unless `custom_mask` says otherwise.
    """

    qo_indptr: torch.Tensor  # [B+1] int64
    kv_indptr: torch.Tensor  # [B+1] int64
    kv_indices: torch.Tensor  # [sum of pages] int64 page ids
    kv_last_page_len: torch.Tensor  # [B] int64, 1..S
    positions: torch.Tensor  # [T] int64
    page_size: int
    custom_mask: torch.Tensor | None = None  # flat bool: per request q_len x kv_len, True = attend
    host: "AttentionMetadata | None" = None  # the same metadata on the host (what FlashInfer plans from)

    @property
    def num_requests(self) -> int:
        return self.qo_indptr.numel() - 1

    def kv_lens(self) -> torch.Tensor:
        num_pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (num_pages - 1) * self.page_size + self.kv_last_page_len  # [B]

    def q_lens(self) -> torch.Tensor:
        return self.qo_indptr[1:] - self.qo_indptr[:-1]  # [B]

    def select(self, requests: torch.Tensor) -> tuple["AttentionMetadata", torch.Tensor]:
        """The metadata of a subset of requests (bool [B]) and the rows of their tokens in this
        batch [T'] (custom masks are not carried over)."""
        num_pages = self.kv_indptr[1:] - self.kv_indptr[:-1]  # [B]
        rows = torch.nonzero(requests.repeat_interleave(self.q_lens())).flatten()  # [T']
        zero = self.qo_indptr[:1]
        sub = AttentionMetadata(
            qo_indptr=torch.cat([zero, self.q_lens()[requests].cumsum(0)]),
            kv_indptr=torch.cat([zero, num_pages[requests].cumsum(0)]),
            kv_indices=self.kv_indices[requests.repeat_interleave(num_pages)],
            kv_last_page_len=self.kv_last_page_len[requests], positions=self.positions[rows],
            page_size=self.page_size)
        return sub, rows

    def requests(self, lo: int, hi: int) -> "AttentionMetadata":
        """Requests [lo, hi) as a batch of their own (their tokens are rows qo_indptr[lo]:qo_indptr[hi]
        of this one), custom mask included; offsets are read from the host copy where there is one."""
        host = self.host or self
        q0, q1 = int(host.qo_indptr[lo]), int(host.qo_indptr[hi])
        k0, k1 = int(host.kv_indptr[lo]), int(host.kv_indptr[hi])
        mask = None
        if self.custom_mask is not None:  # per request q_len x kv_len, one after another
            ends = [0] + (host.q_lens() * host.kv_lens()).cumsum(0).tolist()  # [B+1]
            mask = self.custom_mask[ends[lo]:ends[hi]]
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[lo:hi + 1] - self.qo_indptr[lo],
            kv_indptr=self.kv_indptr[lo:hi + 1] - self.kv_indptr[lo],
            kv_indices=self.kv_indices[k0:k1], kv_last_page_len=self.kv_last_page_len[lo:hi],
            positions=self.positions[q0:q1], page_size=self.page_size, custom_mask=mask,
            host=host.requests(lo, hi) if self.host is not None else None)


@dataclass
class LayerKV:
    """One layer's paged cache. `v` is None when values are the first Dv dims of keys (MLA latent)."""

    k: torch.Tensor  # [P, S, Hk, Dk]
    v: torch.Tensor | None  # [P, S, Hk, Dv]


class AttentionBackend(Protocol):
    def plan(self, metadata: AttentionMetadata) -> None: ...

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cache: LayerKV | None,
            scale: float, v_dim: int) -> torch.Tensor:
        """q [T,H,Dk], new k [T,Hk,Dk], new v [T,Hk,Dv] or None -> out [T,H,Dv]; writes k/v into cache."""
        ...


@dataclass
class Half:
    """One microbatch of a two-batch-overlap forward: its requests, their tokens, their own plan."""

    requests: slice  # its requests in the batch
    rows: slice  # their tokens in the batch
    backend: AttentionBackend  # planned for its requests alone


def plan_forward(backend: AttentionBackend, meta: AttentionMetadata, caches: list[LayerKV] | None,
                 split: int | None = None) -> "ForwardContext":
    """Host work for a batch (FlashInfer's plan) -> a context holding a snapshot of the plan (under
    overlap scheduling the next plan is made while this one runs); `split`: the request where the
    batch splits in two halves, each also planned alone (two-batch overlap)."""
    backend.plan(meta)
    halves = plan_halves(backend, meta, split) if split is not None else None
    return ForwardContext(copy.copy(backend), caches, halves)


def plan_halves(backend: AttentionBackend, meta: AttentionMetadata, split: int) -> list[Half]:
    """Requests [0, split) and [split, B) planned apart (copies of `backend`), for a forward whose
    two halves take turns (models/two_batch.py)."""
    host = meta.host or meta
    bounds = (0, split, meta.num_requests)
    halves = []
    for lo, hi in zip(bounds, bounds[1:]):
        half = copy.copy(backend)
        half.plan(meta.requests(lo, hi))
        halves.append(Half(slice(lo, hi), slice(int(host.qo_indptr[lo]), int(host.qo_indptr[hi])), half))
    return halves


class ForwardContext:
    """What a model needs for one forward: a planned backend and the model's own KV cache.

    The target and its draft share one plan (same page ids) and differ only in `caches`.
    `halves`: the batch split in two microbatches, each planned alone; a model that supports it
    runs them in turns (two-batch overlap), otherwise it uses `backend`.
    """

    def __init__(self, backend: AttentionBackend, caches: list[LayerKV] | None,
                 halves: list[Half] | None = None) -> None:
        self.backend = backend
        self.caches = caches
        self.halves = halves
        self.static = None  # static_step.StaticBatch: the padded batch a compiled step runs instead

    def half(self, index: int) -> "ForwardContext":
        return ForwardContext(self.halves[index].backend, self.caches)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               scale: float, v_dim: int) -> torch.Tensor:
        cache = self.caches[layer_id] if self.caches is not None else None
        return self.backend.run(q, k, v, cache, scale, v_dim)
