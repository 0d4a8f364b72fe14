"""How many tokens to draft this step, so that speculation never runs slower than none.

A config table maps batch size to k (the largest key <= batch size applies; 0 turns
speculation off). With `adaptive: true` the table's k is the most a step drafts: per
batch-size bucket the engine measures the tokens each request gains per step and the step's
wall time for a few lengths up to it (0, 1, 2, 4, ... and k itself) and drafts the length that
gives the most tokens per second, re-measuring the others now and then. Longer drafts pay
where acceptance is high and verification cheap (small batches); shorter ones, or none, where
verification costs more than the accepted tokens bring (large batches, low acceptance).

A length takes the lead only when it measures `margin` (5% by default) faster than the
leader, and plain decoding takes it back as soon as it is at least as fast: within the margin
the lengths are equal as far as a noisy step-time measurement can tell, switching back and
forth costs catch-up steps, and plain decoding has no catch-up steps and no tail of requests
finishing at different steps, which these measurements miss.
A speculative step in which the draft first catches up on the tokens of plain decode steps
costs more than the steady state and is what switching costs, so it is not recorded, and a
re-measurement runs `explore_steps` steps in a row. Its interval doubles, from
`explore_every` up to 16x, each time the leader stays the leader. A re-measurement skips the
choices that measured more than `prune` (25%) slower than the leader, except every fourth one:
with trees and chains there are many choices, and re-measuring far slower ones costs steps. A catch-up on a new
request's prompt, or on the token of a step that mixed decodes with a prefill chunk, is
recorded: plain decoding never pays it, and under traffic where requests come and go it
recurs, so it belongs to what speculating costs.

Draft trees (`speculation.tree`) join the lengths as further choices: a step runs a chain of
some length, a tree shape, or nothing, and the shapes are measured like the lengths. A fixed
tree without `adaptive` runs wherever the table says to speculate.
"""
from __future__ import annotations

from dataclasses import dataclass

from moespec.speculation.tree import TreeShape

Choice = int | TreeShape  # a chain's draft length (0: none) or a tree


@dataclass
class Measure:
    tokens_per_step: float = 0.0  # per request
    seconds: float = 0.0
    count: int = 0

    def add(self, tokens: float, seconds: float, decay: float = 0.8) -> None:
        """The mean of the first samples, then an exponential average (one costly first step
        does not outweigh the next four)."""
        keep = min(decay, self.count / (self.count + 1))
        self.tokens_per_step = keep * self.tokens_per_step + (1 - keep) * tokens
        self.seconds = keep * self.seconds + (1 - keep) * seconds
        self.count += 1

    @property
    def rate(self) -> float:
        return self.tokens_per_step / self.seconds if self.seconds > 0 else 0.0


class SpeculationPolicy:
    def __init__(self, max_tokens: int, schedule: dict | None = None, adaptive: bool = True,
                 explore_every: int = 32, explore_steps: int = 4, min_samples: int = 2, margin: float = 0.05,
                 trees: tuple[TreeShape, ...] = (), prune: float = 0.25) -> None:
        self.max_tokens = max_tokens
        self.trees = tuple(trees)
        self.schedule = sorted((int(b), int(k)) for b, k in (schedule or {}).items())
        self.adaptive = adaptive
        self.explore_every, self.explore_steps, self.min_samples = explore_every, explore_steps, min_samples
        self.margin, self.prune = margin, prune
        self.measures: dict[tuple[int, Choice], Measure] = {}
        self.steps: dict[int, int] = {}
        self.intervals: dict[int, int] = {}  # bucket -> steps between re-measurements
        self.leaders: dict[int, Choice] = {}  # bucket -> the choice that won the last comparison
        self.next_explore: dict[int, int] = {}  # bucket -> step of the next re-measurement
        self.exploring: dict[int, list[Choice]] = {}  # bucket -> what the current re-measurement runs
        self.rounds: dict[int, int] = {}  # bucket -> re-measurements done

    def table_k(self, batch_size: int) -> int:
        k = self.max_tokens
        for size, value in self.schedule:
            if size <= batch_size:
                k = value
        return max(0, min(k, self.max_tokens))

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << (batch_size - 1).bit_length()  # 1, 2, 4, 8, ...

    def candidates(self, k: int) -> list[Choice]:
        """Choices worth measuring up to k: the trees, then the draft lengths longest first (k, the
        powers of two below it, 0)."""
        lengths = sorted({k, 0} | {1 << i for i in range(k.bit_length()) if 1 << i < k}, reverse=True)
        return list(self.trees) + lengths

    def choose(self, batch_size: int) -> Choice:
        k = self.table_k(batch_size)
        if k == 0:
            return 0
        if not self.adaptive:
            return self.trees[0] if self.trees else k
        bucket = self.bucket(batch_size)
        step = self.steps.get(bucket, 0)
        self.steps[bucket] = step + 1
        lengths = self.candidates(k)
        for length in lengths:  # first measure every length once
            measure = self.measures.get((bucket, length))
            if measure is None or measure.count < self.min_samples:
                return length
        best = self.best(bucket, lengths)
        if self.leaders.get(bucket) != best:  # the lead changed: re-measure soon
            self.leaders[bucket], self.intervals[bucket] = best, self.explore_every
            self.next_explore[bucket] = step + self.explore_every
        since = step - self.next_explore[bucket]
        if since < 0:
            return best
        if since == 0:  # a re-measurement starts
            self.exploring[bucket] = self.worth_exploring(bucket, best, lengths)
        others = self.exploring.get(bucket, [])
        if since < self.explore_steps * len(others):  # each of them, explore_steps in a row
            return others[since // self.explore_steps]
        interval = min(2 * self.intervals[bucket], 16 * self.explore_every)
        self.intervals[bucket], self.next_explore[bucket] = interval, step + interval
        self.rounds[bucket] = self.rounds.get(bucket, 0) + 1
        return best

    def worth_exploring(self, bucket: int, best: Choice, lengths: list[Choice]) -> list[Choice]:
        """The choices a re-measurement runs: those within `prune` of the leader's rate, and every
        fourth time all of them (a far slower choice is re-measured rarely, never not at all)."""
        everything = self.rounds.get(bucket, 0) % 4 == 3
        floor = (1 - self.prune) * self.measures[bucket, best].rate
        return [c for c in lengths if c != best and (everything or self.measures[bucket, c].rate >= floor)]

    def best(self, bucket: int, lengths: list[Choice]) -> Choice:
        """The length to run: the leader stays unless another beats it by the margin, except
        that plain decoding takes over as soon as it measures at least as fast as speculating."""
        rate = {length: self.measures[bucket, length].rate for length in lengths}
        leader = self.leaders.get(bucket, 0)
        if leader not in rate or (leader and rate[0] >= rate[leader]):
            leader = 0
        fastest = max((length for length in lengths if length), key=rate.get)
        return fastest if rate[fastest] > (1 + self.margin) * rate[leader] else leader

    def record(self, batch_size: int, k: Choice, tokens_per_request: float, seconds: float) -> None:
        if not self.adaptive:
            return
        self.measures.setdefault((self.bucket(batch_size), k), Measure()).add(tokens_per_request, seconds)
