"""The fixed-capacity expert exchange: DeepEP's low-latency semantics, with no host read.

Every rank sends at most C tokens per call (C = `num_max_dispatch_tokens_per_rank`: the tokens
of its own decode or verify step, or of one microbatch of it; the same C on every rank for a
call). A receiver gets

    recv_x [L, G*C, M]   each local expert's rows, the valid ones first (FP8 dispatch: the pair
                         (e4m3 rows [L, G*C, M], float32 scales [L, G*C, M/128]), one scale per
                         128 channels of a row, as DeepEP's `use_fp8`)
    counts [L]           valid rows per local expert, a device tensor

which is the layout a masked grouped GEMM takes (DeepGEMM's `m_grouped_..._masked`, or
`LocalExperts.forward_masked` here). The combine sends each expert's output rows back and
applies the gate weights. Every shape is fixed by (G, L, C, M), so nothing in a dispatch or
combine waits for the host, and the step can be captured in a CUDA graph.

One call in flight. DeepEP's low-latency area is two buffers used in turn, and the send phase
of each call zeroes the receive counters of the other buffer: those the previous call's receive
waits on (`csrc/legacy/buffer.hpp` `low_latency_dispatch`/`_combine`: `next_buffer =
layout.buffers[low_latency_buffer_idx ^= 1]`, whose `clean_meta()` the send phase zeroes:
`internode_ll.cu` "The first SM is also responsible for cleaning the next buffer"). A call's
receive must therefore finish before the next call is issued, as DeepEP's figures/low-latency.png
draws it for two microbatches 0 and 1:

    dispatch 0 issue | attention 1 | dispatch 0 receive, dispatch 1 issue | MoE 0 |
    dispatch 1 receive, combine 0 issue | MoE 1 | combine 0 receive, combine 1 issue | attention 0

`LowLatencyExchange` keeps that order for every caller: issuing a call first runs the receive
hook of the call in flight, if its owner has not waited for it yet. Two microbatches stepped in
turns (models/two_batch.py), each yielding after it issues a call, then run exactly the figure:
the other microbatch computes while a call is in flight.

- `EmulatedBuffer` is DeepEP's low-latency Buffer API (the calls made here) on any
  torch.distributed group: gloo on CPU, NCCL on GPU. A call's send is one fixed-size
  `all_to_all_single` on the EP comm thread; its hook waits for it. It enforces DeepEP's
  contracts: the double buffer (a receive after the next call was issued is an error, where
  DeepEP would hang or read zeroed counters), `(num_ranks * C) % 4 == 0`, tokens <= C, top-k ids
  of DeepEP's `topk_idx_t` (int64), contiguous inputs on one device, FP8 only for hidden % 512
  == 0. Its counts are int32 and the rows past them NaN, rows and scales: DeepEP leaves them
  as its buffer held them, so nothing downstream may read them.
- On GPU with `moe_backend: deepep` the same exchange drives DeepEP's `Buffer` (the process's one).

Shapes legend: T tokens this rank sends (T <= C), A activated experts per token, E experts
(global), L local experts, G ranks, C capacity per rank, M hidden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moespec.parallel.groups import ParallelError

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (DeepEP's kFinfoAmaxE4M3)
FP8_MARGIN = 1e-4  # DeepEP's kFP8Margin: the smallest amax a block's scale is taken from
BLOCK = 128  # channels per FP8 scale
TOPK_IDX_DTYPE = torch.int64  # DeepEP v1.2.1's top-k ids; later versions export it as `deep_ep.topk_idx_t`


@dataclass
class Received:
    """One dispatch, as the experts see it."""

    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # [L, G*C, M], or (fp8 [L, G*C, M], scales [L, G*C, M/128])
    counts: torch.Tensor  # [L] valid rows of each local expert (device)
    handle: Any  # what the combine needs to send the rows back
    dtype: torch.dtype  # the dispatched rows' dtype (the experts' output dtype)


class Call:
    """A low-latency call issued: `receive()` runs its receive hook, once; `wait()` receives it,
    then returns its result (whose tensors are valid only from then on)."""

    def __init__(self, hook: Callable[[], None], value: Any) -> None:
        self.hook, self.value, self.received = hook, value, False

    def receive(self) -> None:
        if not self.received:
            self.hook()
            self.received = True

    def wait(self) -> Any:
        self.receive()
        return self.value


def check_capacity(num_tokens: int, capacity: int) -> None:
    if num_tokens > capacity:
        raise ParallelError(f"{num_tokens} tokens in one low-latency dispatch exceed its capacity of {capacity} "
                            "tokens per rank (EPRuntime.max_tokens_per_rank); the step should have used the "
                            "uneven exchange")


def aligned_capacity(capacity: int, num_ranks: int, rows: int = 4) -> int:
    """The smallest C' >= capacity with (num_ranks * C') % rows == 0, each expert's G*C' rows:
    DeepEP asserts a multiple of 4 ("TMA requires the number of tokens to be multiple of 4",
    buffer.hpp low_latency_dispatch); DeepGEMM's masked GEMM needs whole row tiles
    (`capacity_rows`)."""
    step = rows // math.gcd(num_ranks, rows)
    return -(-capacity // step) * step


def capacity_rows(backend: str) -> int:
    """What each expert's G*C rows are a multiple of: with DeepEP, DeepGEMM's 128-row tile (its
    masked GEMM takes the received rows only then, `models.fp8.deep_gemm_takes`); else DeepEP's 4."""
    return 128 if backend == "deepep" else 4


