"""A stand-in for DeepEP's V1 API (`deep_ep.Buffer`, `deep_ep.Config`, `deep_ep.topk_idx_t`) on the
CPU, over a torch.distributed group (gloo), holding the caller to the contracts DeepEP asserts or
silently relies on. Read from DeepEP's sources (github deepseek-ai/DeepEP: v1.2.1's
deep_ep/buffer.py and csrc/config.hpp, HEAD's deep_ep/buffers/legacy.py and csrc/legacy/buffer.hpp).

What it emulates:
- low-latency mode (`low_latency_dispatch`, `low_latency_combine`, `clean_low_latency_buffer`):
  moespec's `EmulatedBuffer` (parallel/exchange.py), which enforces the double buffer (a call's
  receive must run before the next call is issued), (num_ranks * C) % 4 == 0, tokens <= C and
  FP8 only for hidden % 512 == 0;
- normal mode, intranode semantics (`get_dispatch_layout`, `dispatch`, `combine`): counts, then an
  uneven all-to-all of each (token, destination rank) row; received top-k ids are LOCAL expert ids
  (-1 where the expert lives on another rank) and their weights 0 there (intranode.cu); rows
  arrive grouped by source rank, in token order; `combine` sums, in float32, what each rank that
  received a token sends back (unweighted), then casts to the rows' dtype (bf16).

Every collective of the fake runs on one thread of its own (FIFO, like a CUDA stream) over a
process group of its own, made when the Buffer is built (a collective of the group's ranks, as
DeepEP's constructor is): DeepEP's traffic never shares the caller's torch.distributed group, and
so the fake's may not interleave with the caller's collectives on it.

What it holds the caller to, beyond the emulation's own checks (which raise ParallelError). Its
own raise `DeepEPAssertion`, a RuntimeError as DeepEP's C++ EP_HOST_ASSERT is, checked before any
collective of the call so every rank raises alike (the config tables: AssertionError, as DeepEP's
Python asserts):
- construction: a group; byte sizes multiples of 128; RDMA bytes only in low-latency mode or
  over 8 ranks; num_qps_per_rank > 0; one live low-latency Buffer per process (NVSHMEM);
  `get_dispatch_config` / `get_combine_config` only for EP sizes in DeepEP v1.2.1's table;
- `destroy()`: only with explicitly_destroy, once, collectively (a barrier over the group); any call
  after it raises; `Buffer.instances` lists every Buffer built since `install`, for tests to check;
- low latency: the buffer built with low_latency_mode; x bf16 [T, M] contiguous with M one of the
  hidden sizes DeepEP's low-latency kernels are compiled for; top-k ids int64 (`topk_idx_t`)
  contiguous, within [-1, E) (stricter: DeepEP drops larger ids silently), at most 11 per token;
  `num_max_dispatch_tokens_per_rank`, hidden and num_experts equal to what the buffer was sized
  for (the `get_low_latency_rdma_size_hint` call
  whose size the Buffer was built with), and DeepEP's LowLatencyLayout fits num_rdma_bytes;
  NVSHMEM's QP depth (NVSHMEM_QP_DEPTH when the Buffer was built) >= (C + 1) * 2; not
  async_finish with return_recv_hook; a combine takes the dispatch's handle from this buffer and
  the same top-k ids, x [E/G, G*C, M] bf16 contiguous and float32 weights; after any normal-mode
  dispatch or combine, a low-latency call (or its combine) without `clean_low_latency_buffer` in
  between is an error (DeepEP: "after running the normal dispatch/combine, you must run this
  function before executing any low-latency kernel"); cleaning takes the sized-for shape, no
  receive may be pending, and it is a collective (a barrier over the group, as DeepEP's clean
  kernel is), so ranks that clean in different places fail instead of pairing up wrongly;
- normal mode: no low-latency receive pending (its hook not run); DeepEP's dtype, shape and
  contiguity asserts (layout tensors int32 / bool, topk_weights float32, hidden bytes % 16, combine
  bf16 only); the layout tensors must be topk_idx's (else DeepEP sends garbage or hangs); the
  NVLink bytes its kernels need fit num_nvl_bytes; a combine takes a dispatch handle of this buffer
  and one row per received token.

Every call returns DeepEP's tuple; its events are `EventOverlap`s without an event (DeepEP's
Python returns EventOverlap objects, not None). Not emulated (NotImplementedError): cached-handle
dispatch, FP8 normal-mode input, UE8M0 scales, LogFMT / zero-copy / out= combine, the statistics
tensors. The checks of num_nvl_bytes are the intranode kernels' own asserts (what a call needs),
not the hints' (which assume 128 top-k slots); over 8 ranks, an approximation by the RDMA hint.

Install with `install(monkeypatch)` in a test, or `install()` in a spawned rank (no monkeypatch).
"""
from __future__ import annotations

