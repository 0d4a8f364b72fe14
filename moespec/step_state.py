"""What one engine step carries and what the engine measures: a step prepared on the host
(`PreparedStep`), a speculative step whose device side ran (`Verified`), the requests a step
updated (`EngineOutputs`), the engine's phase for a watchdog (`StepProgress`), and the
cumulative timings and speculation figures (`StepStats`, `SpecStats`). Plain records, shared by
the engine's rooms (moespec.engine, requests, verification, overlap_driver)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moespec.batch import Batch
from moespec.config import TreeShape
from moespec.distributed import StepPlan
from moespec.overlap import Outcome
from moespec.sampling import SamplingBatch
from moespec.scheduler import SchedulerOutput
from moespec.sequence import Sequence


def needs_host_token(seq: Sequence) -> bool:
    """Whether building a request's next step reads its previous token on the host (penalties
    count the outputs; a grammar's matcher must see it before the next mask): its steps cannot
    overlap (moespec.overlap)."""
    return seq.params.penalized or seq.grammar is not None


@dataclass
class StepStats:
    """Cumulative wall time per phase, for the host-share measurement."""

    steps: int = 0
    host_s: float = 0.0
    device_s: float = 0.0
    decode_steps: int = 0
    decode_host_s: float = 0.0
    decode_device_s: float = 0.0
    decode_wall_s: float = 0.0  # with overlap less than host + device: the difference is host time hidden
    spec_steps: int = 0  # speculative steps (chains and trees), timed the same way
    spec_host_s: float = 0.0  # preparing the step, then reading its outcome and appending tokens
    spec_device_s: float = 0.0  # drafting, verification, the drafter's accept (on a CPU: all of it)
    spec_wall_s: float = 0.0
    tokens: int = 0
    requests: int = 0  # requests this engine ran (across ranks: placed on this rank)
    ahead_steps: int = 0  # overlap: steps decided (and across ranks agreed) while the step before ran
    shifted_steps: int = 0  # ... of them verify steps prepared for its longest outcome, shifted back
    prepared_again: int = 0  # ... prepared again once it was processed (a request finished; a plain step)


@dataclass
class SpecStats:
    """Engine-wide speculation figures (for /metrics and benchmarks)."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [K] verify steps whose draft i was accepted
    drafted_at: list[int] = field(default_factory=list)  # [K] verify steps that drafted position i
    by_tree: dict[str, list[int]] = field(default_factory=dict)  # tree shape label -> [verify steps, accepted]

    def tree_accept_lengths(self) -> dict[str, float]:
        """Accept length per tree shape that ran."""
        return {label: (accepted + steps) / steps for label, (steps, accepted) in self.by_tree.items() if steps}

    @property
    def accept_length(self) -> float:
        """Mean tokens per request per verify step: accepted drafts + the target's token."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def add(self, k: int, num_accepted: list[int], tree: TreeShape | None = None) -> None:
        """A verify step of k draft positions (a tree: its depth) and each request's accepted drafts."""
        if tree is not None:
            counts = self.by_tree.setdefault(tree.label, [0, 0])
            counts[0] += len(num_accepted)
            counts[1] += sum(num_accepted)
        grow = k - len(self.accepted_at)
        if grow > 0:
            self.accepted_at += [0] * grow
            self.drafted_at += [0] * grow
        for a in num_accepted:
            self.steps += 1
            self.draft_tokens += k
            self.accepted_tokens += a
            for i in range(k):
                self.drafted_at[i] += 1
                self.accepted_at[i] += int(i < a)


@dataclass
class PreparedStep:
    scheduled: SchedulerOutput
    batch: Batch | None  # a chain's verify batch has its draft rows filled once drafted; None for a tree
    sampling: SamplingBatch | None
    sampled: list[Sequence]
    ctx: object = None
    host_s: float = 0.0
    num_spec: int = 0  # draft tokens per request this step
    plan: StepPlan | None = None
    tree: TreeShape | None = None  # a speculative step that drafts this tree instead of a chain


@dataclass
class EngineOutputs:
    updated: list[Sequence] = field(default_factory=list)  # got new tokens or finished this step


@dataclass
class Verified:
    """A speculative step whose device side ran: its outcome, and its host side (read the accepted
    lengths, append tokens), which runs after (under overlap, once the next step is prepared)."""

    outcome: Outcome
    finish: Callable[[], EngineOutputs]
    device_s: float = 0.0


@dataclass
class StepProgress:
    """What the current step is doing, for a watchdog that finds it stuck (every room sets it)."""

    phase: str = "idle"
