"""Paged KV cache: one page allocator per engine, and per-model cache tensors indexed by page id.

The target and its draft each own a `KVCache` built from their own layer specs, but both are
indexed by the *same* page ids handed out by the single `PageAllocator`, so they can never
disagree on allocation.

Shapes legend: P pages, S page size, Hk kv heads, Dk key dim, Dv value dim.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from moespec.attention.base import LayerKV
from moespec.models.weights import KVSpec


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Page ids for every cache of one engine, reference-counted, with a prefix cache.

    A page is free (no content), used (by `refs` requests), or cached: a full page whose content
    is identified by a key (see `PageKeys`) stays in the cache when its last user lets go, and is
    evicted only when its space is needed, least recently used first. A request's pages are let
    go leaf first, so a page is evicted before the pages in front of it. A cached page is `ready`
    once the speculator's caches (draft model, MTP layer) hold its positions too.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"cache needs num_kv_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refs = [0] * num_pages  # requests using each page
        self.key_of: dict[int, bytes] = {}  # cached page -> key of its content
        self.page_of: dict[bytes, int] = {}  # key -> cached page
        self.ready: set[int] = set()  # cached pages whose speculator KV is there too
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused: least recently used first

    @property
    def num_free(self) -> int:
        """Pages a request can get: free ones and cached ones nobody uses."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def num_cached(self) -> int:
        return len(self.key_of)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > self.num_free:
            raise OutOfPages(f"asked for {num_pages} KV pages, {self.num_free} free")
        pages = [self.free_pages.pop() if self.free_pages else self.evict() for _ in range(num_pages)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def evict(self) -> int:
        page, _ = self.evictable.popitem(last=False)
        del self.page_of[self.key_of.pop(page)]
        self.ready.discard(page)
        return page

    def free(self, pages: list[int]) -> None:
        """Let go of a request's pages (in sequence order): cached ones stay until evicted."""
        for page in reversed(pages):  # leaf first: evicted before the pages in front of it
            self.refs[page] -= 1
            if self.refs[page] < 0:
                raise RuntimeError(f"KV page {page} freed more times than it was used")
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_pages

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest run of leading keys."""
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_take(self, cached: list[int], num_new: int) -> bool:
        """Whether a request can use these cached pages and num_new more (taking an unused cached
        page leaves one page fewer to allocate)."""
        return self.can_allocate(num_new + sum(self.refs[page] == 0 for page in cached))

    def take(self, pages: list[int]) -> None:
        """A request uses these cached pages."""
        for page in pages:
            if self.refs[page] == 0:
                del self.evictable[page]
            self.refs[page] += 1

    def publish(self, page: int, key: bytes) -> bool:
        """A used, full page's content is `key` from now on; False when another page holds it."""
        if key in self.page_of or page in self.key_of:
            return False
        self.key_of[page], self.page_of[key] = key, page
        return True

    def mark_ready(self, page: int) -> None:
        if page in self.key_of:
            self.ready.add(page)


class PageKeys:
    """Keys of full pages: a hash chained over the tokens of the page and of every page before it.

    The chain starts from the model's identity and the request's cache salt, so requests share a
    page only when its KV would be the same. `lookahead` tokens after a page belong to its key when
    a cache reads ahead (the MTP layer's KV at position p depends on token p + 1).
    """

    def __init__(self, page_size: int, lookahead: int, identity: str) -> None:
        self.page_size, self.lookahead = page_size, lookahead
        self.root = hashlib.blake2b(identity.encode(), digest_size=16).digest()

    def update(self, seq) -> list[bytes]:
        """Extend `seq.page_keys` (a Sequence's) to every page its tokens now cover, lookahead included."""
        S, keys = self.page_size, seq.page_keys
        parent = keys[-1] if keys else self.salted(seq.params.cache_salt)
        for i in range(len(keys), (seq.num_tokens - self.lookahead) // S):
            window = seq.token_at(i * S, (i + 1) * S + self.lookahead)
            parent = hashlib.blake2b(parent + array("q", window).tobytes(), digest_size=16).digest()
            keys.append(parent)
        return keys

    def salted(self, salt: str | None) -> bytes:
        if not salt:
            return self.root
        return hashlib.blake2b(self.root + salt.encode(), digest_size=16).digest()


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