class LowLatencyExchange:
    """Dispatch and combine through a low-latency buffer (DeepEP's, or `EmulatedBuffer`), one call
    in flight (see the module doc). `buffer_for(hidden)` gives the buffer for a call; `per_call`:
    the buffer takes each call's own C (the emulation: padding is computed on CPU, so a smaller C
    costs less); otherwise every call uses `capacity`, the C its buffer was sized for.
    `index_dtype`: the buffer's top-k id dtype (DeepEP's `topk_idx_t`)."""

    def __init__(self, runtime, buffer_for: Callable[[int], Any], num_experts: int, capacity: int,
                 per_call: bool, index_dtype: torch.dtype = TOPK_IDX_DTYPE) -> None:
        self.runtime, self.buffer_for, self.num_experts = runtime, buffer_for, num_experts
        self.capacity, self.per_call, self.index_dtype = capacity, per_call, index_dtype
        self.in_flight: Call | None = None

    def receive_in_flight(self) -> None:
        """Run the receive hook of the call in flight (before another call, of either mode, is issued)."""
        if self.in_flight is not None:
            call, self.in_flight = self.in_flight, None
            call.receive()

    def issue(self, hook: Callable[[], None], value: Any) -> Call:
        self.in_flight = Call(hook, value)
        return self.in_flight

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, capacity: int | None = None) -> Call:
        """x [T, M], topk_ids [T, A] (-1: no expert) -> a Call whose wait() is the `Received`.
        `capacity`: this call's C (every rank passes the same), at most the buffer's."""
        C = min(capacity or self.capacity, self.capacity) if self.per_call else self.capacity
        C = aligned_capacity(C, self.runtime.ctx.ep_size)
        check_capacity(x.shape[0], C)
        self.receive_in_flight()
        buffer = self.buffer_for(x.shape[1])
        recv_x, counts, handle, _, hook = buffer.low_latency_dispatch(
            x.contiguous(), topk_ids.to(self.index_dtype).contiguous(), C, self.num_experts,
            use_fp8=self.runtime.fp8_dispatch, return_recv_hook=True)
        return self.issue(hook, Received(recv_x, counts, handle, x.dtype))

    def combine(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, received: Received) -> Call:
        """y [L, G*C, M] (unweighted expert outputs) -> a Call whose wait() is the weighted sum
        over each token's experts [T, M]."""
        self.receive_in_flight()
        buffer = self.buffer_for(y.shape[-1])
        combined, _, hook = buffer.low_latency_combine(y.contiguous(), topk_ids.to(self.index_dtype).contiguous(),
                                                       topk_weights.float().contiguous(), received.handle,
                                                       return_recv_hook=True)
        return self.issue(hook, combined)


# --------------------------------------------------------------------- the emulated buffer