import datetime
import importlib.machinery
import os
import sys
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

topk_idx_t = torch.int64

NUM_MAX_NVL_PEERS = 8  # LEGACY_NUM_MAX_NVL_PEERS
NUM_MAX_RDMA_PEERS = 20
NUM_MAX_LOCAL_EXPERTS = 1024
ALIGNMENT = 128  # LEGACY_NUM_BUFFER_ALIGNMENT_BYTES
SOURCE_META_BYTES = 8  # internode::SourceMeta: two ints
NUM_WORKSPACE_BYTES = 32 * 1024 * 1024
INT_MAX = 2 ** 31 - 1
LOW_LATENCY_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # launch.cuh SWITCH_HIDDEN (HEAD)
LOW_LATENCY_MAX_TOPK = 11  # internode_ll.cu kNumMaxTopK
TIMEOUT_S = 30.0  # the fake's own group: a collective a peer never joins fails after this

# v1.2.1's deep_ep/buffer.py tables: (nvl send, nvl recv, rdma send, rdma recv) tokens per channel
DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                    24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
                    144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                   24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
                   144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


class DeepEPAssertion(RuntimeError):
    """What DeepEP's EP_HOST_ASSERT (a RuntimeError from C++) or its Python asserts would raise."""


def expect(condition: Any, what: str) -> None:
    if not condition:
        raise DeepEPAssertion(f"fake deep_ep: {what}")


