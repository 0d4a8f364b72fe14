"""The expert-parallel link: blocking collectives on one group, run FIFO on one comm thread so the
caller keeps computing while a dispatch or combine is in flight.

Inside a captured step (model.cuda_graph) jobs run on the capturing thread instead (`submit`).

`Collectives` issues torch.distributed calls (gloo on CPU, NCCL on GPU); `ThrottledCollectives`
adds a modelled inter-node link (latency + bytes / bandwidth per call, slept on the comm thread)
so tests and benchmarks see InfiniBand-like costs on one machine. Every rank submits the same
collectives in the same order, and one thread runs them, so they pair up across ranks.

Shapes legend: N rows sent, R rows received, G group size.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from moespec.models.layers import CAPTURING
from moespec.parallel.groups import ParallelContext, ParallelError


class Collectives:
    """Blocking collectives over the EP group of `ctx`."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.group = ctx.ep_group
        self.size = ctx.ep_size

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """send_counts [G] rows for each rank -> [G] rows each rank sends here."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """send [N, ...] grouped by destination rank -> [R, ...] grouped by source rank."""
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)
        return recv

    def all_to_all_fixed(self, send: torch.Tensor, wire_bytes: Callable[[], int] | None = None) -> torch.Tensor:
        """send [G * n, ...] (n rows for each rank, in rank order) -> [G * n, ...] (n from each):
        equal splits, so no counts are needed and nothing is read on the host. `wire_bytes`: what
        DeepEP would move for it (valid rows only; a modelled link charges that, not the padding)."""
        if self.size == 1:
            return send
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        return recv

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """part [n, ...] (same n on every rank) -> [G * n, ...] in rank order."""
        if self.size == 1:
            return part
        out = part.new_empty((self.size * part.shape[0], *part.shape[1:]))
        dist.all_gather_into_tensor(out, part.contiguous(), group=self.group)
        return out


@dataclass(frozen=True)
class LinkModel:
    """Cost of one collective on a modelled link: latency + bytes this rank sends / bandwidth."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = float("inf")

    def delay(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


class ThrottledCollectives(Collectives):
    """Collectives over a modelled link: a collective completes latency + bytes / bandwidth after
    every rank has joined it (the sleep follows the real exchange, on the comm thread), so ranks
    that arrive at different times do not absorb the link's cost in their waiting."""

    def __init__(self, ctx: ParallelContext, link: LinkModel) -> None:
        super().__init__(ctx)
        self.link = link
        self.injected_s = 0.0  # total sleep so far, for benchmarks

    def wait_link(self, nbytes: int) -> None:
        delay = self.link.delay(nbytes)
        self.injected_s += delay
        time.sleep(delay)

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        recv = super().exchange_counts(send_counts)
        self.wait_link(remote_bytes(send_counts, [1] * self.size, self.ctx.ep_rank))
        return recv

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        recv = super().all_to_all(send, send_counts, recv_counts)
        rank = self.ctx.ep_rank  # the busier direction of this rank's port sets the time
        self.wait_link(max(remote_bytes(send, send_counts, rank), remote_bytes(recv, recv_counts, rank)))
        return recv

    def all_to_all_fixed(self, send: torch.Tensor, wire_bytes: Callable[[], int] | None = None) -> torch.Tensor:
        recv = super().all_to_all_fixed(send)
        padded = send.numel() * send.element_size() * (self.size - 1) // self.size
        # valid rows read on the comm thread; a captured step charges the padding (no host read)
        self.wait_link(wire_bytes() if wire_bytes is not None and not CAPTURING.get() else padded)
        return recv

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        out = super().all_gather(part)
        self.wait_link(part.numel() * part.element_size() * (self.size - 1))
        return out


def remote_bytes(send: torch.Tensor, send_counts: list[int], rank: int) -> int:
    """Bytes of `send` [N, ...] that leave this rank (rows for itself stay local)."""
    row = send[0].numel() * send.element_size() if send.shape[0] else 0
    return (sum(send_counts) - send_counts[rank]) * row


class CommHandle:
    """A collective (or a chain of them) in flight on the comm thread; `wait()` returns its result."""

    def __init__(self, future: Future, what: str, ctx: ParallelContext) -> None:
        self.future, self.what, self.ctx = future, what, ctx

    def wait(self) -> Any:
        limit = self.ctx.timeout_s + 10.0  # the group's own timeout fires first; this is a backstop
        try:
            return self.future.result(timeout=limit)
        except FutureTimeout:
            raise ParallelError(f"EP {self.what} on rank {self.ctx.rank} of {self.ctx.world_size} did not finish "
                                f"within {limit:g} s: a peer rank is dead or stuck") from None
        except ParallelError:
            raise
        except Exception as error:
            raise ParallelError(f"EP {self.what} failed on rank {self.ctx.rank} of {self.ctx.world_size}: a peer rank "
                                f"died or timed out (parallel.timeout_s={self.ctx.timeout_s:g}): {error}") from error


class Ready:
    """A finished transfer (or one run on the caller's thread) behind the same `wait()` as one in flight."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


SWITCH_INTERVAL_S = 0.0005


class CommStream:
    """One thread running communication jobs in submission order (like a comm CUDA stream)."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.ctx = collectives.ctx
        # on this rank's device: torch.cuda.set_device holds per thread (a new thread's is cuda:0)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ep-comm-{self.ctx.rank}",
                                           initializer=use_device, initargs=(self.ctx.device,))
        # A finished transfer must get the GIL back promptly, not after the default 5 ms switch interval.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    def submit(self, what: str, job: Callable[..., Any], *args: Any) -> CommHandle | Ready:
        """Run `job` after those before it; inside a captured step (model.cuda_graph) it runs
        here and now instead: a CUDA graph records only the kernels its own thread launches."""
        if CAPTURING.get():
            return Ready(job(*args))
        return CommHandle(self.executor.submit(job, *args), what, self.ctx)

    def run(self, what: str, job: Callable[..., Any], *args: Any) -> Any:
        return self.submit(what, job, *args).wait()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def use_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
