"""Seconds per decode step, per choice: a least-squares fit over the steps already run, which
the adaptive speculation policy (`moespec.speculation.adaptive`) divides tokens by."""
from __future__ import annotations

import math

import numpy as np

from moespec.speculation.tree import TreeShape

Choice = int | TreeShape  # a chain's draft length (0: none) or a tree


def family(choice: Choice) -> str | TreeShape:
    return choice if isinstance(choice, TreeShape) else "chain" if choice else "plain"


def features(choice: Choice, batch_size: int, cold: bool = False) -> list[float]:
    """The fit's inputs for one step; B scaled by 1/16 so that the ridge weighs terms alike; the
    last is 1 for a choice's first step at a batch size (`cold`), 0 in every prediction."""
    b = batch_size / 16
    if isinstance(choice, int) and choice:
        return [1.0, float(choice), b, b * choice, float(cold)]
    return [1.0, b, float(cold)]


class Samples:
    """One family's recent steps at one bucket, in a ring buffer: features and seconds."""

    def __init__(self, window: int, width: int) -> None:
        self.x = np.zeros((window, width))  # [N, F]
        self.y = np.zeros(window)  # [N]
        self.added = 0
        self.at = 0  # the bucket's steps (any family's) up to the newest

    def add(self, x: list[float], y: float, at: int) -> None:
        i = self.added % len(self.y)
        self.x[i], self.y[i] = x, y
        self.added, self.at = self.added + 1, at

    def filled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Features [N, F], seconds [N] and each sample's age in samples of this bucket [N]."""
        n, window = min(self.added, len(self.y)), len(self.y)
        ages = (self.added - 1 - np.arange(n)) % window
        return self.x[:n], self.y[:n], ages


