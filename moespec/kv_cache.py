"""Paged KV cache: one page allocator per engine, and per-model cache tensors indexed by page id.

The target and its draft each own a `KVCache` built from their own layer specs, but both are
indexed by the *same* page ids handed out by the single `PageAllocator`, so they can never
disagree on allocation.

Shapes legend: P pages, S page size, Hk kv heads, Dk key dim, Dv value dim.
"""
from __future__ import annotations

import torch

from moespec.attention.base import LayerKV
from moespec.models.weights import KVSpec


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free list of page ids. A page has exactly one owner (a sequence) at a time."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"cache needs num_kv_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self.free_pages)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self.free_pages):
            raise OutOfPages(f"asked for {num_pages} KV pages, {len(self.free_pages)} free")
        return [self.free_pages.pop() for _ in range(num_pages)]

    def free(self, pages: list[int]) -> None:
        self.free_pages.extend(reversed(pages))

    def usage(self) -> float:
        return 1.0 - len(self.free_pages) / self.num_pages


def kv_bytes_per_token(specs: list[KVSpec], dtype: torch.dtype) -> int:
    """Bytes one token takes in a cache of these layers (what KVCache allocates per slot)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(s.num_kv_heads * (s.k_dim + (s.v_dim if s.separate_v else 0)) for s in specs) * size


class KVCache:
    """One model's cache tensors: per layer k [P, S, Hk, Dk] and v [P, S, Hk, Dv] (or none)."""

    def __init__(self, specs: list[KVSpec], num_pages: int, page_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        self.layers = [self.allocate_layer(spec, num_pages, page_size, dtype, device) for spec in specs]

    @staticmethod
    def allocate_layer(spec: KVSpec, num_pages: int, page_size: int, dtype: torch.dtype, device) -> LayerKV:
        k = torch.zeros(num_pages, page_size, spec.num_kv_heads, spec.k_dim, dtype=dtype, device=device)
        v = (torch.zeros(num_pages, page_size, spec.num_kv_heads, spec.v_dim, dtype=dtype, device=device)
             if spec.separate_v else None)
        return LayerKV(k, v)
