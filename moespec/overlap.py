"""Overlap scheduling (`scheduler.overlap`): the host prepares step n+1 while step n runs.

The device side of a step (the model forward and sampling) runs on one worker thread; torch
releases the GIL inside its kernels, so on a CPU the host thread schedules, packs and plans the
next batch meanwhile (on CUDA the same split leaves the launches asynchronous). The host reads a
step's results one step behind:

  call k:  schedule n+1 -> pack and plan n+1 -> launch n+1 -> wait for n -> process n's tokens

When n+1 is scheduled, the tokens step n samples are not known on the host. Each request that n
samples holds a placeholder token (`PENDING`) in its outputs from launch until its result is
processed, so lengths, positions, pages and seeded-sampling keys are those the serial engine
would use; n+1's batch lists the rows holding placeholders and where in n's sampled tokens
their values are, and the worker fills them on the device before n+1's forward. A request that
finishes at step n was already scheduled in n+1: that row's token is dropped, never emitted.

Steps that need a previous token on the host run serially, after the in-flight step is
processed: requests with repetition, frequency or presence penalties (counted from the outputs)
or a grammar (its matcher must see the token before the next mask).

Shapes legend: T tokens, N sampled rows.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

PENDING = -1  # an output token the device has sampled and the host has not read yet


@dataclass
class InFlight:
    """A launched step: what the host must do with its results."""

    prepared: object  # engine.PreparedStep
    future: Future  # -> (SamplerOutput, device seconds)
    pending_at: list[int] = field(default_factory=list)  # per sampled request: index of its placeholder
    launched: float = 0.0


class DeviceWorker:
    """One thread that runs the device side of steps, in launch order."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moespec-device")

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(timed, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def timed(fn, *args):
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


def fill_pending(input_ids: torch.Tensor, rows: torch.Tensor | None, sources: torch.Tensor | None,
                 previous: torch.Tensor | None) -> None:
    """input_ids [T] (on the device): rows [P] holding placeholders take previous[sources] (the
    tokens the step before sampled, [N])."""
    if rows is not None:
        input_ids[rows] = previous[sources]
