"""How many tokens to draft this step, so that speculation never runs slower than none.

A config table maps batch size to k (the largest key <= batch size applies; 0 turns
speculation off). With `adaptive: true` the table's k is the most a step drafts, and per
batch-size bucket (1, 2, 4, ...) the policy runs the choice it predicts to give the most tokens
per second: plain decoding, a chain of k or of a power of two below it, or a draft tree.

    tokens/s of choice c at batch B = B * E_c / seconds_c(B)

- seconds_c(B), a step's wall time, is a least-squares fit over the steps already run
  (`StepCosts`), one per family: plain decoding `a + b*B`, chains `a + d*k + b*B + e*B*k`
  (B*(1+k) tokens verified, k draft forwards), each tree `a + b*B`, each plus a cold term
  for a first step at a batch size (left out of predictions), with outliers (steps taken in a
  burst of load) reweighted once; a line in B never slopes down (a bucket's batch sizes are too
  close together to tell its slope from noise: plain decoding's is then flat), a chain's
  slope is at least the prior's below, and a length the fit did not measure costs at least a
  plain step plus its share of what the next longer one adds (`StepCosts.least_chain`).
  Samples weigh less the further their bucket is from the one predicted (a quarter per
  doubling) and the older they are, so the fit is local where there is data and a line across
  buckets where there is not: a bucket never run is predicted from its neighbours. The slope
  terms carry a small ridge toward a prior: none for plain decoding, so measured at one batch
  size only it extrapolates flat; for a draft, its verify's share of plain decoding's slope (a
  chain of k verifies 1 + k tokens per request), so a draft measured only at a high load, where
  it lost, is predicted at a low one from how plain decoding's steps shrink there, and tried; a
  draft's cold term shrinks toward plain decoding's, which its many batch sizes run both cold
  and again measure.
- E_c, tokens per request per step: 1 for plain decoding; for a chain of k, 1 + sum over
  positions i <= k of P(a >= i), a the drafts a request's verify accepted, counted per position
  from recent verify steps whatever length ran (`Acceptance`), so a length never run is
  predicted from the others, averaged over the step's requests with each one's positions cut
  at the tokens it may still emit (a request 2 tokens from max_tokens keeps at most 2, whatever
  it drafts); a tree's own recent mean. Counts decay per policy step, so the estimate follows
  a workload whose acceptance shifts, and while plain decoding runs the uncertainty of a
  speculative choice grows until it is worth measuring again. Where the counts of the last
  verify steps (the last 16, 32, 48 or 64 requests') lie `shift_sigmas` (4) standard errors
  from the means, the workload has shifted, and the means restart from those counts: a fall is
  followed within a few steps, a rise once a run's counts show it that surely (at batch 4 a
  3-step run's 12 requests cannot).

Each prediction has a standard error (the fit's, and the acceptance counts'). A choice other
than the leader runs, `explore_steps` steps in a row, only where the run is expected to save
more than it costs (`worth`: what the choice may gain over the leader within its error, for the
steps one measurement informs, against the run's steps and catch-up), and only while exploration
stays within `explore_share` (2%) of the bucket's steps and what it loses within `explore_loss`
(1%) of the bucket's time, so at a batch size where plain decoding is predicted to win,
speculating to find out costs at most that. A step's loss is its time beyond the leader's,
predicted, for the tokens it kept (`loss`): a draft's step that keeps 1.2 tokens per request at
1.6 plain steps' time loses a quarter of it, not all (counting all of it, runs at SmolLM2's
batch 4 waited for the time share, not the step share, and a rise in acceptance went unmeasured
for hundreds of steps). A run starts only while the budget holds; a bucket's first run may
overdraw it once, and a run that ends with its draft predicted `margin` faster goes on for
`EXTEND_RUNS` runs at most: at batch 4 one run's 12 requests seldom show a rise in acceptance
surely. A switch from
plain decoding starts with a catch-up step: the draft runs over every position it skipped, at
batch 64 several plain steps' worth. It measures switching, not the choice, so only its time
counts, and its time beyond a steady step's, per position caught up (and `SWITCH_PRIOR` more
at no cost), prices the next switch: a draft is predicted at the rate it would keep over the
tokens the step's requests have left, its catch-up included (`priced`), and after a bucket's
first run, a run starts only where its predicted steps and catch-up fit the budget too. Near
the end of requests that hold long histories, a draft that wins per step loses once the switch
is paid. Before any prediction exists, each candidate runs `min_samples` steps once (the first
bucket the engine meets; others are predicted from it), and plain decoding runs `min_samples`
steps at every bucket it meets. A choice's first step at a batch size runs its shapes for the
first time: the fit gives it a cold term of its own (`StepCosts.add`), which predictions leave
out.

The leader stays unless another choice is predicted `margin` (5%) faster; plain decoding takes
over as soon as a leading draft is no longer predicted `keep_margin` (2.5%) faster: within the
margins the choices are equal as far as noisy step times can tell, and plain decoding has no
catch-up steps and no tail of requests finishing at different steps, which the step times miss.
On SmolLM2 at batch 8, T = 0.7, where the best draft breaks even, 15 paired runs each way gave a
median of 1.001 (worst run 0.974) with the keep margin against 0.997 (worst 0.961) without: its
runs that lost most were those where a draft predicted a few percent ahead led for hundreds of
steps. A draft takes the lead only where `sureness` (1) standard errors below its predicted rate
it still beats plain decoding.
Where its prediction is looser (at a bucket it never ran at, predicted from the others), the
bucket's first run measures it, whatever the budget, and it leads once it is known to win; on
SmolLM2, where every draft loses, loose predictions had drafts lead for hundreds of steps per
repeat in the buckets a draining batch met for the first time.

A decision that runs the leader holds for its bucket's next steps, one decision per
`decide_every` (8) steps; the steps between run the leader without predicting again (`due`:
the engine then skips what only a decision reads). Deciding every step cost 0.54 ms a step at
tiny MTP's batch 64 (its engine's `report`), about 1.5% of a plain step there, where plain
decoding led and little changed from step to step; now 0.24 ms. A switch, an exploration run or
a measurement waits at most 7 steps.

What the engine feeds in: `record` per decode or speculative step (batch size, the choice that
ran, tokens kept per request, seconds, and whether it measures the choice: not the catch-up
step after plain decoding), and `accept` per verify step (each request's accepted drafts).
Across ranks each rank's policy chooses from its own measurements and the step agreement runs
the shortest length any rank asks for (`moespec.distributed.decide`).

Draft trees (`speculation.tree`) join the lengths as further choices. A fixed tree without
`adaptive` runs wherever the table says to speculate.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from moespec.speculation.step_costs import Choice, StepCosts
from moespec.speculation.tree import TreeShape

SWITCH_PRIOR = 256  # positions caught up at no cost that a switch's price starts from (one request's hold)
SHIFT_WINDOWS = 4  # windows of requests that the counts compared with the means span at most
EXTEND_RUNS = 2  # runs that may follow a run whose draft ends predicted `margin` faster, whatever the budget


@dataclass
class Measure:
    tokens_per_step: float = 0.0  # the policy: all requests of the step (its rate: tokens/s)
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


@dataclass(frozen=True)
class Prediction:
    rate: float  # tokens per second, all requests of the batch
    error: float  # its standard error relative to the rate
    seconds: float = 0.0  # one step's

    def expected_gain(self, best: float) -> float:
        """E[max(0, rate - best)] in tokens/s, the true rate taken as normal around the predicted
        one with its standard error: what measuring this choice may find over `best`."""
        sigma = self.rate * self.error
        if sigma <= 0:
            return max(self.rate - best, 0.0)
        z = (self.rate - best) / sigma
        density = math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        return sigma * density + (self.rate - best) * 0.5 * math.erfc(-z / math.sqrt(2))


@dataclass
class Mean:
    """A mean over samples whose weight decays (the mean stays as their weight goes)."""

    mean: float = 0.0
    square: float = 0.0  # mean of squares
    weight: float = 0.0

    def add(self, total: float, squares: float, count: float) -> None:
        self.weight += count
        self.mean += (total - count * self.mean) / self.weight
        self.square += (squares - count * self.square) / self.weight

    def error(self, least_variance: float) -> float:
        """Standard error of the mean, with each sample's variance at least `least_variance`, its
        weight taken as 0.1 sample more: with none left (counts that decayed while plain decoding
        ran) the error is 3 samples' spread, so the mean is as good as unknown and a run measures
        it once the budget allows. With 1 sample more, a share of 0.08 whose counts had all decayed
        stayed within +-0.27 and no run was worth it: after a simulated rise in acceptance 9 of 40
        seeds ran no draft within 1,000 steps (now none; `SpeculationPolicy.probe`)."""
        return math.sqrt(max(self.square - self.mean ** 2, least_variance) / (self.weight + 0.1))


def merged(means: list[Mean]) -> Mean:
    """One new mean over all the samples of `means`."""
    total = Mean()
    for mean in means:
        if mean.weight:
            total.add(mean.mean * mean.weight, mean.square * mean.weight, mean.weight)
    return total


def shifted(mean: Mean, recent: Mean, sigmas: float) -> bool:
    """Whether `recent` (counted into `mean` too) lies more than `sigmas` standard errors from it;
    a share's variance is taken as at least 0.05, so a mean of 0 or 1 does not make it exact."""
    spread = max(mean.square - mean.mean ** 2, recent.square - recent.mean ** 2, 0.05)
    return abs(recent.mean - mean.mean) > sigmas * math.sqrt(spread / recent.weight + spread / (mean.weight + 1))