@dataclass
class Flight:
    """One emulated call between its send and its receive."""

    name: str  # "dispatch #n"
    index: int  # which of the two buffers it uses
    job: Any  # the comm thread's handle of its all-to-all
    received: bool = False
    zeroed_by: str | None = None  # the later call whose send zeroed this buffer's receive counters


@dataclass
class EmulatedHandle:
    """What the emulated combine needs; filled in by the dispatch's all-to-all."""

    num_tokens: int
    capacity: int
    pair_expert: torch.Tensor | None = None  # [T*A] global expert of each (token, slot) pair
    pair_slot: torch.Tensor | None = None  # [T*A] its row in that expert's send block
    rows: torch.Tensor | None = None  # [G, L, C] row of each received (source, expert, slot) in recv_x; G*C: none


class EmulatedBuffer:
    """DeepEP's low-latency `Buffer` calls (`low_latency_dispatch`, `low_latency_combine`, both
    with `return_recv_hook=True`) as fixed-size all-to-alls on the EP group's comm thread, with
    the contracts DeepEP asserts or silently relies on enforced (see the module doc). Output
    tensors are allocated at the call, like DeepEP's, and filled by its all-to-all: they hold
    the result once the hook has run."""

    def __init__(self, runtime, num_experts: int) -> None:
        self.runtime, self.num_experts = runtime, num_experts
        self.size, self.rank = runtime.ctx.ep_size, runtime.ctx.ep_rank
        self.num_local = num_experts // self.size
        self.calls = 0  # calls issued so far: call n uses buffer n % 2
        self.last: Flight | None = None

    # -- the double buffer

    def send(self, what: str, job: Callable[..., None], *args: Any) -> Callable[[], None]:
        """Issue a call: its send zeroes the other buffer's receive counters, so a receive still
        pending there can no longer complete -> the call's receive hook."""
        flight = Flight(f"{what} #{self.calls}", self.calls % 2, None)
        if self.last is not None and not self.last.received:
            self.last.zeroed_by = flight.name
        self.calls += 1
        self.last = flight
        # the comm thread fills tensors made here, in this thread's inference mode (a per-thread setting)
        flight.job = self.runtime.stream.submit(what, run_in_mode, torch.is_inference_mode_enabled(), job, *args)
        return lambda: self.receive(flight)

    def receive(self, flight: Flight) -> None:
        if flight.received:
            raise ParallelError(f"low-latency {flight.name}: its receive hook ran twice")
        if flight.zeroed_by is not None:
            flight.job.wait()  # the all-to-all itself paired up with the other ranks'
            raise ParallelError(
                f"low-latency {flight.name} received after {flight.zeroed_by} was issued: DeepEP's send of "
                f"{flight.zeroed_by} zeroes the receive counters of buffer {flight.index}, which {flight.name} "
                "waits on (it would hang or read garbage). Receive each low-latency call (its hook) before "
                "issuing the next")
        flight.job.wait()
        flight.received = True

    # -- DeepEP's calls

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, use_fp8: bool = False, return_recv_hook: bool = False):
        """-> (recv_x, recv_count [L], handle, event (None), hook), as DeepEP's."""
        C, (T, M), G, L = num_max_dispatch_tokens_per_rank, x.shape, self.size, self.num_local
        check_dispatch(x, topk_idx, C, num_experts, G, use_fp8)
        counts = torch.empty(L, dtype=torch.int32, device=x.device)  # DeepEP's packed_recv_count: int32
        handle = EmulatedHandle(T, C)
        if use_fp8:  # DeepEP allocates the scales [L, M/128, G*C] and hands them over transposed (column-major)
            recv = (x.new_empty(L, G * C, M, dtype=torch.float8_e4m3fn),
                    x.new_empty(L, M // BLOCK, G * C, dtype=torch.float32).transpose(1, 2))
        else:
            recv = x.new_empty(L, G * C, M)
        hook = self.send("dispatch", self.dispatch_now, x, topk_idx, C, use_fp8, recv, counts, handle)
        return recv, counts, handle, None, self.hook_or_wait(hook, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: EmulatedHandle, return_recv_hook: bool = False):
        """-> (combined [T, M], event (None), hook), as DeepEP's."""
        check_same_device(x=x, topk_idx=topk_idx, topk_weights=topk_weights)
        check_contiguous("low-latency combine", x=x, topk_idx=topk_idx, topk_weights=topk_weights)
        out = x.new_empty(handle.num_tokens, x.shape[-1])
        hook = self.send("combine", self.combine_now, x, topk_weights, handle, out)
        return out, None, self.hook_or_wait(hook, return_recv_hook)

    @staticmethod
    def hook_or_wait(hook: Callable[[], None], return_recv_hook: bool) -> Callable[[], None] | None:
        if return_recv_hook:
            return hook
        hook()
        return None

    # -- the all-to-alls (comm thread)

    def dispatch_now(self, x: torch.Tensor, topk_ids: torch.Tensor, C: int, use_fp8: bool, recv, counts: torch.Tensor,
                     handle: EmulatedHandle) -> None:
        """x [T, M], topk_ids [T, A] -> each local expert's rows from every rank, into recv (and
        counts, handle)."""
        E, G, L = self.num_experts, self.size, self.num_local
        expert = topk_ids.flatten()  # [T*A]
        hits = (expert[:, None] == torch.arange(E, device=x.device)).long()  # [T*A, E] (F.one_hot checks ids on the host)
        slot = (hits.cumsum(0) * hits).sum(1) - 1  # [T*A] the pair's row among its expert's pairs; -1: none
        sent = hits.sum(0)  # [E] rows sent to each expert
        tokens = token_bytes(x, use_fp8)  # [T, W] each token as it travels
        W = tokens.shape[1]
        send = tokens.new_zeros(E + 1, C, W)  # block E takes the pairs of no expert, and is not sent
        send[expert.where(expert >= 0, E), slot.clamp(min=0)] = tokens.repeat_interleave(topk_ids.shape[1], dim=0)
        payload = torch.cat([send[:E].reshape(E, -1), sent[:, None].view(torch.uint8)], dim=1)
        got = self.runtime.collectives.all_to_all_fixed(payload, lambda: self.remote_rows(sent.view(G, L)) * W)
        # got: [G*L, bytes] from each source rank
        rows_in = got[:, :-8].reshape(G, L, C, W)
        recv_counts = got[:, -8:].contiguous().view(torch.int64).view(G, L)  # [source, expert]
        rows = compact_rows(recv_counts, C)  # [G, L, C]
        # one spare row takes the empty slots; rows past the counts read as NaN (DeepEP's hold
        # whatever its buffer held: nobody may read them)
        packed = tokens.new_full((L, G * C + 1, W), 0xFF)
        experts = torch.arange(L, device=x.device)[None, :, None].expand(G, L, C)
        packed[experts, rows] = rows_in
        unpack_tokens(packed[:, :G * C], x.dtype, use_fp8, recv)
        counts.copy_(recv_counts.sum(0))
        handle.pair_expert, handle.pair_slot, handle.rows = expert, slot, rows

    def remote_rows(self, counts: torch.Tensor) -> int:
        """Rows of counts [G, L] (per peer rank) that cross the link: a modelled link's charge,
        read on the comm thread by ThrottledCollectives only."""
        return int(counts.sum() - counts[self.rank].sum())

    def combine_now(self, y: torch.Tensor, topk_weights: torch.Tensor, handle: EmulatedHandle,
                    out: torch.Tensor) -> None:
        """y [L, G*C, M] (unweighted) -> the weighted sum over each token's experts, into out [T, M]."""
        L, _, M = y.shape
        G, C, T = self.size, handle.capacity, handle.num_tokens
        padded = torch.cat([y, y.new_zeros(L, 1, M)], dim=1)  # the spare row reads as zeros
        experts = torch.arange(L, device=y.device)[None, :, None].expand(G, L, C)
        back = padded[experts, handle.rows]  # [G, L, C, M] rows for each source rank
        recv_counts = (handle.rows < G * C).sum(2)  # [G, L] rows each source sent here
        row = M * y.element_size()
        got = self.runtime.collectives.all_to_all_fixed(back.reshape(G * L, C * M),
                                                        lambda: self.remote_rows(recv_counts) * row)
        # got: [E, C*M] the outputs of this rank's pairs
        pairs = got.view(-1, C, M)[handle.pair_expert, handle.pair_slot]  # [T*A, M]
        pairs = pairs.masked_fill((handle.pair_expert < 0)[:, None], 0)  # pairs of no expert add nothing
        A = topk_weights.shape[1]
        out.copy_((pairs.view(T, A, M) * topk_weights[..., None].to(pairs.dtype)).sum(1))


def run_in_mode(inference: bool, job: Callable[..., None], *args: Any) -> None:
    with torch.inference_mode(inference):
        job(*args)


def check_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, C: int, num_experts: int, num_ranks: int,
                   use_fp8: bool) -> None:
    """What DeepEP's low_latency_dispatch asserts (buffer.hpp), and that its inputs share a device
    (its receive buffers are allocated like x: `x.options()`)."""
    check_same_device(x=x, topk_idx=topk_idx)
    check_contiguous("low-latency dispatch", x=x, topk_idx=topk_idx)
    if x.dim() != 2 or topk_idx.dim() != 2 or x.shape[0] != topk_idx.shape[0]:
        raise ParallelError(f"low-latency dispatch: x {tuple(x.shape)} and topk_idx {tuple(topk_idx.shape)} must be "
                            "[T, M] and [T, A]")
    check_capacity(x.shape[0], C)
    if topk_idx.dtype != TOPK_IDX_DTYPE:
        raise ParallelError(f"low-latency dispatch: topk_idx is {topk_idx.dtype}; DeepEP takes {TOPK_IDX_DTYPE}")
    if num_experts % num_ranks:
        raise ParallelError(f"low-latency dispatch: {num_experts} experts over {num_ranks} ranks")
    if num_ranks * C % 4:
        raise ParallelError(f"low-latency dispatch: num_ranks {num_ranks} x capacity {C} is not a multiple of 4 "
                            "(DeepEP asserts it)")
    if use_fp8 and x.shape[1] % 512:
        raise ParallelError(f"FP8 low-latency dispatch needs hidden % 512 == 0 (DeepEP asserts it); hidden is "
                            f"{x.shape[1]}: set parallel.fp8_dispatch: false")


def check_contiguous(call: str, **tensors: torch.Tensor) -> None:
    """DeepEP asserts every input of its calls contiguous (buffer.hpp)."""
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ParallelError(f"{call}: {name} {tuple(tensor.shape)} is not contiguous (DeepEP asserts it)")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ParallelError(f"low-latency call with tensors on different devices: {devices}")


def quantize_per_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, M] -> (e4m3 [T, M], float32 scales [T, M/128]) as DeepEP's FP8 dispatch casts a row:
    per 128 channels, amax = max(|x|, 1e-4), scale_inv = amax / 448, value = x * 448 / amax
    (saturated)."""
    T, M = x.shape
    blocks = x.float().view(T, M // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=FP8_MARGIN)  # [T, M/128]
    values = (blocks * (FP8_MAX / amax)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(T, M), amax / FP8_MAX


def token_bytes(x: torch.Tensor, use_fp8: bool) -> torch.Tensor:
    """x [T, M] -> each token's bytes on the wire [T, W]: its rows, or (FP8) its e4m3 rows and scales."""
    if not use_fp8:
        return x.contiguous().view(torch.uint8)
    values, scales = quantize_per_block(x)
    return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=1)


def unpack_tokens(packed: torch.Tensor, dtype: torch.dtype, use_fp8: bool, recv) -> None:
    """packed [L, N, W] token bytes -> into recv (rows [L, N, M], or (e4m3 rows, scales))."""
    if not use_fp8:
        recv.copy_(packed.contiguous().view(dtype))
        return
    values, scales = recv
    M = values.shape[-1]
    values.view(torch.uint8).copy_(packed[..., :M])
    scales.copy_(packed[..., M:].contiguous().view(torch.float32))


def compact_rows(recv_counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """recv_counts [G, L] -> the row [G, L, C] each received slot takes in its expert's block:
    sources one after another, valid slots only; invalid slots point at row G*C (the spare)."""
    G, L = recv_counts.shape
    offsets = recv_counts.cumsum(0) - recv_counts  # [G, L] rows of earlier sources
    slot = torch.arange(capacity, device=recv_counts.device)  # [C]
    rows = offsets[:, :, None] + slot  # [G, L, C]
    return torch.where(slot < recv_counts[:, :, None], rows, G * capacity)
