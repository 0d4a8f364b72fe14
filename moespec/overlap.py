"""Overlap scheduling (`scheduler.overlap`): the host prepares step n+1 while step n runs.

Each engine call runs step n's forward and sampling on the engine's thread while one helper
thread schedules, packs and plans step n+1 (torch releases the GIL inside its kernels, so on a
CPU this is real concurrency; on CUDA the launches stay asynchronous). The device side stays
on the engine's thread: with the forward on a second thread, every engine in the process ran
2.5x slower on a 2-core CPU (two OpenMP teams contending), while the helper's host work uses
small tensors only. The host reads a step's tokens one step behind:

  call k:  [helper: schedule, pack, plan n+1]  |  [engine thread: fill, forward, sample n]
           -> process n's tokens

When n+1 is scheduled, the tokens step n samples are not known on the host. Each request that n
samples holds a placeholder token (`PENDING`) in its outputs from its preparation until its
result is processed, so lengths, positions, pages and seeded-sampling keys are those the serial
engine would use; n+1 lists the rows holding placeholders and where in n's sampled tokens their
values are, and they are filled on the device right before n+1's forward. A request that
finishes at step n was already scheduled in n+1: that row's token is dropped, never emitted.

Steps that need a previous token on the host run serially, after the prepared step has run and
been processed: requests with repetition, frequency or presence penalties (counted from the
outputs) or a grammar (its matcher must see the token before the next mask).

Shapes legend: T tokens, N sampled rows.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

PENDING = -1  # an output token the device has sampled and the host has not read yet


@dataclass
class InFlight:
    """A prepared step that has not run yet: where its placeholders are and what fills them."""

    prepared: object  # engine.PreparedStep
    pending_at: list[int] = field(default_factory=list)  # per sampled request: index of its placeholder
    rows: torch.Tensor | None = None  # [P] rows of the batch holding placeholders
    sources: torch.Tensor | None = None  # [P] their rows in the previous step's sampled tokens
    previous_tokens: torch.Tensor | None = None  # [N] the previous step's tokens, once it has run


class HostWorker:
    """The helper thread that prepares the next step."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moespec-prepare")

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def fill_pending(input_ids: torch.Tensor, rows: torch.Tensor, sources: torch.Tensor, previous: torch.Tensor) -> None:
    """input_ids [T] (on the device): rows [P] holding placeholders take previous[sources] (the
    tokens the step before sampled, [N])."""
    input_ids[rows] = previous[sources]