class Acceptance:
    """Tokens per request per step of each choice, from recent verify steps: per chain position
    i, the share of requests that drafted it and accepted it (with all before it); per tree (and
    per chain length where positions are not counted), its mean. Every speculative step multiplies
    the weight of what was counted by `decay`, so the means follow a shift within tens of steps;
    every plain step by `idle_decay`, closer to 1: while nothing is measured the errors grow
    slowly, so where plain decoding wins speculation is measured again every hundred steps or so
    (as the budget allows), not every few tens. The counts from before a rise in acceptance lose
    half their weight in 69 plain steps (139 with 0.995, which in the simulated model had a draft
    lead again 139 steps after a rise in the median, 639 at most; now 97 and 377: the counts
    held were too sure for a run to be worth it). A shift shows sooner: every `shift_window`
    requests verified, the positions' counts of the last 1 to `SHIFT_WINDOWS` windows are
    compared with the means, and where one differs by more than `shift_sigmas` standard errors
    (the workload changed, say from code to chat) the means restart from those counts
    (`follow_shift`): in the simulated model
    (40 seeds) a fall is followed in 11 steps in the median, 19 at most (decay alone: 20-36
    steps; one window at a time, with the errors of `Mean.error` before: up to 53), and a rise
    that a run's steps show surely replaces the low counts still held rather than being
    averaged with them. A run of 3 steps at batch 4 verifies 12 requests: too few to tell 0.56
    from 0.17 at 4 standard errors."""

    def __init__(self, decay: float = 0.98, idle_decay: float = 0.99, shift_sigmas: float = 4.0,
                 shift_window: int = 16) -> None:
        self.decay, self.idle_decay = decay, idle_decay
        self.shift_sigmas, self.shift_window = shift_sigmas, shift_window
        self.positions: list[Mean] = []  # [K] P(a > i) among requests that drafted position i
        self.recent: list[Mean] = []  # [K] ... counted since the last check for a shift
        self.windows: list[list[Mean]] = []  # the last SHIFT_WINDOWS windows of recent counts, newest last
        self.steps: dict[Choice, Mean] = {}  # choice -> tokens per request per step
        self.shifts = 0  # times the means restarted

    def tick(self, speculating: bool) -> None:
        decay = self.decay if speculating else self.idle_decay
        for mean in (*self.positions, *self.steps.values()):
            mean.weight *= decay

    def add_verify(self, k: int, num_accepted: list[int]) -> None:
        self.positions += [Mean() for _ in range(k - len(self.positions))]
        self.recent += [Mean() for _ in range(k - len(self.recent))]
        for i in range(k):
            accepted = sum(a > i for a in num_accepted)
            self.positions[i].add(accepted, accepted, len(num_accepted))
            self.recent[i].add(accepted, accepted, len(num_accepted))
        if self.recent[0].weight >= self.shift_window:
            self.follow_shift()

    def follow_shift(self) -> None:
        """Where the counts of the last 1, 2, ... `SHIFT_WINDOWS` windows lie, at some position,
        `shift_sigmas` standard errors from its mean, every position restarts: those with such
        counts from them, the others keep their mean with no weight (unsure, so a run measures
        them before they lead). One window of 16 requests tells 0.78 from 0.3 at 4 standard
        errors only where it happens to count 0.28 or less; compared one window at a time, a
        simulated fall went 24 steps unseen and left its old counts for hundreds of steps."""
        self.windows = (self.windows + [self.recent])[-SHIFT_WINDOWS:]
        self.recent = [Mean() for _ in self.recent]
        for n in range(1, len(self.windows) + 1) if self.shift_sigmas else ():
            counts = [merged([w[i] for w in self.windows[-n:] if i < len(w)]) for i in range(len(self.positions))]
            if any(shifted(mean, c, self.shift_sigmas) for mean, c in zip(self.positions, counts) if c.weight):
                self.restart(counts)
                return

    def restart(self, counts: list[Mean]) -> None:
        """The means from `counts` (merged afresh, so kept as they are), the shift counted."""
        self.shifts += 1
        self.positions = [c if c.weight else Mean(mean.mean, mean.square, 0.0) for mean, c in zip(self.positions, counts)]
        for mean in self.steps.values():  # each choice's tokens per step, from before the shift
            mean.weight = 0.0
        self.windows = []

    def add_step(self, choice: Choice, tokens: float, requests: int) -> None:
        self.steps.setdefault(choice, Mean()).add(tokens * requests, tokens ** 2 * requests, requests)

    def tokens(self, choice: Choice, rooms: list[int] | np.ndarray | None = None) -> tuple[float, float] | None:
        """Mean tokens per request per step and its standard error; None without data. `rooms`:
        the tokens each request may still emit (a chain's estimate keeps no more)."""
        if choice == 0:
            return 1.0, 0.0
        if isinstance(choice, int) and len(self.positions) >= choice:
            return self.chain_tokens(choice, rooms)
        mean = self.steps.get(choice)
        if mean is None:
            return None
        return mean.mean, mean.error(0.25)  # a request's tokens vary by at least half a token

    def chain_tokens(self, k: int, rooms: list[int] | np.ndarray | None = None) -> tuple[float, float]:
        """1 + sum_i P(a > i); errors summed (the positions' estimates share their requests).
        With `rooms`, the mean over requests of what a step keeps: a request r tokens from its
        end (max_tokens, the model's length) keeps at most r, so its drafts past r - 1 add
        nothing (near the end of requests a long chain drafts tokens that are thrown away)."""
        positions = self.positions[:k]
        error = sum(p.error(0.05) for p in positions)
        sums = list(itertools.accumulate((p.mean for p in positions), initial=0.0))  # [k + 1]
        if rooms is None or not len(rooms):
            return 1 + sums[k], error
        ends = np.minimum(np.maximum(np.asarray(rooms) - 1, 0), k)  # [B] the drafts each request keeps at most
        return 1 + float(np.asarray(sums)[ends].sum()) / len(ends), error

    def by_position(self) -> list[float]:
        return [p.mean for p in self.positions]


