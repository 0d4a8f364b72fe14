"""The fixed-capacity expert exchange: DeepEP's low-latency semantics, with no host read.

Every rank sends at most C tokens per call (C = `num_max_dispatch_tokens_per_rank`: the tokens
of its own decode or verify step, or of one microbatch of it; the same C on every rank for a
call). A receiver gets

    recv_x [L, G*C, M]   each local expert's rows, the valid ones first
    counts [L]           valid rows per local expert, a device tensor

which is the layout a masked grouped GEMM takes (DeepGEMM's `m_grouped_..._masked`, or
`LocalExperts.forward_masked` here). The combine sends each expert's output rows back and
applies the gate weights. Every shape is fixed by (G, L, C, M), so nothing in a dispatch or
combine waits for the host, and the step can be captured in a CUDA graph.

- `GlooExchange` runs on any torch.distributed group (gloo on CPU, NCCL on GPU) as one
  fixed-size `all_to_all_single` per dispatch (rows and counts packed in one byte buffer) and
  one per combine, on the EP comm thread: `dispatch` returns at once with a handle whose
  `wait()` is DeepEP's receive hook.
- `DeepEPExchange` is DeepEP's `low_latency_dispatch` / `low_latency_combine` with
  `return_recv_hook=True` on the process's one `Buffer`, returning the same tensors.

`EPExperts.stages` is the one code path around both.

Shapes legend: T tokens this rank sends (T <= C), A activated experts per token, E experts
(global), L local experts, G ranks, C capacity per rank, M hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from moespec.parallel.groups import ParallelError


@dataclass
class Received:
    """One dispatch, as the experts see it."""

    x: torch.Tensor  # [L, G*C, M]
    counts: torch.Tensor  # [L] valid rows of each local expert (device)
    handle: Any  # what the combine needs to send the rows back


class Hooked:
    """DeepEP's transfer in flight: `wait()` calls its receive hook, then returns the result."""

    def __init__(self, hook: Callable[[], None], value: Any) -> None:
        self.hook, self.value = hook, value

    def wait(self) -> Any:
        self.hook()
        return self.value


def check_capacity(num_tokens: int, capacity: int) -> None:
    if num_tokens > capacity:
        raise ParallelError(f"{num_tokens} tokens in one low-latency dispatch exceed its capacity of {capacity} "
                            "tokens per rank (EPRuntime.max_tokens_per_rank); the step should have used the "
                            "uneven exchange")


@dataclass
class GlooHandle:
    pair_expert: torch.Tensor  # [T*A] global expert of each (token, slot) pair
    pair_slot: torch.Tensor  # [T*A] its row in that expert's send block
    rows: torch.Tensor  # [G, L, C] row of each received (source, expert, slot) in recv_x; G*C: none
    num_tokens: int
    capacity: int