def align_up(value: int, step: int) -> int:
    return -(-value // step) * step


class EventOverlap:
    """deep_ep.EventOverlap without an event (nothing here is asynchronous to the caller)."""

    def __init__(self, event=None, extra_tensors=None) -> None:
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


class Config:
    """csrc/legacy/config.hpp's Config: its constructor's asserts and its two size hints."""

    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int, num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int, num_max_rdma_chunked_recv_tokens: int) -> None:
        expect(num_sms >= 0, "Config: num_sms >= 0")
        expect(0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "Config: NVL chunk sizes")
        expect(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0, "Config: RDMA chunks")
        num_max_rdma_chunked_recv_tokens = align_up(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        expect(num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens // 2, "Config: RDMA lazy head")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        max_topk = max_scales = 128
        expect(num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0, f"{num_ranks} ranks")
        expect(num_ranks <= NUM_MAX_NVL_PEERS or self.num_sms % 2 == 0, "num_sms must be even")
        rdma_ranks, nvl_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1), min(num_ranks, NUM_MAX_NVL_PEERS)
        channels, slots = self.num_sms // 2, self.num_max_nvl_chunked_recv_tokens
        n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        n += channels * nvl_ranks * slots * (hidden_bytes + SOURCE_META_BYTES + max_topk * 8 + max_topk * 4
                                             + max_scales * 4)
        return align_up(n, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        max_topk = max_scales = 128
        expect(num_ranks % NUM_MAX_NVL_PEERS == 0 and self.num_sms % 2 == 0, f"{num_ranks} ranks")
        rdma_ranks, channels = num_ranks // NUM_MAX_NVL_PEERS, self.num_sms // 2
        slots = self.num_max_rdma_chunked_recv_tokens
        n = channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        n += channels * rdma_ranks * slots * 2 * (hidden_bytes + SOURCE_META_BYTES + max_topk * 8 + max_topk * 4
                                                  + max_scales * 4 + 16)
        return align_up(n, 128)


def low_latency_layout_bytes(C: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """LowLatencyLayout(...).total_bytes: two send, two receive and two signaling buffers."""
    scales = hidden // 128
    expect(scales * 4 <= hidden, f"hidden {hidden}")
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(C * dispatch_msg, num_experts * C * combine_msg)
    recv = max(num_experts * C * dispatch_msg, num_experts * C * combine_msg)
    expect(send % 16 == 0 and recv % 16 == 0, "LowLatencyLayout: buffers in int4")
    return 2 * send + 2 * recv + 2 * align_up(num_experts * 4, 128)


@dataclass
class NormalHandle:
    """What `combine` needs of a normal-mode dispatch (DeepEP's is a 6-tuple of device tensors)."""

    buffer: "Buffer"
    num_tokens: int  # T the dispatching rank had
    hidden: int
    token: torch.Tensor  # [N] source row of each row sent, grouped by destination rank
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank (received rows are grouped by source)


class Buffer:
    """deep_ep.Buffer (the V1 "legacy" API) on a gloo group. See the module doc."""

    num_sms: int = 20
    instances: list["Buffer"] = []  # every Buffer built since `install`
    hints: list[tuple[int, tuple[int, int, int, int]]] = []  # (bytes, (C, hidden, ranks, experts)) asked for

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None) -> None:
        from moespec.parallel.comm import Collectives, CommStream
        from moespec.parallel.groups import ParallelContext
        expect(group is not None, "Buffer needs a torch.distributed group (mpi4py comm is not emulated)")
        expect(not enable_shrink, "enable_shrink is not emulated")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.num_qps_per_rank = num_qps_per_rank
        G = self.group_size
        expect(num_nvl_bytes % ALIGNMENT == 0 and (num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0),
               f"num_nvl_bytes {num_nvl_bytes} must be a multiple of {ALIGNMENT}")
        expect(num_rdma_bytes % ALIGNMENT == 0 and (low_latency_mode or num_rdma_bytes <= INT_MAX),
               f"num_rdma_bytes {num_rdma_bytes} must be a multiple of {ALIGNMENT}")
        expect(G <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or low_latency_mode, f"{G} ranks")
        expect(G < NUM_MAX_NVL_PEERS or G % NUM_MAX_NVL_PEERS == 0, f"{G} ranks: fewer than 8 or a multiple of 8")
        if num_rdma_bytes > 0:
            expect(G > NUM_MAX_NVL_PEERS or low_latency_mode, "RDMA bytes need low_latency_mode or over 8 ranks")
        self.nvshmem_qp_depth = None
        if G > NUM_MAX_NVL_PEERS or low_latency_mode:
            expect(num_qps_per_rank > 0, "num_qps_per_rank > 0")
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
            os.environ["NVSHMEM_QP_DEPTH"] = str(self.nvshmem_qp_depth)
        if low_latency_mode:
            live = [b for b in Buffer.instances if b.low_latency_mode and not b.destroyed]
            expect(not live, "a second live low-latency Buffer in one process (DeepEP's cpu_rdma_team assertion)")
        self.sized_for = self.find_sizing()
        self.destroyed = False
        self.dirty = False  # normal mode ran since the low-latency area was last clean
        self.emulated = None  # moespec's EmulatedBuffer, built at the first low-latency call
        self.calls: Counter = Counter()
        # the fake's own group and thread (a collective of the group's ranks, as DeepEP's constructor is)
        ranks = dist.get_process_group_ranks(group)
        self.own_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True,
                                        timeout=datetime.timedelta(seconds=TIMEOUT_S))
        ctx = ParallelContext(dist.get_rank(), dist.get_world_size(), self.rank, self.own_group, self.rank, G,
                              self.rank == 0, torch.device("cpu"), TIMEOUT_S)
        self.collectives = Collectives(ctx)
        self.stream = CommStream(self.collectives)
        self.runtime = types.SimpleNamespace(ctx=ctx, collectives=self.collectives, stream=self.stream)
        Buffer.instances.append(self)

    def find_sizing(self) -> tuple[int, int, int] | None:
        """(C, hidden, experts) of the latest low-latency size hint asked for this group size whose
        bytes this buffer was given (alone, or as the larger of it and the normal-mode hints)."""
        if not self.low_latency_mode:
            return None
        for size, (C, hidden, ranks, experts) in reversed(Buffer.hints):
            if ranks == self.group_size and size <= self.num_rdma_bytes:
                return C, hidden, experts
        return None

    # -- the buffer's life

    def alive(self, call: str) -> None:
        expect(not self.destroyed, f"{call} after destroy()")

    def destroy(self) -> None:
        expect(self.explicitly_destroy, "`explicitly_destroy` flag must be set")
        self.alive("destroy")
        self.destroyed = True
        try:  # DeepEP's destroy synchronizes the group's ranks (intranode barrier, nvshmem barrier)
            self.stream.run("destroy", dist.barrier, self.own_group)
        finally:
            self.stream.close()

    def receive_pending(self) -> bool:
        last = self.emulated.last if self.emulated is not None else None
        return last is not None and not last.received and last.zeroed_by is None

    # -- DeepEP's static API

    @staticmethod
    def is_sm90_compiled() -> bool:
        return False

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        size = low_latency_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        size = (size + ALIGNMENT) // ALIGNMENT * ALIGNMENT  # DeepEP's rounding: (n + 128) / 128 * 128
        Buffer.hints.append((size, (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)))
        return size

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in DISPATCH_CONFIGS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *DISPATCH_CONFIGS[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in COMBINE_CONFIGS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *COMBINE_CONFIGS[num_ranks])

    # -- normal mode

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """topk_idx [T, A] -> tokens per rank [G], tokens per expert [E] (int32), token in rank [T, G]."""
        G, T = self.group_size, topk_idx.shape[0]
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        rank = torch.where(valid, topk_idx // (num_experts // G), 0)
        in_rank = torch.zeros(T, G, dtype=torch.int32).scatter_add_(1, rank, valid.int()) > 0
        return in_rank.sum(0).to(torch.int32), per_expert, in_rank

    def check_topk_idx(self, topk_idx: torch.Tensor, num_experts: int, call: str) -> None:
        expect(topk_idx.dim() == 2 and topk_idx.is_contiguous(), f"{call}: topk_idx must be 2-D and contiguous")
        expect(topk_idx.dtype == topk_idx_t, f"{call}: topk_idx is {topk_idx.dtype}, DeepEP takes {topk_idx_t}")
        expect(num_experts > 0 and num_experts % self.group_size == 0,
               f"{call}: {num_experts} experts over {self.group_size} ranks")
        if topk_idx.numel():
            expect(int(topk_idx.min()) >= -1 and int(topk_idx.max()) < num_experts,
                   f"{call}: expert ids outside [-1, {num_experts})")

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """-> (num_tokens_per_rank [G] int32, num_tokens_per_rdma_rank (None within 8 ranks),
        num_tokens_per_expert [E] int32, is_token_in_rank [T, G] bool, event)."""
        self.alive("get_dispatch_layout")
        if allocate_on_comm_stream:
            expect(previous_event is not None and async_finish, "allocate_on_comm_stream needs an event and async")
        self.check_topk_idx(topk_idx, num_experts, "get_dispatch_layout")
        self.calls["get_dispatch_layout"] += 1
        per_rank, per_expert, in_rank = self.layout(topk_idx, num_experts)
        per_rdma_rank = None
        if self.group_size > NUM_MAX_NVL_PEERS:
            per_rdma_rank = in_rank.view(in_rank.shape[0], -1, NUM_MAX_NVL_PEERS).any(2)
            per_rdma_rank = per_rdma_rank.sum(0).to(torch.int32)
        return per_rank, per_rdma_rank, per_expert, in_rank, EventOverlap()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """-> (recv_x [R, M], recv_topk_idx [R, A] local ids (-1: elsewhere), recv_topk_weights [R, A]
        float32 (0 elsewhere), num_recv_tokens_per_expert_list [L], handle, event)."""
        self.alive("dispatch")
        expect(not self.receive_pending(), "normal-mode dispatch while a low-latency receive is pending (its hook "
                                           "has not run): receive it first")
        G = self.group_size
        config = self.get_dispatch_config(G) if config is None else config
        expect(config.num_sms % 2 == 0, "config.num_sms must be even")
        if isinstance(x, tuple):
            raise NotImplementedError("fake deep_ep: FP8 normal-mode dispatch is not emulated")
        if handle is not None:
            raise NotImplementedError("fake deep_ep: cached-handle dispatch is not emulated")
        if G > NUM_MAX_NVL_PEERS:
            expect(num_worst_tokens == 0, "Internode dispatch does not support `num_worst_tokens > 0`")
            expect(num_tokens_per_rdma_rank is not None, "internode dispatch needs num_tokens_per_rdma_rank")
        expect(num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None,
               "dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert")
        expect(is_token_in_rank.dtype == torch.bool, "is_token_in_rank must be bool")
        expect(num_tokens_per_expert.dtype == torch.int32 and num_tokens_per_rank.dtype == torch.int32,
               "num_tokens_per_rank and num_tokens_per_expert must be int32")
        expect(x.dim() == 2 and x.is_contiguous(), "x must be 2-D and contiguous")
        T, M = x.shape
        expect(M * x.element_size() % 16 == 0, "hidden bytes must be a multiple of 16")
        expect(is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous()
               and tuple(is_token_in_rank.shape) == (T, G), "is_token_in_rank must be [num_tokens, num_ranks]")
        expect(num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.is_contiguous()
               and num_tokens_per_expert.shape[0] % G == 0
               and num_tokens_per_expert.shape[0] // G <= NUM_MAX_LOCAL_EXPERTS, "num_tokens_per_expert [E]")
        expect(num_tokens_per_rank.dim() == 1 and num_tokens_per_rank.is_contiguous()
               and num_tokens_per_rank.shape[0] == G, "num_tokens_per_rank [num_ranks]")
        E = num_tokens_per_expert.shape[0]
        expect((topk_idx is None) == (topk_weights is None), "topk_idx and topk_weights go together")
        A = 0
        if topk_idx is not None:
            self.check_topk_idx(topk_idx, E, "dispatch")
            expect(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights must be 2-D, contiguous")
            expect(topk_idx.shape[0] == T and topk_weights.shape[0] == T, "one top-k row per token")
            expect(topk_weights.shape[1] == topk_idx.shape[1], "topk_weights and topk_idx differ in k")
            expect(topk_weights.dtype == torch.float32, f"topk_weights is {topk_weights.dtype}, DeepEP takes float32")
            A = topk_idx.shape[1]
            per_rank, per_expert, in_rank = self.layout(topk_idx, E)
            expect(torch.equal(per_rank, num_tokens_per_rank) and torch.equal(per_expert, num_tokens_per_expert)
                   and torch.equal(in_rank, is_token_in_rank),
                   "the layout tensors are not topk_idx's (get_dispatch_layout's): DeepEP would send garbage or hang")
        else:
            expect(torch.equal(is_token_in_rank.sum(0).to(torch.int32), num_tokens_per_rank),
                   "num_tokens_per_rank is not is_token_in_rank's")
        L = E // G
        expect(A <= 32, f"top-k {A} > 32 (intranode.cu)")
        if G <= NUM_MAX_NVL_PEERS:
            expect(G in (2, 4, 8), f"{G} ranks: the intranode kernels are built for 2, 4 or 8 (SWITCH_RANKS)")
            channels, slots = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
            expect(G * (G + L) * 4 <= self.num_nvl_bytes, "num_nvl_bytes too small for the dispatch's notify")
            need = G * G * 4 + 4 * channels * G * 4 + channels * G * slots * (M * x.element_size() + 4 + A * 8 + A * 4)
            expect(need <= self.num_nvl_bytes, f"num_nvl_bytes {self.num_nvl_bytes} < the {need} bytes the dispatch "
                                               "needs (Config.get_nvl_buffer_size_hint)")
        else:
            need = config.get_rdma_buffer_size_hint(M * x.element_size(), G)  # an upper bound of what it needs
            expect(need <= self.num_rdma_bytes, "num_rdma_bytes below the internode dispatch's hint")
        self.calls["dispatch"] += 1
        self.dirty = True
        recv_x, recv_idx, recv_w, handle = self.stream.run(
            "fake DeepEP dispatch", self.dispatch_now, x, is_token_in_rank, topk_idx, topk_weights, L)
        per_expert_list = []
        if recv_idx is not None:
            per_expert_list = [align_up(int((recv_idx == e).any(1).sum()), expert_alignment) for e in range(L)]
        if num_worst_tokens > 0:  # CUDA-graph mode: fixed row counts, no list
            expect(topk_idx is not None, "num_worst_tokens needs topk_idx")
            expect(recv_x.shape[0] <= num_worst_tokens, "more tokens received than num_worst_tokens")
            pad = num_worst_tokens - recv_x.shape[0]
            recv_x = torch.cat([recv_x, recv_x.new_zeros(pad, M)])
            recv_idx = torch.cat([recv_idx, recv_idx.new_full((pad, A), -1)])
            recv_w = torch.cat([recv_w, recv_w.new_zeros(pad, A)])
            per_expert_list = []
        return recv_x, recv_idx, recv_w, per_expert_list, handle, EventOverlap()

    def dispatch_now(self, x: torch.Tensor, in_rank: torch.Tensor, topk_idx, topk_weights, L: int):
        """(on the fake's thread) each token once to every rank it has an expert on."""
        T, M = x.shape
        rank, token = in_rank.t().nonzero(as_tuple=True)  # [N] each, grouped by destination rank
        send_counts = torch.bincount(rank, minlength=self.group_size)
        parts = [x[token].contiguous().view(torch.uint8)]
        if topk_idx is not None:
            ids = topk_idx[token]  # [N, A]
            dest = rank[:, None]
            local = torch.where((ids >= 0) & (ids // L == dest), ids - dest * L, -1)  # intranode.cu's transform
            weights = torch.where(local >= 0, topk_weights[token], 0.0)
            parts += [local.contiguous().view(torch.uint8), weights.contiguous().view(torch.uint8)]
        payload = torch.cat(parts, dim=1)
        recv_counts = self.collectives.exchange_counts(send_counts)
        got = self.collectives.all_to_all(payload, send_counts.tolist(), recv_counts.tolist())
        x_end = M * x.element_size()
        recv_x = got[:, :x_end].contiguous().view(x.dtype)
        recv_idx = recv_w = None
        if topk_idx is not None:
            A = topk_idx.shape[1]
            recv_idx = got[:, x_end:x_end + 8 * A].contiguous().view(torch.int64)
            recv_w = got[:, x_end + 8 * A:].contiguous().view(torch.float32)
        handle = NormalHandle(self, T, M, token, send_counts.tolist(), recv_counts.tolist())
        return recv_x, recv_idx, recv_w, handle

    def combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights=None, bias=None,
                config: Config | None = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """x [R, M] (a row per received token) -> (each token's rows summed over the ranks that
        received it [T, M], unweighted; the summed top-k weights or None; event)."""
        self.alive("combine")
        expect(not self.receive_pending(), "normal-mode combine while a low-latency receive is pending")
        G = self.group_size
        config = self.get_combine_config(G) if config is None else config
        expect(config.num_sms % 2 == 0, "config.num_sms must be even")
        expect(isinstance(handle, NormalHandle) and handle.buffer is self,
               "combine needs the handle of a normal-mode dispatch of this buffer")
        expect(x.dim() == 2 and x.is_contiguous(), "x must be 2-D and contiguous")
        expect(x.dtype == torch.bfloat16, f"combine: x is {x.dtype}; DeepEP's combine kernels take bfloat16 only")
        R, M = x.shape
        expect(M * x.element_size() % 16 == 0, "hidden bytes must be a multiple of 16")
        expect(R == sum(handle.recv_counts), f"combine: {R} rows for the {sum(handle.recv_counts)} tokens received")
        A = 0
        if topk_weights is not None:
            expect(topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.shape[0] == R
                   and topk_weights.dtype == torch.float32, "combine: topk_weights [R, k] float32, contiguous")
            A = topk_weights.shape[1]
        biases = [] if bias is None else list(bias) if isinstance(bias, tuple) else [bias]
        for b in biases:
            expect(b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype
                   and tuple(b.shape) == (handle.num_tokens, M), "combine: bias [T, M] of x's dtype")
        if G <= NUM_MAX_NVL_PEERS:
            channels, slots = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
            need = channels * G * 4 * 2 + channels * G * slots * (M * x.element_size() + 4 + A * 4)
            expect(need <= self.num_nvl_bytes, f"num_nvl_bytes {self.num_nvl_bytes} < the {need} bytes the combine "
                                               "needs")
        self.calls["combine"] += 1
        self.dirty = True
        combined, weights = self.stream.run("fake DeepEP combine", self.combine_now, x, topk_weights, handle)
        for b in biases:
            combined += b.float()
        return combined.to(x.dtype), weights, EventOverlap()

    def combine_now(self, x: torch.Tensor, topk_weights, handle: NormalHandle):
        """(on the fake's thread) rows back to their senders, summed per token in float32."""
        payload = x.view(torch.uint8)
        if topk_weights is not None:
            payload = torch.cat([payload, topk_weights.view(torch.uint8)], dim=1)
        back = self.collectives.all_to_all(payload, handle.recv_counts, handle.send_counts)  # [N, bytes]
        x_end = handle.hidden * x.element_size()
        rows = back[:, :x_end].contiguous().view(x.dtype).float()
        combined = torch.zeros(handle.num_tokens, handle.hidden).index_add_(0, handle.token, rows)
        weights = None
        if topk_weights is not None:
            w = back[:, x_end:].contiguous().view(torch.float32)
            weights = torch.zeros(handle.num_tokens, w.shape[1]).index_add_(0, handle.token, w)
        return combined, weights

    # -- low-latency mode

    def check_low_latency(self, call: str, C: int, hidden: int, num_experts: int) -> None:
        self.alive(call)
        expect(self.low_latency_mode, f"{call} on a Buffer built without low_latency_mode")
        expect(not self.dirty, f"{call} after normal-mode dispatch/combine without clean_low_latency_buffer: the "
                               "low-latency receive counters are dirty (DeepEP would hang or read garbage)")
        expect(self.nvshmem_qp_depth >= (C + 1) * 2,
               f"NVSHMEM_QP_DEPTH {self.nvshmem_qp_depth} < (num_max_dispatch_tokens_per_rank + 1) * 2 = {(C + 1) * 2}")
        self.check_shape(call, C, hidden, num_experts)

    def check_shape(self, call: str, C: int, hidden: int, num_experts: int) -> None:
        size = low_latency_layout_bytes(C, hidden, self.group_size, num_experts)
        expect(size <= self.num_rdma_bytes, f"{call}: the low-latency layout for (C, hidden, experts) "
                                            f"{(C, hidden, num_experts)} needs {size} bytes; num_rdma_bytes is "
                                            f"{self.num_rdma_bytes}")
        if self.sized_for is not None:
            expect((C, hidden, num_experts) == self.sized_for,
                   f"{call}: (num_max_dispatch_tokens_per_rank, hidden, num_experts) {(C, hidden, num_experts)} "
                   f"differ from the {self.sized_for} the buffer was sized for")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.alive("clean_low_latency_buffer")
        expect(self.low_latency_mode, "clean_low_latency_buffer needs low_latency_mode")
        expect(not self.receive_pending(), "clean_low_latency_buffer while a low-latency receive is pending")
        self.check_shape("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.calls["clean_low_latency_buffer"] += 1
        # a collective: DeepEP's clean kernel is an NVSHMEM barrier, the zeroing, and a barrier (every
        # rank cleans, in the same place among its low-latency calls, or they wait for each other)
        self.stream.run("fake DeepEP clean_low_latency_buffer", dist.barrier, self.own_group)
        self.dirty = False

    def emulation(self, num_experts: int):
        from moespec.parallel.exchange import EmulatedBuffer
        if self.emulated is None:
            self.emulated = EmulatedBuffer(self.runtime, num_experts)
        expect(self.emulated.num_experts == num_experts, "one buffer serves one expert count")
        return self.emulated

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False, return_recv_hook: bool = False):
        """-> (recv_x [L, G*C, M] (or FP8 rows and scales), recv_count [L] int32, handle, event, hook)."""
        self.alive("low_latency_dispatch")
        C = num_max_dispatch_tokens_per_rank
        expect(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16,
               f"low_latency_dispatch: x must be 2-D, contiguous bfloat16 (is {x.dtype}, {tuple(x.shape)})")
        hidden = x.shape[1]
        expect(hidden % 128 == 0 and hidden in LOW_LATENCY_HIDDEN, f"low_latency_dispatch: hidden {hidden} is not "
                                                                   "one DeepEP's low-latency kernels are built for")
        self.check_low_latency("low_latency_dispatch", C, hidden, num_experts)
        self.check_topk_idx(topk_idx, num_experts, "low_latency_dispatch")
        expect(x.shape[0] == topk_idx.shape[0] and x.shape[0] <= C,
               f"low_latency_dispatch: {x.shape[0]} tokens, {topk_idx.shape[0]} top-k rows, capacity {C}")
        expect(topk_idx.shape[1] <= LOW_LATENCY_MAX_TOPK, f"top-k {topk_idx.shape[1]} > {LOW_LATENCY_MAX_TOPK}")
        expect(num_experts * 4 * 2 <= NUM_WORKSPACE_BYTES, "too many experts for the workspace")
        expect(not (async_finish and return_recv_hook), "async_finish and return_recv_hook together")
        if round_scale or use_ue8m0 or cumulative_local_expert_recv_stats is not None \
                or dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError("fake deep_ep: round_scale, UE8M0 and statistics are not emulated")
        self.calls["low_latency_dispatch"] += 1
        if use_fp8:
            self.calls["low_latency_dispatch use_fp8"] += 1
        recv_x, counts, inner, _, hook = self.emulation(num_experts).low_latency_dispatch(
            x, topk_idx, C, num_experts, use_fp8=use_fp8, return_recv_hook=return_recv_hook)
        # DeepEP's handle: (src_info, layout_range, C, hidden, num_experts)
        handle = (inner, (self, topk_idx.clone()), C, hidden, num_experts)
        return recv_x, counts, handle, EventOverlap(), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out=None, combine_wait_recv_cost_stats=None):
        """-> (combined [T, M] (weighted), event, hook)."""
        self.alive("low_latency_combine")
        expect(isinstance(handle, tuple) and len(handle) == 5, "low_latency_combine needs a low-latency dispatch's "
                                                               "handle")
        inner, (owner, dispatched_ids), C, hidden, num_experts = handle
        expect(owner is self, "low_latency_combine: the handle is another buffer's")
        self.check_low_latency("low_latency_combine", C, hidden, num_experts)
        G, L = self.group_size, num_experts // self.group_size
        expect(x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16,
               f"low_latency_combine: x must be 3-D, contiguous bfloat16 (is {x.dtype}, {tuple(x.shape)})")
        expect(tuple(x.shape) == (L, G * C, hidden),
               f"low_latency_combine: x {tuple(x.shape)} is not [num_local_experts, num_ranks * C, hidden] = "
               f"{(L, G * C, hidden)}")
        expect(topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == topk_idx_t,
               "low_latency_combine: topk_idx 2-D contiguous int64")
        expect(topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32,
               f"low_latency_combine: topk_weights 2-D contiguous float32 (is {topk_weights.dtype})")
        expect(tuple(topk_idx.shape) == tuple(topk_weights.shape) and topk_weights.shape[0] <= C,
               "low_latency_combine: topk_idx and topk_weights [T <= C, k]")
        expect(torch.equal(topk_idx, dispatched_ids),
               "low_latency_combine: topk_idx differs from its dispatch's (rows would come back from wrong experts)")
        expect(not (async_finish and return_recv_hook), "async_finish and return_recv_hook together")
        if use_logfmt or zero_copy or out is not None or combine_wait_recv_cost_stats is not None:
            raise NotImplementedError("fake deep_ep: LogFMT, zero-copy, out= and statistics are not emulated")
        self.calls["low_latency_combine"] += 1
        combined, _, hook = self.emulated.low_latency_combine(x, topk_idx, topk_weights, inner,
                                                              return_recv_hook=return_recv_hook)
        return combined, EventOverlap(), hook


def install(monkeypatch=None) -> types.ModuleType:
    """Put the fake in sys.modules as `deep_ep`: for one test (monkeypatch), or for the rest of a
    spawned rank's life (none)."""
    module = types.ModuleType("deep_ep")
    module.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None)  # importlib.util.find_spec finds it
    module.Buffer, module.Config, module.EventOverlap, module.topk_idx_t = Buffer, Config, EventOverlap, topk_idx_t
    module.__version__ = "fake"
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, "deep_ep", module)
    else:
        sys.modules["deep_ep"] = module
    Buffer.instances, Buffer.hints, Buffer.num_sms = [], [], 20
    return module
