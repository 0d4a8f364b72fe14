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

Speculation (the seed's MTP schedule). A speculative step n adds 1 + a tokens to each request,
a its accepted drafts, known on the device only. Step n+1, when it speculates again, is prepared
for the longest outcome (1 + k): pages for it plus the step's own lookahead, the verify batch
packed and planned at those positions. Before n+1's forward, tensor ops put each request's new
last token (n's row a) in place and shift its positions, written KV slots and causal mask back
by k - a (`TorchPagedAttention.shift`). The host's view of a speculative step's requests does
not change until the step is processed (no placeholders): drafting, verification and sampling
run at n+1's turn, after n was processed, from exact host state. What cannot be decided before
n's outcome (admitting a waiting request, a plain step, pages that need a preemption) is
prepared after n is processed instead, on the engine thread, and a prepared speculative step
holding a request that finished is prepared again: a wasted preparation, never a wrong token.

Across ranks (expert parallelism) every step is agreed once by all ranks before its forwards;
the helper makes step n+1's agreement while step n exchanges tokens, on a process group of its
own. An agreed step always runs: a rank with nothing scheduled joins the others' forwards, and
one that cannot prepare its part ahead (a plain step after a speculative one; a speculative step
holding a request that finished) prepares it after n is processed, under the same agreement.
A rank that cannot decide the step ahead at all agrees after n is processed instead; the others
wait for it in the collective (docs/static-steps.md).

Steps that need a previous token on the host run serially, after the prepared step has run and
been processed: requests with repetition, frequency or presence penalties (counted from the
outputs) or a grammar (its matcher must see the token before the next mask).

Shapes legend: T tokens, N sampled rows, B requests, W tokens a step may add per request.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from moespec.sequence import PENDING  # noqa: F401  (the placeholder token, re-exported)


@dataclass
class Outcome:
    """What a step left on the device for the next one: per sampled request W tokens and how
    many of them past the first are real (a speculative step: a accepted drafts, then the
    target's token at row a)."""

    tokens: torch.Tensor  # [N, W]
    accepted: torch.Tensor | None = None  # [N]; None: W = 1

    def last_tokens(self, sources: torch.Tensor) -> torch.Tensor:
        """[P] the new last token of the requests at rows `sources` [P]."""
        if self.accepted is None:
            return self.tokens[sources, 0]
        return self.tokens[sources, self.accepted[sources]]

    def shortfall(self, sources: torch.Tensor) -> torch.Tensor:
        """[P] how many fewer tokens than the most (W) the requests at `sources` of a speculative
        step got (0 .. W-1)."""
        return self.tokens.shape[1] - 1 - self.accepted[sources]


@dataclass
class InFlight:
    """A step decided ahead that has not run yet: what it runs, where its placeholders are and
    what fills them. Across ranks a step is agreed with the others when it is decided, so it runs
    even when this rank cannot prepare it ahead: `prepared` is then None, and the step joins the
    others' forwards (no `scheduled`) or is prepared once the step before is processed."""

    plan: object  # distributed.StepPlan
    prepared: object | None  # engine.PreparedStep
    pending_at: list[int] = field(default_factory=list)  # per sampled request: index of its placeholder
    rows: torch.Tensor | None = None  # [P] rows of the batch whose token the previous step samples
    sources: torch.Tensor | None = None  # [P] their requests' rows in the previous step's outcome
    ahead: bool = False  # planned for the previous (speculative) step's longest outcome: shifts back
    previous: Outcome | None = None  # the previous step's outcome, once it has run
    scheduled: object | None = None  # scheduler.SchedulerOutput of a step agreed, prepared later
    observed: threading.Event = field(default_factory=threading.Event)  # set once its target forward ran

    @property
    def speculative(self) -> bool:
        return self.prepared is not None and bool(self.prepared.num_spec)

    @property
    def requests(self) -> list:
        """The requests this step runs (none when it joins the others' forwards)."""
        scheduled = self.prepared.scheduled if self.prepared is not None else self.scheduled
        return [] if scheduled is None else [c.seq for c in scheduled.chunks]

    def widths(self) -> dict[int, int]:
        """The most tokens this step adds per sampled request (by id)."""
        width = 1 + self.prepared.num_spec
        return {id(seq): width for seq in self.prepared.sampled}


class HostWorker:
    """The helper thread that prepares the next step, on the CUDA device of the thread that
    starts it: `torch.cuda.set_device` holds per thread, and a new thread's bare "cuda" is
    cuda:0, where a non-zero local rank's batches do not belong."""

    def __init__(self) -> None:
        device = current_cuda_device()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moespec-prepare",
                                       initializer=use_cuda_device, initargs=(device,))

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def current_cuda_device() -> int | None:
    """This thread's CUDA device; None where CUDA is not in use (asking would not initialize it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def use_cuda_device(device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)