class StepCosts:
    """Seconds per step, per family, as a weighted least-squares fit over its recent samples
    (the last `window` per bucket: a bucket's samples make way only for newer ones of it). Plain
    decoding's samples at a bucket restart where it runs there again after `stale` of the bucket's
    steps without it: they describe the machine and the contexts as they were then, and a draft
    that leads is compared with them (`SpeculationPolicy.probe` runs it again by then). SmolLM2 at
    batch 4 ran plain steps at 42-44 ms through most of a phase and at 34-36 ms for ten seconds
    of it; plain decoding last run in a slow stretch, at 47 ms, had a draft losing 14% lead for a
    whole phase (docs/benchmarks.md)."""

    def __init__(self, window: int = 128, half_life: float = 64.0, locality: float = 0.25,
                 ridge: float = 0.1, noise_floor: float = 0.02, refit_every: int = 8, stale: int = 128) -> None:
        self.window, self.half_life, self.locality, self.stale = window, half_life, locality, stale
        self.ridge, self.noise_floor, self.refit_every = ridge, noise_floor, refit_every
        self.samples: dict[object, dict[int, Samples]] = {}  # family -> log2 bucket -> its steps
        self.added: dict[object, int] = {}  # family -> samples so far
        self.counts: dict[Choice, int] = {}
        self.counts_at: dict[tuple[object, int], int] = {}  # (family, log2 bucket) -> steps
        self.ticks: dict[int, int] = {}  # log2 bucket -> steps measured there, any family
        self.shapes: set[tuple[Choice, int]] = set()  # (choice, batch size) of the steps so far
        # (family, log2 bucket) -> (the family's samples when fitted, predictions since, fit)
        self.fits: dict[tuple[object, int], list] = {}

    def add(self, batch_size: int, choice: Choice, seconds: float) -> None:
        """A step's seconds. The first at a (choice, batch size) is fitted as cold (`features`):
        its shapes ran for the first time (on the CPU, oneDNN builds a kernel per new row count),
        a cost the steps after it do not pay, which the fit's cold term takes (one per family,
        from the batch sizes it ran both cold and again) and no prediction includes. So a run
        that measures a draft at batch sizes it never ran (a draining batch's) still informs its
        line. Left out of the fit, they taught it nothing: SmolLM2 at batch 64, T = 0.7, had
        k = 1 predicted at +-60% at batch 44 when a run started there, and runs came back every
        repeat. Fitted with no cold term, their cost raised a tiny model's draft predictions until
        plain decoding ran where drafts won (docs/benchmarks.md)."""
        shape, key, bucket = (choice, batch_size), family(choice), log2_bucket(batch_size)
        self.counts[choice] = self.counts.get(choice, 0) + 1
        self.counts_at[key, bucket] = self.counts_at.get((key, bucket), 0) + 1
        cold = shape not in self.shapes
        self.shapes.add(shape)
        x = features(choice, batch_size, cold)
        buckets = self.samples.setdefault(key, {})
        if bucket not in buckets or (key == "plain" and self.age(choice, batch_size) >= self.stale):
            buckets[bucket] = Samples(self.window, len(x))
            self.fits = {where: fit for where, fit in self.fits.items() if where[0] != key}
        self.ticks[bucket] = self.ticks.get(bucket, 0) + 1
        buckets[bucket].add(x, seconds, self.ticks[bucket])
        self.added[key] = self.added.get(key, 0) + 1

    def count(self, choice: Choice) -> int:
        return self.counts.get(choice, 0)

    def count_at(self, choice: Choice, batch_size: int) -> int:
        """Steps of choice's family run at batch_size's bucket."""
        return self.counts_at.get((family(choice), log2_bucket(batch_size)), 0)

    def age(self, choice: Choice, batch_size: int) -> float:
        """Steps measured at batch_size's bucket since choice's family last ran there (inf: never)."""
        bucket = log2_bucket(batch_size)
        samples = self.samples.get(family(choice), {}).get(bucket)
        return math.inf if samples is None else self.ticks[bucket] - samples.at

    def predict(self, batch_size: int, choice: Choice, peek: bool = False) -> tuple[float, float] | None:
        """Seconds of one step and its standard error; None before the family has a sample.
        `peek`: from the fits as they stand, none redone or counted as used for it."""
        fitted = self.fitted(family(choice), log2_bucket(batch_size), choice, peek)
        if fitted is None:
            return None
        theta, inverse, noise, floor, lengths = fitted
        x = np.array(features(choice, batch_size))  # warm: not a first step at this batch size
        seconds = max(float(x @ theta), floor)
        if isinstance(choice, int) and choice and choice not in lengths and "plain" in self.samples:
            seconds = max(seconds, self.least_chain(batch_size, choice, theta, lengths))
        return seconds, math.sqrt(noise * float(x @ inverse @ x))

    def least_chain(self, batch_size: int, k: int, theta: np.ndarray, lengths: tuple[int, ...]) -> float:
        """The least a chain of k, a length its fit did not measure, may cost: a plain step's,
        plus k/n of what the fit predicts the next longer length n it measured to add to one (a
        chain adds drafting and a longer verify, a fixed part and a part per draft, neither
        below 0, so what it adds shrinks no faster than k). The fit is one line in k for all
        lengths, and the steps' costs need not be: fed mostly k = 2 on SmolLM2 at batch 4 (plain
        37.1 ms, k = 2 50.4, k = 3 67.4) it extrapolated k = 1 to 33.4 ms, below a plain step (it
        ran at 45.7; the least is 43.8), and k = 1 led where plain decoding won."""
        plain, _ = self.predict(batch_size, 0, peek=True)
        n = min((n for n in lengths if n > k), default=None)
        if n is None:
            return plain
        return plain + max(0.0, k / n * (float(np.dot(features(n, batch_size), theta)) - plain))

    def fitted(self, key, where: int, choice: Choice, peek: bool = False) -> tuple | None:
        """The family's fit at a log2 bucket, redone after a new sample (its own, or plain
        decoding's, which sets its prior), at most once per `refit_every` predictions or samples."""
        if key not in self.samples:
            return None
        added = self.added[key] + (self.added.get("plain", 0) if key != "plain" else 0)
        cached = self.fits.get((key, where))
        if peek:
            return cached[2] if cached else self.fit(self.samples[key], where, self.prior(choice, where, peek))
        if cached is None or (added > cached[0] and (cached[1] >= self.refit_every
                                                     or added - cached[0] >= self.refit_every)):
            cached = self.fits[key, where] = [added, 0, self.fit(self.samples[key], where, self.prior(choice, where))]
        cached[1] += 1
        return cached[2]

    def prior(self, choice: Choice, where: int, peek: bool = False) -> np.ndarray | None:
        """What the slope terms shrink toward (the ridge's centre): for plain decoding 0; for a
        draft its verify's share of plain decoding's slope at this bucket, a chain of k verifying
        1 + k tokens per request and a tree its nodes. So a draft measured at one batch size only
        is predicted at smaller ones from how plain decoding's steps shrink (the verify part of its
        step at least), not flat: at a low load the draft is predicted cheaper there and tried."""
        if choice == 0 or "plain" not in self.samples:
            return None
        plain = self.fitted("plain", where, 0, peek)[0]
        slope, cold = max(float(plain[1]), 0.0), max(float(plain[2]), 0.0)  # seconds per 16 requests; per cold step
        if isinstance(choice, TreeShape):
            return np.array([0.0, slope * (1 + choice.num_draft_tokens), cold])
        return np.array([0.0, 0.0, slope, slope, cold])  # a + d*k + b*B + e*B*k + cold: B*(1+k) tokens verified

    def solve(self, x: np.ndarray, y: np.ndarray, w: np.ndarray,
              prior: np.ndarray | None = None, pinned: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Coefficients [F] and the inverse normal matrix [F, F]; the other terms shrink toward
        `prior` [F] (0 without), the intercept not at all; `pinned`: terms held at the prior's."""
        penalty = np.full(x.shape[1], self.ridge * w.sum() / len(w))
        penalty[0] = 1e-9
        if pinned is not None:
            penalty[pinned] = 1e6 * w.sum()
        inverse = np.linalg.inv((x * w[:, None]).T @ x + np.diag(penalty))
        centre = 0.0 if prior is None else penalty * prior
        return inverse @ ((x * w[:, None]).T @ y + centre), inverse

    def fit(self, buckets: dict[int, Samples], where: int, prior: np.ndarray | None = None) -> tuple:
        """Weighted ridge least squares, outliers reweighted once: the coefficients, the inverse
        normal matrix, the noise variance per unit weight, a floor for predictions (a quarter
        of the cheapest step seen) and, for chains, the lengths measured."""
        parts = [(*samples.filled(), abs(b - where)) for b, samples in buckets.items()]
        x = np.concatenate([p[0] for p in parts])  # [N, F]
        y = np.concatenate([p[1] for p in parts])  # [N]
        w = np.concatenate([0.5 ** (p[2] / self.half_life) * self.locality ** p[3] for p in parts])  # [N]
        theta, inverse = self.solve(x, y, w, prior)
        residual = y - x @ theta
        # one reweighting pass (Huber): a step taken in a burst of load on a shared machine
        # weighs as if it were 2.5 robust deviations off, not its full distance
        scale = 1.4826 * float(np.median(np.abs(residual))) + 1e-12
        w = w * np.minimum(1.0, 2.5 * scale / (np.abs(residual) + 1e-12))
        theta, inverse = self.solve(x, y, w, prior)
        mean = float((w * y).sum() / w.sum())
        floor = np.zeros(x.shape[1]) if prior is None else prior  # the least slopes in B
        if x.shape[1] == 3 and theta[1] < 0:  # a + b*B sloping down: flat (its slope held at 0)
            theta, inverse = self.solve(x, y, w, np.zeros(3), pinned=slice(1, 2))
        elif x.shape[1] == 5 and min((theta - floor)[2:4] @ [1.0, k] for k in (1.0, float(x[:, 1].max()))) < 0:
            # a chain whose step grows with B slower than its verify's tokens would in plain
            # decoding, for some length: its slopes at the prior's
            theta, inverse = self.solve(x, y, w, prior, pinned=slice(2, 4))
        residual = y - x @ theta
        dof = max(w.sum() - x.shape[1], 1.0)
        noise = max(float((w * residual ** 2).sum()) / dof, (self.noise_floor * mean) ** 2)
        lengths = ()  # a chain's lengths with a step's weight at least: those its fit measured
        if x.shape[1] == 5:
            lengths = tuple(int(n) for n in np.unique(x[:, 1]) if w[x[:, 1] == n].sum() >= 1.0)
        return theta, inverse, noise, 0.25 * float(y.min()), lengths


def log2_bucket(batch_size: int) -> int:
    return (batch_size - 1).bit_length()