class GlooExchange:
    """Fixed-size all-to-alls on the EP group's comm thread (see the module doc)."""

    def __init__(self, runtime, num_experts: int, capacity: int) -> None:
        self.runtime, self.num_experts, self.capacity = runtime, num_experts, capacity
        self.size = runtime.ctx.ep_size
        self.num_local = num_experts // self.size

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, capacity: int | None = None):
        """`capacity`: this call's C (every rank passes the same), at most the buffer's; padding
        past a rank's tokens is computed by every expert on CPU, so a smaller C costs less."""
        capacity = min(capacity or self.capacity, self.capacity)
        check_capacity(x.shape[0], capacity)
        return self.runtime.stream.submit("dispatch", self.dispatch_now, x, topk_ids, capacity)

    def combine(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, received: Received):
        return self.runtime.stream.submit("combine", self.combine_now, y, topk_weights, received.handle)

    def dispatch_now(self, x: torch.Tensor, topk_ids: torch.Tensor, C: int) -> Received:
        """x [T, M], topk_ids [T, A] (-1: no expert, a captured step's padded row) -> each local
        expert's rows from every rank."""
        (T, M), E, G, L = x.shape, self.num_experts, self.size, self.num_local
        expert = topk_ids.flatten()  # [T*A]
        hits = (expert[:, None] == torch.arange(E, device=x.device)).long()  # [T*A, E] (F.one_hot checks ids on the host)
        slot = (hits.cumsum(0) * hits).sum(1) - 1  # [T*A] the pair's row among its expert's pairs; -1: none
        counts = hits.sum(0)  # [E] rows sent to each expert
        send = x.new_zeros(E + 1, C, M)  # block E takes the pairs of no expert, and is not sent
        send[expert.where(expert >= 0, E), slot.clamp(min=0)] = x.repeat_interleave(topk_ids.shape[1], dim=0)
        send = send[:E]
        payload = torch.cat([send.reshape(E, -1).view(torch.uint8), counts[:, None].view(torch.uint8)], dim=1)
        row = M * x.element_size()
        got = self.runtime.collectives.all_to_all_fixed(payload, lambda: self.remote_rows(counts.view(G, L)) * row)
        # got: [G*L, bytes] from each source rank
        recv = got[:, :-8].contiguous().view(x.dtype).view(G, L, C, M)
        recv_counts = got[:, -8:].contiguous().view(torch.int64).view(G, L)  # [source, expert]
        rows = compact_rows(recv_counts, C)  # [G, L, C]
        recv_x = x.new_zeros(L, G * C + 1, M)  # one spare row takes the empty slots
        experts = torch.arange(L, device=x.device)[None, :, None].expand(G, L, C)
        recv_x[experts, rows] = recv
        return Received(recv_x[:, :G * C], recv_counts.sum(0), GlooHandle(expert, slot, rows, T, C))

    def remote_rows(self, counts: torch.Tensor) -> int:
        """Rows of counts [G, L] (per peer rank) that cross the link: a modelled link's charge,
        read on the comm thread by ThrottledCollectives only."""
        rank = self.runtime.ctx.ep_rank
        return int(counts.sum() - counts[rank].sum())

    def combine_now(self, y: torch.Tensor, topk_weights: torch.Tensor, handle: GlooHandle) -> torch.Tensor:
        """y [L, G*C, M] (unweighted) -> the weighted sum over each token's experts [T, M]."""
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
        return (pairs.view(T, A, M) * topk_weights[..., None].to(pairs.dtype)).sum(1)


def compact_rows(recv_counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """recv_counts [G, L] -> the row [G, L, C] each received slot takes in its expert's block:
    sources one after another, valid slots only; invalid slots point at row G*C (the spare)."""
    G, L = recv_counts.shape
    offsets = recv_counts.cumsum(0) - recv_counts  # [G, L] rows of earlier sources
    slot = torch.arange(capacity, device=recv_counts.device)  # [C]
    rows = offsets[:, :, None] + slot  # [G, L, C]
    return torch.where(slot < recv_counts[:, :, None], rows, G * capacity)


class DeepEPExchange:
    """DeepEP's low-latency kernels on the process's one Buffer, with receive hooks."""

    def __init__(self, runtime, num_experts: int, capacity: int) -> None:
        self.runtime, self.num_experts, self.capacity = runtime, num_experts, capacity

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, capacity: int | None = None):
        """DeepEP keeps the C its buffer was sized for on every call (one layout, graph-friendly)."""
        check_capacity(x.shape[0], self.capacity)
        buffer = self.runtime.deepep_buffer(x.shape[1], self.num_experts, low_latency=True)
        recv_x, counts, handle, _, hook = buffer.low_latency_dispatch(
            x, topk_ids.long(), self.capacity, self.num_experts, use_fp8=False, return_recv_hook=True)
        return Hooked(hook, Received(recv_x, counts, handle))

    def combine(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, received: Received):
        buffer = self.runtime.deepep_buffer(y.shape[-1], self.num_experts, low_latency=True)
        combined, _, hook = buffer.low_latency_combine(y, topk_ids.long(), topk_weights.float(), received.handle,
                                                       return_recv_hook=True)
        return Hooked(hook, combined)
