"""How many tokens to draft this step, so that speculation never runs slower than none.

A config table maps batch size to k (the largest key <= batch size applies; 0 turns
speculation off). With `adaptive: true` the engine also measures, per batch-size bucket,
the tokens each request gains per step and the step's wall time, for the table's k and for
k = 0, and uses whichever gives more tokens per second, re-measuring the other now and
then: when verification stops paying (large batches, low acceptance) the step falls back to
plain decoding. Speculation must win by `margin` (5% by default): within it the two are
equal as far as a noisy step-time measurement can tell, and plain decoding has no catch-up
steps and no tail of requests finishing at different steps, which these measurements miss. Only steady steps are measured: a speculative step in which the draft first
catches up on tokens it skipped (after a prefill, or after plain steps) costs more than the
steady state and is not recorded, so a re-measurement runs `explore_steps` steps in a row.
Its interval doubles, from `explore_every` up to 16x, each time the loser stays the loser.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Measure:
    tokens_per_step: float = 0.0  # per request
    seconds: float = 0.0
    count: int = 0

    def add(self, tokens: float, seconds: float, decay: float = 0.8) -> None:
        if self.count == 0:
            self.tokens_per_step, self.seconds = tokens, seconds
        else:
            self.tokens_per_step = decay * self.tokens_per_step + (1 - decay) * tokens
            self.seconds = decay * self.seconds + (1 - decay) * seconds
        self.count += 1

    @property
    def rate(self) -> float:
        return self.tokens_per_step / self.seconds if self.seconds > 0 else 0.0


class SpeculationPolicy:
    def __init__(self, max_tokens: int, schedule: dict | None = None, adaptive: bool = True,
                 explore_every: int = 32, explore_steps: int = 4, min_samples: int = 2, margin: float = 0.05) -> None:
        self.max_tokens = max_tokens
        self.margin = margin
        self.schedule = sorted((int(b), int(k)) for b, k in (schedule or {}).items())
        self.adaptive = adaptive
        self.explore_every, self.explore_steps, self.min_samples = explore_every, explore_steps, min_samples
        self.measures: dict[tuple[int, int], Measure] = {}
        self.steps: dict[int, int] = {}
        self.intervals: dict[int, int] = {}  # bucket -> steps between re-measurements
        self.leaders: dict[int, int] = {}  # bucket -> k that won the last comparison
        self.next_explore: dict[int, int] = {}  # bucket -> step of the next re-measurement

    def table_k(self, batch_size: int) -> int:
        k = self.max_tokens
        for size, value in self.schedule:
            if size <= batch_size:
                k = value
        return max(0, min(k, self.max_tokens))

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << (batch_size - 1).bit_length()  # 1, 2, 4, 8, ...

    def choose(self, batch_size: int) -> int:
        k = self.table_k(batch_size)
        if not self.adaptive or k == 0:
            return k
        bucket = self.bucket(batch_size)
        step = self.steps.get(bucket, 0)
        self.steps[bucket] = step + 1
        spec, plain = self.measures.get((bucket, k)), self.measures.get((bucket, 0))
        if spec is None or spec.count < self.min_samples:
            return k
        if plain is None or plain.count < self.min_samples:
            return 0
        best, other = (k, 0) if spec.rate > (1 + self.margin) * plain.rate else (0, k)
        if self.leaders.get(bucket) != best:  # the lead changed: re-measure soon
            self.leaders[bucket], self.intervals[bucket] = best, self.explore_every
            self.next_explore[bucket] = step + self.explore_every
        explore_from = self.next_explore[bucket]
        if step < explore_from:
            return best
        if step < explore_from + self.explore_steps:
            return other
        interval = min(2 * self.intervals[bucket], 16 * self.explore_every)
        self.intervals[bucket], self.next_explore[bucket] = interval, step + interval
        return best

    def record(self, batch_size: int, k: int, tokens_per_request: float, seconds: float) -> None:
        if not self.adaptive:
            return
        self.measures.setdefault((self.bucket(batch_size), k), Measure()).add(tokens_per_request, seconds)