class SpeculationPolicy:
    def __init__(self, max_tokens: int, schedule: dict | None = None, adaptive: bool = True,
                 explore_share: float = 0.02, explore_steps: int = 3, min_samples: int = 2,
                 margin: float = 0.05, trees: tuple[TreeShape, ...] = (), accept_decay: float = 0.98,
                 sureness: float = 1.0, decide_every: int = 8, keep_margin: float = 0.025,
                 shift_sigmas: float = 4.0, explore_loss: float = 0.01) -> None:
        self.max_tokens = max_tokens
        self.trees = tuple(trees)
        self.schedule = sorted((int(b), int(k)) for b, k in (schedule or {}).items())
        self.adaptive = adaptive
        self.explore_share, self.explore_steps, self.min_samples = explore_share, explore_steps, min_samples
        self.margin, self.sureness, self.decide_every = margin, sureness, decide_every
        self.keep_margin, self.explore_loss = keep_margin, explore_loss
        self.costs = StepCosts()
        self.acceptance = Acceptance(accept_decay, shift_sigmas=shift_sigmas)
        self.measures: dict[tuple[int, Choice], Measure] = {}  # (bucket, choice) -> measured, for /metrics
        self.steps: dict[int, int] = {}  # bucket -> steps the policy chose
        self.explored: dict[int, int] = {}  # bucket -> ... of them to measure a choice, not to run the leader
        self.first_steps = 0  # steps that measured every candidate before any prediction (once)
        self.leaders: dict[int, Choice] = {}  # bucket -> the choice predicted fastest
        self.predicted: dict[int, dict[Choice, float]] = {}  # bucket -> choice -> tokens/s, at the last step
        self.predicted_batch: dict[int, int] = {}  # bucket -> the batch size of that step
        self.runs: dict[int, tuple[Choice, int, int]] = {}  # bucket -> (choice, steps left, runs it may add)
        self.held: dict[int, int] = {}  # bucket -> steps its leader still runs without a decision
        self.seconds: dict[int, float] = {}  # bucket -> wall time of its steps
        self.explored_seconds: dict[int, float] = {}  # bucket -> ... of them running a choice not the leader
        self.explored_cost: dict[int, float] = {}  # bucket -> ... of those seconds lost against the leader (`loss`)
        self.switches = [0.0, 0.0]  # catch-up seconds beyond steady steps, positions caught up (decaying sums)

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

    @property
    def explore_total(self) -> int:
        """Steps that ran a choice to measure it rather than because it was predicted fastest."""
        return self.first_steps + sum(self.explored.values())

    def due(self, batch_size: int) -> bool:
        """Whether the next step at batch_size decides (reads `rooms` and `behind`), rather than
        running the leader its bucket's last decision holds."""
        return not (self.adaptive and self.held.get(self.bucket(batch_size), 0) > 0)

    def choose(self, batch_size: int, rooms: list[int] | None = None, behind: int = 0) -> Choice:
        """The choice for a decode step of batch_size requests; `rooms`: the tokens each may
        still emit, where known; `behind`: positions a draft would first catch up on, beyond a
        steady step's (their sum over the requests). Both are read only where `due`."""
        k = self.table_k(batch_size)
        if k == 0:
            return 0
        if not self.adaptive:
            return self.trees[0] if self.trees else k
        bucket = self.bucket(batch_size)
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        leader = self.leaders.get(bucket, 0)
        if not self.due(batch_size) and leader in self.candidates(k):
            self.held[bucket] -= 1
            choice = leader
        else:
            choice = self.decide(bucket, batch_size, k, rooms, behind)
        self.acceptance.tick(choice != 0)
        return choice

    def decide(self, bucket: int, batch_size: int, k: int, rooms: list[int] | None = None, behind: int = 0) -> Choice:
        choices = self.candidates(k)
        unmeasured = [c for c in choices if self.costs.count(c) < self.min_samples]
        if not unmeasured and self.costs.count_at(0, batch_size) < self.min_samples:
            unmeasured = [0]  # plain decoding, the baseline and the cheapest step, measured at every bucket
        if unmeasured:  # nothing to predict from yet: every candidate runs a few steps, once
            self.first_steps += 1
            return unmeasured[0]
        rooms = np.asarray(rooms) if rooms else None  # [B] once for every choice's tokens
        predictions = {c: self.predict(batch_size, c, rooms) for c in choices}
        self.predicted[bucket] = {c: p.rate for c, p in predictions.items()}
        self.predicted_batch[bucket] = batch_size
        switch_s = behind * self.switch_price  # a draft's catch-up first, from plain decoding
        priced = predictions
        if switch_s and rooms is not None:
            left = int(rooms.sum())
            priced = {c: self.priced(p, c, switch_s, left) for c, p in predictions.items()}
        leader = self.leaders[bucket] = self.lead(bucket, priced)
        # a draft to measure whatever the budget, at a bucket with no run yet or where a run ends
        # that may go on: one that would lead were predictions exact (`margin` faster)
        unsure, (_, left, more) = None, self.runs.get(bucket, (0, 1, 0))
        if leader == 0 and (not self.explored.get(bucket) or (left == 0 and more)):
            unsure = self.lead(bucket, priced, sure=False) or None
        probe = self.probe(bucket, leader, predictions, switch_s if leader == 0 else 0.0, unsure)
        if probe is not None:
            return self.explore(bucket, probe)
        self.held[bucket] = self.decide_every - 1
        return leader

    def explore(self, bucket: int, choice: Choice) -> Choice:
        self.explored[bucket] = self.explored.get(bucket, 0) + 1
        return choice

    def predict(self, batch_size: int, choice: Choice, rooms: np.ndarray | None = None) -> Prediction:
        seconds, seconds_error = self.costs.predict(batch_size, choice)
        tokens = self.acceptance.tokens(choice, rooms) or (1.0, 1.0)  # a choice without counts: anything from 1 token
        error = math.hypot(seconds_error / seconds, tokens[1] / tokens[0])
        return Prediction(batch_size * tokens[0] / seconds, error, seconds)

    @property
    def switch_price(self) -> float:
        """Seconds a catch-up costs per position, beyond a steady step (0 before one is measured).
        The positions count `SWITCH_PRIOR` more, at no cost: one catch-up over a few positions is
        as noisy as a step, and its noise taken as its price, times the hundreds of positions a
        later switch catches up on, priced that switch at several steps (a first catch-up over 8
        positions 0.7 ms slow kept a draft from being measured again for 1,000 steps)."""
        seconds, positions = self.switches
        return max(seconds, 0.0) / (positions + SWITCH_PRIOR) if positions else 0.0

    @staticmethod
    def priced(prediction: Prediction, choice: Choice, switch_s: float, tokens_left: int) -> Prediction:
        """A draft's rate over the `tokens_left` its requests may still emit, `switch_s` of
        catch-up first (plain decoding pays none)."""
        if choice == 0:
            return prediction
        rate = tokens_left / (tokens_left / prediction.rate + switch_s)
        return Prediction(rate, prediction.error, prediction.seconds)

    def lead(self, bucket: int, predictions: dict[Choice, Prediction], sure: bool = True) -> Choice:
        """The leader stays unless another is predicted `margin` faster and, if plain decoding
        leads, `sureness` standard errors below its prediction still faster (unless not `sure`);
        plain decoding takes over as soon as the leading draft is not predicted `keep_margin`
        faster (at most `margin`: the band between the two holds the leader). So
        speculation starts where a draft was measured to win, not where only a loose prediction
        says so (at a bucket it never ran at, predicted from others): there one run measures it
        first. Between drafts the predictions decide: a draft that then loses is measured at
        once, and plain decoding takes over."""
        rate = {c: p.rate for c, p in predictions.items()}
        leader = self.leaders.get(bucket, 0)
        keep = min(self.keep_margin, self.margin)  # the edge a leading draft keeps, never above the one it took
        if leader not in rate or (leader and (1 + keep) * rate[0] >= rate[leader]):
            leader = 0
        down = self.sureness if sure and leader == 0 else 0.0  # from plain decoding; between drafts: predicted
        drafts = [c for c, p in predictions.items() if c != 0 and p.rate * (1 - down * p.error) > rate[0]]
        fastest = max(drafts, key=rate.get, default=0)
        return fastest if fastest and rate[fastest] > (1 + self.margin) * rate[leader] else leader

    def probe(self, bucket: int, leader: Choice, predictions: dict[Choice, Prediction],
              switch_s: float = 0.0, unsure: Choice | None = None) -> Choice | None:
        """The choice to measure this step: the next step of a run under way (unless its choice
        leads now), or the first of a new run: the choice whose run is expected to save the most
        (`worth`), where it saves anything, if the run keeps exploration within its share of the
        bucket's steps and its loss within `explore_loss` of the bucket's time. The bucket's first
        run may overdraw the loss; later runs start only where their predicted loss, catch-up
        (`switch_s`) included, fits too: at batch 64 one catch-up on every request's history took
        0.86 s, a tenth of a repeat. `predictions`: per step, not priced against the tokens left.
        `unsure`: a draft predicted to lead, too loosely to (`lead`), at a bucket with no run yet,
        or predicted `margin` faster where a run ends: its run starts whatever the budget (after a
        run, `EXTEND_RUNS` times at most, so a run goes on while its draft looks faster; one that
        went on at a tie, k=1 against plain decoding on SmolLM2's random ids, spent the step share
        that a rise then waited on for 400 steps). At batch 4 a run of 3 steps verifies 12
        requests, seldom enough to show surely a rise in acceptance while plain decoding ran, and
        the next run waits on the budget (about 150 steps). In the simulated model's rise
        (`test_adaptive.py`, 40 seeds) a draft leads again after 97 steps in the median, 377 at
        most (docs/benchmarks.md). Where a draft leads and plain decoding last ran at the bucket
        `StepCosts.stale` steps ago, plain decoding runs `min_samples` steps, whatever the budget
        too (they count in it)."""
        choice, left, more = self.runs.pop(bucket, (None, 0, 0))
        if left > 0 and choice != leader and choice in predictions:
            self.runs[bucket] = (choice, left - 1, more)
            return choice
        if unsure is not None:  # whatever the budget: a draft predicted to lead, loosely
            return self.start_run(bucket, unsure, more - 1 if choice is not None else EXTEND_RUNS)
        if leader != 0 and self.costs.age(0, bucket) >= self.costs.stale:  # whatever the budget too
            return self.start_run(bucket, 0, 0, self.min_samples)  # the baseline measured again (`StepCosts`)
        budget = self.explore_share * self.steps[bucket]
        if self.explored.get(bucket, 0) + self.explore_steps > budget:
            return None
        lost, budget_s = self.explored_cost.get(bucket, 0.0), self.explore_loss * self.seconds.get(bucket, 0.0)
        if lost > budget_s:
            return None
        worth = {c: self.worth(predictions[leader], p, switch_s) for c, p in predictions.items() if c != leader}
        choice = max(worth, key=worth.get, default=None)
        if choice is None or worth[choice] <= 0:
            return None
        if lost and lost + self.run_cost(predictions[leader], predictions[choice], switch_s) > budget_s:
            return None  # the run's steps and its catch-up, predicted, would overdraw the loss budget
        return self.start_run(bucket, choice, EXTEND_RUNS)

    def start_run(self, bucket: int, choice: Choice, more: int, steps: int = 0) -> Choice:
        self.runs[bucket] = (choice, (steps or self.explore_steps) - 1, more)
        return choice

    def worth(self, leader: Prediction, other: Prediction, switch_s: float) -> float:
        """Seconds a run measuring `other` is expected to save, less what it costs. It may find
        `other` faster than the leader (its `expected_gain`, from the error of its prediction),
        which would then run for as long as one measurement informs the choice: the steps over
        which plain decoding's decay takes the acceptance counts' weight to 1/e (100). It costs
        its steps' time beyond the leader's for their tokens, and a draft's catch-up after plain
        decoding (`switch_s`). SmolLM2 at batch 24, T = 0.7: k = 1 predicted at 143 tok/s +- 33%
        against plain decoding's 237, 2 standard errors up reach the leader, but a run is
        expected to gain 0.02 s and costs 0.29 s (3 steps, a catch-up of 0.07 s): not run."""
        horizon = leader.seconds / (1 - self.acceptance.idle_decay)
        gain = horizon * other.expected_gain(leader.rate) / leader.rate
        return gain - self.run_cost(leader, other, switch_s)

    def run_cost(self, leader: Prediction, other: Prediction, switch_s: float) -> float:
        """Seconds a run of `other` is predicted to lose against the leader: its steps' time beyond
        the leader's for their tokens, and its catch-up."""
        return self.explore_steps * other.seconds * max(0.0, 1 - other.rate / leader.rate) + switch_s

    def loss(self, batch_size: int, leader: Choice, tokens_per_request: float, seconds: float) -> float:
        """Seconds a step lost against the leader: its time less the leader's, predicted, for the
        tokens it kept (none where it kept more; all of it before the leader has a step cost)."""
        predicted = self.costs.predict(batch_size, leader, peek=True)
        if predicted is None:
            return seconds
        leader_tokens, _ = self.acceptance.tokens(leader) or (1.0, 0.0)
        return max(0.0, seconds - tokens_per_request * predicted[0] / leader_tokens)

    def record(self, batch_size: int, k: Choice, tokens_per_request: float, seconds: float,
               measures: bool = True, caught_up: int = 0) -> None:
        """A step that ran choice k and kept `tokens_per_request` (drafts past a request's end are
        not kept): its time counts for the bucket's exploration budget, and where k is not the
        bucket's leader, what it lost against the leader (`loss`); where it `measures` k, it
        feeds the step costs, the acceptance and the measured rates too; where it first
        `caught_up` the draft on that many positions after plain steps, its time beyond a steady
        step's prices a switch."""
        if not self.adaptive:
            return
        bucket = self.bucket(batch_size)
        self.seconds[bucket] = self.seconds.get(bucket, 0.0) + seconds
        leader = self.leaders.get(bucket, k)
        if leader != k:
            self.explored_seconds[bucket] = self.explored_seconds.get(bucket, 0.0) + seconds
            loss = self.loss(batch_size, leader, tokens_per_request, seconds)
            self.explored_cost[bucket] = self.explored_cost.get(bucket, 0.0) + loss
        if caught_up and self.costs.count(k):
            steady, _ = self.costs.predict(batch_size, k, peek=True)
            self.switches = [0.8 * self.switches[0] + seconds - steady, 0.8 * self.switches[1] + caught_up]
        if not measures:
            return
        self.costs.add(batch_size, k, seconds)
        if k != 0:
            self.acceptance.add_step(k, tokens_per_request, batch_size)
        self.measures.setdefault((bucket, k), Measure()).add(tokens_per_request * batch_size, seconds)

    def accept(self, k: Choice, num_accepted: list[int]) -> None:
        """A chain's verify step: each request's accepted drafts (trees are measured by `record`)."""
        if self.adaptive and isinstance(k, int) and k > 0:
            self.acceptance.add_verify(k, num_accepted)

    def report(self) -> dict[int, dict]:
        """Per bucket: the leader, predicted and measured tokens/s per choice, steps and exploration.
        The predictions are the last step's, at its batch size (`predicted_batch`); the measured
        rates are means over the bucket's steps, mostly at its larger batch sizes while the batch
        stays full, so the two compare only where that batch size is near the bucket's top."""
        return {bucket: {"choice": self.leaders.get(bucket, 0), "steps": self.steps.get(bucket, 0),
                         "explored": self.explored.get(bucket, 0), "seconds": self.seconds.get(bucket, 0.0),
                         "explored_seconds": self.explored_seconds.get(bucket, 0.0),
                         "explored_cost": self.explored_cost.get(bucket, 0.0),
                         "predicted": dict(self.predicted.get(bucket, {})),
                         "predicted_batch": self.predicted_batch.get(bucket, 0),
                         "measured": {c: m.rate for (b, c), m in self.measures.items() if b == bucket}}
                for bucket in sorted(self.steps)}
