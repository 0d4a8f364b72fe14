"""The engine loop: schedule -> pack batch -> plan -> forward -> sample -> append/stop/free.

`step()` is split at the host/device seam: `prepare` (scheduling, page allocation, batch
packing, attention planning, sampling tensors: host work) and `execute` (model forward and
sampling: device work), then `postprocess` (host). On a GPU `execute` returns before the
device finishes, so the host can prepare step n+1 while step n runs; on CPU the phases run
in order and `stats` reports how the time splits.

Across ranks (expert parallelism) every rank runs this same step on its own engine. After
scheduling, the ranks agree on the step (`moespec.distributed`): the draft length, and how
many MoE-bearing forwards each must run, joining with empty ones where it has fewer. Rank 0
also places requests on the ranks and reads back their tokens (`moespec.cluster`).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moespec.batch import Batch, Span, build_batch, pack_spans
from moespec.config import EngineConfig
from moespec.detokenizer import IncrementalDetokenizer, StopChecker
from moespec.cluster import Abort, Add, Cluster
from moespec.distributed import Lockstep, StepPlan, StepReport, decide, ep_layers
from moespec.kv_cache import PageAllocator, PageKeys
from moespec.model_runner import ModelRunner
from moespec.overlap import PENDING, HostWorker, InFlight, Outcome
from moespec.models import load_model, load_tokenizer
from moespec.parallel import ep_experts_factory
from moespec.plan import resolve_kv_pages
from moespec.sampling import (Sampler, SamplerOutput, SamplingBatch, SamplingParams, compute_probs, draw_uniform,
                              exact_tokens, greedy_tokens, invert_cdf)
from moespec.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from moespec.sequence import Sequence, Status, TokenLogprob
from moespec.speculation import (DraftRows, create_speculator, select_rows, verify_greedy, verify_lossless,
                                 verify_relaxed)
from moespec.speculation.adaptive import SpeculationPolicy
from moespec.speculation.tree import (DraftTree, TreeResult, TreeShape, compact_path, page_table, path_positions,
                                      tree_mask, walk_tree)
from moespec.static_step import mark_kv_dynamic, static_spec
from moespec.structured import Grammars

logger = logging.getLogger(__name__)


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


class Engine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, ranks=None) -> None:
        """`ranks` (from distributed.join_ranks) when experts are sharded over several processes."""
        if model is None or config.cache.num_kv_pages == "auto":
            config = resolve_kv_pages(config)  # before any weight is read: fits, or a ConfigError saying why not
        self.config = config
        c = config
        if c.parallel.ep_size > 1 and ranks is None:
            raise ValueError("parallel.ep_size > 1: join the ranks first (moespec.distributed.start_engine)")
        self.ranks = ranks
        experts = {} if ranks is None else {"experts_factory": ep_experts_factory(ranks.runtime)}
        self.model = model or load_model(c.model.path, c.model.dtype, c.model.device,
                                         quantization=c.model.quantization, **experts)
        self.tokenizer = tokenizer if model is not None else load_tokenizer(c.model.tokenizer or c.model.path)
        self.vocab_size = self.model.config.vocab_size
        self.allocator = PageAllocator(c.cache.num_kv_pages, c.cache.page_size)
        self.max_model_len = self.resolve_max_model_len()
        self.runner = ModelRunner(self.model, c.cache.num_kv_pages, c.cache.page_size, c.model.attention_backend,
                                  c.model.device, static=static_spec(c, self.max_model_len),
                                  pack=c.model.pack_linears)
        self.speculator = create_speculator(c, self.model, self.runner)
        self.scheduler = Scheduler(c.scheduler, self.allocator, self.max_model_len, self.page_keys(), self.speculator)
        self.lockstep: Lockstep | None = None
        self.cluster: Cluster | None = None
        self.stopped = False  # rank 0 ended the ranks' loop
        self.last_step = time.monotonic()
        if ranks is not None:
            self.attach_ranks(ranks)
        self.policy = SpeculationPolicy(c.speculation.num_speculative_tokens, c.speculation.schedule,
                                        c.speculation.adaptive, margin=c.speculation.adaptive_margin,
                                        trees=self.speculator.trees)
        self.next_tree: TreeShape | None = None  # the tree the policy chose for the step being scheduled
        self.spec_stats = SpecStats()
        self.ran_plain = False  # plain decode steps ran since the last speculative step
        self.sampler = Sampler()
        # data-parallel ranks draw independent streams; replicated ranks must draw the same ones
        offset = ranks.ctx.ep_rank if ranks is not None and ranks.dp else 0
        self.generator = torch.Generator().manual_seed(c.model.seed + offset)
        self.eos_ids = self.resolve_eos_ids()
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)  # structured outputs
        self.sequences: dict[str, Sequence] = {}
        self.stats = StepStats()
        self.warm_up_s = 0.0  # every warm_up so far (captured steps are captured when the engine starts)
        self.ids = itertools.count()
        self.phase = "idle"  # what the current step is doing, for a watchdog that finds it stuck
        self.worker = HostWorker() if c.scheduler.overlap else None  # scheduler.overlap (moespec.overlap)
        self.in_flight: InFlight | None = None  # the prepared step that runs at the next call
        self.num_serial = 0  # queued requests whose steps cannot overlap (needs_host_token)
        if self.lockstep is not None:
            self.step()  # every rank's first agreement: rank 0 learns each rank's load before any request

    def attach_ranks(self, ranks) -> None:
        """Every forward with MoE layers (target, built-in MTP) runs on all ranks in lockstep."""
        builtin_mtp = self.speculator.mode == "mtp" and not self.config.speculation.mtp_head
        mtp_all = ep_layers(self.model.mtp) if hasattr(self.model, "mtp") else []
        target_layers = [m for m in ep_layers(self.model) if not any(m is t for t in mtp_all)]
        mtp_layers = mtp_all if builtin_mtp else []
        self.lockstep = Lockstep(ranks, target_layers, mtp_layers, self.runner.dtype, self.config.uses_fixed_exchange)
        ranks.runtime.configure(self.config.parallel, self.config.model.cuda_graph)  # engines built in turn on the same ranks may differ
        self.runner.sync = self.lockstep
        if self.runner.static is not None:
            self.runner.static.runtime = ranks.runtime
        if builtin_mtp:
            self.speculator.sync = self.lockstep
            if self.speculator.static is not None:
                self.speculator.static.runtime = ranks.runtime
        self.cluster = Cluster(ranks.channel, ranks.ctx.ep_rank, ranks.ctx.ep_size, ranks.dp,
                               keys=self.scheduler.keys)

    @property
    def mtp_in_lockstep(self) -> bool:
        """The built-in MTP layer's forwards run on every rank (its MoE layers exchange tokens)."""
        return getattr(self.speculator, "sync", None) is not None

    def stop_ranks(self) -> None:
        """Rank 0: end every rank's loop (`serve_forever` returns there)."""
        if self.cluster is not None and self.cluster.front and not self.stopped:
            self.step(stop=True)

    def close(self) -> None:
        """Rank 0: end every rank's loop (they exit); then leave the process group."""
        if self.worker is not None:
            self.worker.close()
        if self.ranks is None:
            return
        try:
            self.stop_ranks()
        finally:
            self.ranks.close()
            self.ranks = None

    def keep_alive(self) -> None:
        """Between steps of an idle server: an empty step now and then, so the other ranks, waiting
        in the next step's agreement, do not time out."""
        if self.lockstep is not None and time.monotonic() - self.last_step > self.config.parallel.timeout_s / 4:
            self.step()

    def serve_forever(self) -> None:
        """A rank other than 0: run steps (rank 0 sends the requests) until rank 0 stops."""
        logger.info("rank %d serving (attention: %s)", self.lockstep.rank, self.config.parallel.attention)
        while not self.stopped:
            self.step()

    def warm_up(self) -> float:
        """With model.compile or model.cuda_graph: compile or capture the static steps of every
        bucket now (decode, verify at each draft length, the draft model's decode, the MTP layer's
        re-run and chain steps), so no serving step stalls on a compile or a capture.
        Returns the seconds it took."""
        k = self.speculator.max_tokens
        shapes = [("decode", 1, 1)] + [("verify", 1 + j, 1 + j) for j in range(1, k + 1)]
        seconds = self.runner.warm_up(shapes) + self.speculator.warm_up()
        self.warm_up_s += seconds
        if seconds:
            logger.info("prepared the static steps in %.1f s", seconds)
        return seconds

    def page_keys(self) -> PageKeys | None:
        """Prefix-cache keys: a page's tokens, those before it and what else sets its KV."""
        c = self.config
        if not c.cache.prefix_caching:
            return None
        identity = (c.model.path, c.model.dtype, c.model.quantization, c.speculation.mode, c.draft.model,
                    c.speculation.draft_model, c.speculation.mtp_head)
        return PageKeys(c.cache.page_size, self.speculator.kv_lookahead, repr(identity))

    def resolve_max_model_len(self) -> int:
        model_max = self.model.config.max_position_embeddings
        wanted = self.config.model.max_model_len or model_max
        if wanted > model_max:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", wanted, model_max)
        capacity = self.allocator.num_pages * self.allocator.page_size
        if wanted > capacity:
            logger.warning("max_model_len %d capped to the KV cache capacity of %d tokens", wanted, capacity)
        return min(wanted, capacity)

    def resolve_eos_ids(self) -> frozenset[int]:
        ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids must be ints in [0, {self.vocab_size}), got {bad[:3]}")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        """Validate and queue a request; across ranks, place it (it starts at the next step)."""
        seq = self.new_sequence(prompt, params, request_id)
        self.sequences[seq.request_id] = seq
        if self.cluster is None:
            self.queue(seq)
        else:
            self.cluster.submit(seq, self.lockstep.latest.loads if self.lockstep.latest else None)
        return seq

    def new_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> Sequence:
        params = params or SamplingParams()
        prompt_ids = self.encode(prompt)
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room to generate within "
                             f"max_model_len {self.max_model_len}")
        request_id = request_id or f"req-{next(self.ids)}"
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already running")
        seq = Sequence(request_id, prompt_ids, params, prompt=prompt if isinstance(prompt, str) else None)
        seq.metrics.num_prompt_tokens = len(prompt_ids)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        seq.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured)
        return seq

    def abort(self, request_id: str) -> None:
        if self.cluster is not None:  # rank 0: the owning rank frees the pages when the abort applies
            if request_id not in self.sequences:  # finished already
                return
            if self.cluster.abort(request_id) is not None:
                self.sequences.pop(request_id, None)
            return
        self.abort_here(request_id)

    def abort_here(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self.scheduler.abort(request_id)
        self.finish(seq, "abort")

    def apply(self, command: Add | Abort) -> None:
        """A command from rank 0, at the step the ranks agreed on."""
        if isinstance(command, Abort):
            self.abort_here(command.request_id)
            if self.cluster is not None:
                self.cluster.forget(command.request_id)
            return
        seq = command.seq or self.new_sequence(command.prompt_ids, command.params, command.request_id)
        self.sequences[seq.request_id] = seq
        self.queue(seq)

    def queue(self, seq: Sequence) -> None:
        """Hand a request to this engine's scheduler."""
        self.scheduler.add(seq)
        self.stats.requests += 1
        self.num_serial += needs_host_token(seq)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self.in_flight is not None
                or (self.cluster is not None and self.cluster.has_unfinished()))

    def num_waiting(self) -> int:
        """Sequences waiting to be scheduled, on every rank (rank 0's latest view)."""
        if self.cluster is None or self.lockstep.latest is None:
            return len(self.scheduler.waiting) + (self.cluster.num_queued() if self.cluster else 0)
        others = sum(load.waiting for load in self.lockstep.latest.loads[1:]) if self.cluster.dp else 0
        return len(self.scheduler.waiting) + self.cluster.num_queued() + others

    def rank_loads(self) -> list | None:
        """Per-rank running, waiting and KV pages as of the last step's agreement (None: one process)."""
        if self.lockstep is None or self.lockstep.latest is None:
            return None
        return list(self.lockstep.latest.loads)

    # ------------------------------------------------------------------ one step

    def step(self, stop: bool = False) -> EngineOutputs:
        """One step; across ranks every rank calls it in lockstep (`stop`: rank 0 ends them all)."""
        try:
            outputs = self.run_step(stop)
            if self.cluster is not None:
                outputs = self.exchange_updates(outputs)
            return outputs
        finally:
            self.phase = "idle"
            self.last_step = time.monotonic()

    def run_step(self, stop: bool = False) -> EngineOutputs:
        return self.run_overlapped(stop) if self.worker is not None else self.run_serial(stop)

    def apply_commands(self) -> None:
        """Rank 0's commands (add, abort) that the last agreement counted, applied here: every rank
        applies them at the same step, before it schedules the next one."""
        if self.cluster is not None and self.lockstep.latest is not None:
            self.phase = "receive commands from rank 0"
            for command in self.cluster.take_commands(self.lockstep.latest.sent[self.cluster.rank]):
                self.apply(command)

    def begin(self, plan: StepPlan) -> None:
        """An agreed step's forwards start (on this thread)."""
        if self.lockstep is not None:
            self.lockstep.begin(plan)

    def stop_here(self, plan: StepPlan) -> EngineOutputs:
        """Rank 0 ended the ranks' loop in this agreement."""
        self.stopped = True
        if self.cluster is not None:  # commands counted but never to run: leave the channel empty
            self.cluster.take_commands(plan.sent[self.cluster.rank])
        return EngineOutputs()

    def run_serial(self, stop: bool = False) -> EngineOutputs:
        """One step, all on this thread: schedule, agree, prepare, forward, sample, postprocess."""
        self.apply_commands()
        self.phase = "schedule"
        start = time.perf_counter()
        scheduled = self.schedule()
        self.phase = "agree on the step with the other ranks"
        plan = self.agree(scheduled, stop)
        if plan.stop:
            return self.stop_here(plan)
        self.begin(plan)
        if not scheduled.chunks:
            if plan.run:
                self.join_step(plan)
            return EngineOutputs()
        prepared = self.prepare(scheduled, plan, start, tree=self.next_tree)
        if prepared.num_spec:
            return self.finish_speculative(prepared, self.speculate(prepared))
        start = time.perf_counter()
        result = self.execute(prepared)
        device_s = time.perf_counter() - start
        start = time.perf_counter()
        self.phase = "postprocess"
        outputs = self.postprocess(prepared, result)
        self.publish([c.seq for c in prepared.scheduled.chunks])
        host_s = prepared.host_s + time.perf_counter() - start
        self.record(prepared, host_s, device_s)
        if prepared.batch.mode == "decode" and self.speculator.max_tokens:  # a plain decode step, measured
            self.policy.record(len(prepared.sampled), 0, 1.0, host_s + device_s)
            self.ran_plain = True
        return outputs

    # ------------------------------------------------------------------ overlapped step

    def run_overlapped(self, stop: bool = False) -> EngineOutputs:
        """Run step n (prepared by the previous call) while a helper thread schedules, packs and
        plans step n+1; then process step n's results. A step that needs a token on the host
        runs serially, and so does rank 0's last step, which stops the ranks (moespec.overlap)."""
        start = time.perf_counter()
        self.apply_commands()
        ready, self.in_flight = self.in_flight, None
        if ready is not None:
            ready = self.settle(ready, start)
        if ready is not None and ready.plan.stop:
            return self.stop_here(ready.plan)
        if self.num_serial or stop:  # a request needs its previous token on the host
            outputs = self.run_prepared(ready, None, start) if ready is not None else EngineOutputs()
            return EngineOutputs(outputs.updated + self.run_serial(stop).updated)
        if ready is None:  # the pipeline starts: prepare a step here first
            ready = self.prepare_next(None, start)
            if ready is None:
                return EngineOutputs()
            if ready.plan.stop:
                return self.stop_here(ready.plan)
        following = self.worker.submit(self.prepare_next, ready, time.perf_counter())
        return self.run_prepared(ready, following, start)

    def settle(self, flight: InFlight, start: float) -> InFlight | None:
        """The step decided ahead, as it runs now that the step before was processed. A speculative
        step holding a request that finished (or was aborted) since, or a step that could not be
        prepared ahead, is prepared again from the host's state now: one process decides it anew
        (None), ranks run what they agreed with the others, without the requests that finished."""
        if flight.prepared is not None and not (flight.speculative and any(s.is_finished for s in flight.requests)):
            return flight
        if flight.plan.stop or not flight.requests:  # the ranks stop, or this rank joins the others
            return flight
        if self.lockstep is None:
            return None
        self.stats.prepared_again += 1
        chunks = [ScheduledChunk(seq, seq.num_computed, 1) for seq in flight.requests if not seq.is_finished]
        if not chunks:
            return InFlight(flight.plan, None)
        # pages are there: reserved for the step before's longest outcome and this one's lookahead
        tree = flight.prepared.tree if flight.prepared is not None else None
        prepared = self.prepare(SchedulerOutput(chunks, []), flight.plan, start, tree=tree)
        return self.advance(prepared, None, start)

    def run_prepared(self, flight: InFlight, following, start: float) -> EngineOutputs:
        """Step n's device side on this thread (step n-1's outcome put in place first), then, once
        the helper has prepared step n+1 (`following`), n's results processed. Across ranks a
        step with no requests here joins the others' forwards."""
        prepared = flight.prepared
        self.begin(flight.plan)
        device_start = time.perf_counter()
        try:
            if flight.rows is not None:
                self.place_previous(flight)
            if prepared is None:
                self.join_step(flight.plan)
                result = outcome = None
            elif prepared.num_spec:
                result = self.speculate(prepared)
                outcome = result.outcome
            else:
                result = self.execute(prepared, flight.observed)
                outcome = Outcome(result.tokens[:, None])
        finally:
            flight.observed.set()  # the helper never waits on a step that failed
        device_s = time.perf_counter() - device_start
        if following is not None:
            self.phase = "wait for the next step's preparation"
            self.in_flight = following.result()
            if self.in_flight is not None:
                self.in_flight.previous = outcome
                self.stats.ahead_steps += 1
                self.stats.shifted_steps += self.in_flight.ahead
        if prepared is None:
            outputs = EngineOutputs()
        elif prepared.num_spec:
            outputs = self.finish_speculative(prepared, result, start)
        else:
            outputs = self.process(flight, result, device_s, start)
        if self.in_flight is not None and self.in_flight.prepared is not None:
            self.publish([c.seq for c in self.in_flight.prepared.scheduled.chunks])  # their tokens are known now
        return outputs

    def prepare_next(self, previous: InFlight | None, start: float) -> InFlight | None:
        """Schedule, agree (across ranks), pack and plan a step, and advance the host's view of a
        plain step's requests: KV computed through their chunks, one placeholder token per sampled
        request. Runs on the helper thread while `previous` computes. After a speculative step
        only another one is prepared, for that step's longest outcome (moespec.overlap). None:
        nothing to run, or nothing that can be decided before `previous` has run (then no
        agreement was made either)."""
        self.phase = "schedule"
        if previous is not None and previous.prepared is None:
            previous = None  # it joined the others' forwards: nothing of this rank's in flight
        extra = previous.widths() if previous is not None and previous.speculative else {}
        if extra:
            scheduled = self.scheduler.schedule_ahead(extra, self.speculator.lookahead)
        else:  # a preemption would release draft state the step in flight uses
            scheduled = self.schedule(can_preempt=previous is None or not self.speculator.max_tokens)
        if scheduled is None or (not scheduled.chunks and self.lockstep is None):
            return None
        if previous is not None and not extra and self.mtp_in_lockstep:
            self.phase = "wait for the step before's target forward"
            previous.observed.wait()  # its MTP bookkeeping (held hidden states) decides this report
        self.phase = "agree on the step with the other ranks"
        plan = self.agree(scheduled, False, extra)
        if plan.stop:
            return InFlight(plan, None)
        if not scheduled.chunks:  # the others run a step: join it, or nothing runs anywhere
            return InFlight(plan, None) if plan.run else None
        if extra and not plan.ks[self.lockstep.rank if self.lockstep else 0]:
            # a plain step needs the last token on the host: prepared once the step before is processed
            return InFlight(plan, None, scheduled=scheduled) if self.lockstep is not None else None
        prepared = self.prepare(scheduled, plan, start, extra, self.next_tree)
        return self.advance(prepared, previous, start, ahead=bool(extra))

    def advance(self, prepared: PreparedStep, previous: InFlight | None, start: float,
                ahead: bool = False) -> InFlight:
        """A prepared step in flight. A plain step advances its requests' host state now (KV
        computed through their chunks, a placeholder per sampled token); a speculative step's
        requests change when it is processed (moespec.overlap)."""
        rows, sources = self.pending_rows(prepared, previous)
        if prepared.num_spec:
            prepared.host_s = time.perf_counter() - start
            return InFlight(prepared.plan, prepared, [], rows, sources, ahead=ahead)
        for chunk in prepared.scheduled.chunks:
            chunk.seq.num_computed = chunk.end
        pending_at = []
        for seq in prepared.sampled:
            pending_at.append(len(seq.output_ids))
            seq.output_ids.append(PENDING)
        prepared.host_s = time.perf_counter() - start
        return InFlight(prepared.plan, prepared, pending_at, rows, sources)

    def pending_rows(self, prepared: PreparedStep, previous: InFlight | None):
        """Rows of this batch whose token the previous step samples, and those requests' rows in
        its outcome (on the device; None when there are none). A chain's verify batch: each such
        request's first row; a tree builds its batch when it runs, from the host's state then."""
        if previous is None or prepared.tree is not None:
            return None, None
        source_of = {id(seq): row for row, seq in enumerate(previous.prepared.sampled)}
        rows, sources = [], []
        if prepared.num_spec:
            Q = 1 + prepared.num_spec
            for b, seq in enumerate(prepared.sampled):
                if id(seq) in source_of:
                    rows.append(b * Q)
                    sources.append(source_of[id(seq)])
        else:
            end = 0
            for chunk in prepared.scheduled.chunks:
                end += chunk.num_tokens
                seq = chunk.seq
                if chunk.end == seq.num_tokens and seq.output_ids and seq.output_ids[-1] == PENDING:
                    rows.append(end - 1)
                    sources.append(source_of[id(seq)])
        if not rows:
            return None, None
        device = self.runner.device
        return torch.tensor(rows).to(device, non_blocking=True), torch.tensor(sources).to(device, non_blocking=True)

    def place_previous(self, flight: InFlight) -> None:
        """Step n's outcome into step n+1's batch, on the device: each request's new last token,
        and a verify batch planned for n's longest outcome shifted back to the actual one."""
        prepared, outcome = flight.prepared, flight.previous
        prepared.batch.input_ids[flight.rows] = outcome.last_tokens(flight.sources)
        if flight.ahead:  # every request of the batch was in step n, in batch order
            self.shift_verify(prepared, -outcome.shortfall(flight.sources))

    def shift_verify(self, prepared: PreparedStep, delta: torch.Tensor) -> None:
        """Move each request's 1 + k verify rows delta [B] (<= 0) positions, on the device: the
        rotary positions, and the planned KV slots and causal mask (a static step's padded plan,
        whose padding requests stay)."""
        B, Q = len(prepared.sampled), 1 + prepared.num_spec
        batch, ctx = prepared.batch, prepared.ctx
        batch.positions = (batch.positions.view(B, Q) + delta[:, None]).flatten()  # not in place: the plan views it
        if ctx.static is None:
            ctx.backend.shift(delta)
            for half in ctx.halves or ():  # two-batch overlap: each half's own plan too
                half.backend.shift(delta[half.requests])
            return
        static = ctx.static
        static.batch.positions = torch.cat([batch.positions, static.batch.positions[B * Q:]])
        pads = len(static.batch.qo_bounds) - 1 - B
        static.ctx.backend.shift(torch.cat([delta, delta.new_zeros(pads)]))
        mark_kv_dynamic(static.ctx.backend)  # the shifted mask is a new tensor: its KV length stays dynamic

    def process(self, flight: InFlight, result: SamplerOutput, device_s: float, call_start: float) -> EngineOutputs:
        """Put a plain step's tokens where their placeholders are; a request that finished or was
        aborted since drops its token."""
        start = time.perf_counter()
        self.phase = "postprocess"
        tokens = result.tokens.tolist()
        updated = []
        for row, (seq, at) in enumerate(zip(flight.prepared.sampled, flight.pending_at)):
            if seq.is_finished:
                continue
            later = len(seq.output_ids) - at - 1  # placeholders of steps prepared after this one
            del seq.output_ids[at:]
            self.append_tokens(seq, [tokens[row]], [result.logprobs[row]])
            if not seq.is_finished:
                seq.output_ids += [PENDING] * later
            updated.append(seq)
        host_s = flight.prepared.host_s + time.perf_counter() - start
        wall_s = time.perf_counter() - call_start
        self.record(flight.prepared, host_s, device_s, wall_s)
        if flight.prepared.batch.mode == "decode" and self.speculator.max_tokens:  # a plain decode step, measured
            self.policy.record(len(flight.prepared.sampled), 0, 1.0, wall_s)
            self.ran_plain = True
        return EngineOutputs(updated)

    # ------------------------------------------------------------------ scheduling

    def schedule(self, can_preempt: bool = True) -> SchedulerOutput | None:
        """None only where `can_preempt` is False and a preemption would be needed."""
        scheduled = self.scheduler.schedule(self.speculator.lookahead, can_preempt)
        if scheduled is None:
            return None
        for seq in scheduled.preempted:
            self.speculator.release(seq)
        for seq, num_tokens in scheduled.hits:
            self.speculator.start_at(seq, num_tokens)
        if not scheduled.chunks and self.scheduler.has_unfinished() and not self.scheduler.running:
            raise RuntimeError("no request fits in the KV cache; raise cache.num_kv_pages")
        if self.cluster is not None and self.cluster.front:
            self.cluster.local_unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
        return scheduled

    def agree(self, scheduled: SchedulerOutput, stop: bool, extra: dict[int, int] | None = None) -> StepPlan:
        """This step as every rank will run it (one process: decided from its own report alone).
        `extra`: tokens a step in flight may still add to a request (by id; overlap)."""
        report = self.report(scheduled, stop, extra)
        if self.lockstep is None:
            return decide([report])
        sent = tuple(self.cluster.sent) if self.cluster.front else ()
        plan = self.lockstep.agree(report, sent)
        self.cluster.agreed(plan.sent)
        return plan

    def report(self, scheduled: SchedulerOutput, stop: bool, extra: dict[int, int] | None = None) -> StepReport:
        """Speculate only on decode-only batches, as many tokens as the policy says and the
        longest request still has room for; say which MTP forwards the step needs here.
        `extra`: tokens a step in flight may still add to a request (by id; overlap)."""
        chunks, spec = scheduled.chunks, self.speculator
        k_wish, room, lags = -1, 0, False
        # MTP forwards across ranks; after a verify step (extra) the MTP re-run has left every
        # request caught up with no hidden states held (and its state is being written meanwhile)
        synced_mtp = self.mtp_in_lockstep and not extra
        self.next_tree = None
        if chunks and spec.max_tokens and scheduled.is_decode_only:
            lengths = [c.seq.num_tokens + (extra or {}).get(id(c.seq), 0) for c in chunks]
            k_wish = self.fit_choice(self.policy.choose(len(chunks)), lengths)
            room = min(self.max_model_len - n for n in lengths) - 1
            lags = synced_mtp and spec.needs_catch_up([c.seq for c in chunks])
        flush = synced_mtp and bool(chunks) and spec.needs_flush(chunks)
        a, B, T = self.allocator, len(chunks), sum(c.num_tokens for c in chunks)
        # bounds on this step's MoE-bearing forwards: the verify (and its MTP re-run), and an MTP
        # catch-up or flush over at most 1 + K held hidden states and the new one per request
        moe_tokens = max(T, B * (1 + max(k_wish, 0)), B * (2 + spec.max_tokens) if lags or flush else 0,
                         B * self.next_tree.tokens_per_request if self.next_tree else 0)
        return StepReport(int(stop), int(bool(chunks)), k_wish, room, int(lags), int(flush),
                          int(scheduled.is_decode_only or not chunks), T,
                          len(self.scheduler.running), len(self.scheduler.waiting), a.num_free, a.num_pages,
                          moe_tokens)

    def fit_choice(self, choice: int | TreeShape, lengths: list[int]) -> int:
        """The draft length to report for the policy's choice, for requests of these lengths. A
        tree reports its depth (its MTP forwards are a chain's of that length) and is kept for
        `prepare` when it fits every request (room for its slots); otherwise, or where the ranks
        agree on a shorter draft, a chain runs instead."""
        if not isinstance(choice, TreeShape):
            return choice
        if min(self.max_model_len - n for n in lengths) >= choice.lookahead - 1:
            self.next_tree = choice
        return choice.depth

    def join_step(self, plan: StepPlan) -> None:
        """Nothing scheduled here while other ranks run: join their MoE-bearing forwards empty."""
        self.phase = "join the other ranks' forwards (no work here)"
        self.lockstep.pad_mtp(plan.mtp_before)
        self.lockstep.join_target()
        self.lockstep.pad_mtp(plan.mtp_before + plan.mtp_after)

    def prepare(self, scheduled: SchedulerOutput, plan: StepPlan, start: float,
                extra: dict[int, int] | None = None, tree: TreeShape | None = None) -> PreparedStep:
        """`extra`: tokens a step in flight may still add to a request (by id): a verify batch is
        packed and planned for the most, and shifted back on the device later (overlap). `tree`:
        the draft tree the policy chose when the step was reported (`fit_choice`), if any."""
        for chunk in scheduled.chunks:
            if chunk.seq.metrics.first_scheduled_time is None:
                chunk.seq.metrics.first_scheduled_time = time.monotonic()
        sampled = [c.seq for c in scheduled.chunks if c.completes_prompt]
        num_spec = plan.ks[self.lockstep.rank if self.lockstep else 0]
        if num_spec:
            tree = tree if tree is not None and num_spec == tree.depth else None
            batch = ctx = None
            if tree is None:  # a tree's batch needs its shape, known once drafted
                batch = self.build_verify_batch(sampled, num_spec, extra)
                ctx = self.runner.plan(batch)
            return PreparedStep(scheduled, batch, None, sampled, ctx, time.perf_counter() - start, num_spec, plan, tree)
        batch = build_batch(scheduled.chunks, self.allocator.page_size, scheduled.mode)
        sampling = self.build_sampling(sampled)
        batch = batch.to(self.runner.device)
        ctx = self.runner.plan(batch)
        return PreparedStep(scheduled, batch, sampling, sampled, ctx, time.perf_counter() - start, 0, plan)

    def exchange_updates(self, outputs: EngineOutputs) -> EngineOutputs:
        """Other ranks send their requests' new output to rank 0; rank 0 adds what has arrived."""
        if not self.cluster.front:
            self.cluster.send_updates(outputs.updated)
            return outputs
        changed, (steps, drafted, accepted) = self.cluster.receive_updates()
        self.spec_stats.steps += steps  # the other ranks' speculation counts too (not per position)
        self.spec_stats.draft_tokens += drafted
        self.spec_stats.accepted_tokens += accepted
        for seq in changed:
            if seq.is_finished:
                self.sequences.pop(seq.request_id, None)
        return EngineOutputs(outputs.updated + changed)

    def build_sampling(self, seqs: list[Sequence]) -> SamplingBatch:
        device = self.runner.device
        batch = SamplingBatch.build([s.params for s in seqs], [s.prompt_ids for s in seqs],
                                    [s.output_ids for s in seqs], self.vocab_size, device,
                                    eos_token_ids=tuple(self.eos_ids), shared_generator=self.generator,
                                    counts=[s.counts_for(self.vocab_size, device) for s in seqs])
        states = [s.grammar for s in seqs]
        return batch.constrained(self.grammars.masks(states), self.vocab_size) if any(states) else batch

    def execute(self, prepared: PreparedStep, observed: threading.Event | None = None) -> SamplerOutput:
        """A plain step's device side: the target forward (an MTP flush may follow), sampling.
        Across ranks it joins the others' MTP forwards before and after its own. `observed`: set
        once the speculator has seen the target forward (overlap)."""
        plan = prepared.plan
        if self.lockstep is not None:
            self.lockstep.pad_mtp(plan.mtp_before)
        self.phase = f"target forward ({prepared.batch.mode})"
        hidden, logits = self.runner.forward(prepared.batch, prepared.ctx)
        self.speculator.observe(prepared.scheduled.chunks, prepared.batch, hidden)
        if observed is not None:
            observed.set()
        if self.lockstep is not None:
            self.lockstep.pad_mtp(plan.mtp_before + plan.mtp_after)
        self.phase = "sampling"
        return self.sampler(logits, prepared.sampling)

    # ------------------------------------------------------------------ speculative step

    def speculate(self, prepared: PreparedStep) -> Verified:
        """The device side of a speculative step (a tree's: `grow`)."""
        start = time.perf_counter()
        verified = self.grow(prepared) if prepared.tree is not None else self.draft_and_verify(prepared)
        verified.device_s = time.perf_counter() - start
        return verified

    def finish_speculative(self, prepared: PreparedStep, verified: Verified, call_start: float | None = None
                           ) -> EngineOutputs:
        """The host side of a speculative step, then its times (`call_start`: under overlap, the
        engine call's start; its wall time is less than host + device by the host work hidden)."""
        start = time.perf_counter()
        outputs = verified.finish()
        host_s = prepared.host_s + time.perf_counter() - start
        s = self.stats
        s.spec_steps += 1
        s.spec_host_s += host_s
        s.spec_device_s += verified.device_s
        s.spec_wall_s += host_s + verified.device_s if call_start is None else time.perf_counter() - call_start
        return outputs

    def draft_and_verify(self, prepared: PreparedStep) -> Verified:
        """propose k -> target verifies 1+k per request -> accept (tensors); the host appends in
        `finish`."""
        start = time.perf_counter()
        seqs, k, batch, ctx = prepared.sampled, prepared.num_spec, prepared.batch, prepared.ctx
        rows = DraftRows(seqs, self.vocab_size, self.runner.device, tuple(self.eos_ids), self.generator, self.grammars)
        self.phase = f"{self.speculator.mode} propose"
        proposal = self.speculator.propose(seqs, k, rows)
        plan = prepared.plan
        if self.lockstep is not None:
            self.lockstep.pad_mtp(plan.mtp_before)
        self.place_drafts(batch, proposal.tokens)
        self.phase = "target forward (verify)"
        hidden, logits = self.runner.forward(batch, ctx)  # logits [B*(k+1), V]
        self.speculator.observe(prepared.scheduled.chunks, batch, hidden)
        self.phase = "verification"
        target_rows = rows.target_batch(proposal.tokens)  # the last grammar row is filled after the forward is launched
        result = self.verify(logits, target_rows, proposal, self.draw_verify_uniforms(seqs, rows, k))
        self.phase = f"{self.speculator.mode} accept"
        self.speculator.accept(seqs, batch, ctx, hidden, result.num_accepted, result.tokens)
        if self.lockstep is not None:
            self.lockstep.pad_mtp(plan.mtp_before + plan.mtp_after)

        def finish() -> EngineOutputs:
            # the host reads accepted lengths only now, after the draft re-run was launched
            num_accepted, tokens = result.num_accepted.tolist(), result.tokens.tolist()
            self.phase = "postprocess"
            logprobs = self.sampler.gather_logprobs(logits, result.tokens.flatten(), target_rows)
            lengths = [s.num_tokens for s in seqs]
            self.speculator.commit(seqs, lengths, num_accepted, k)
            self.spec_stats.add(k, num_accepted)
            self.emit(prepared, num_accepted, tokens, logprobs, lengths, k, k, proposal.steady, start)
            return EngineOutputs(list(seqs))

        return Verified(Outcome(result.tokens, result.num_accepted), finish)

    def emit(self, prepared: PreparedStep, num_accepted: list[int], tokens: list[list[int]], logprobs: list,
             lengths: list[int], drafted: int, choice: int | TreeShape, steady: bool, start: float) -> None:
        """Host side of a speculative step: per request its a accepted drafts and the target's
        token (tokens and logprobs in rows of len(tokens[b])), then the step's measurements."""
        seqs = prepared.sampled
        for b, (seq, a, m) in enumerate(zip(seqs, num_accepted, lengths)):
            seq.num_computed = m + a  # KV now holds the last token and the a accepted drafts
            seq.metrics.num_draft_tokens += drafted
            seq.metrics.num_accepted_tokens += a
            seq.metrics.num_spec_steps += 1
            width = len(tokens[b])
            self.append_tokens(seq, tokens[b][: a + 1], logprobs[b * width: b * width + a + 1])
        self.publish(seqs)
        elapsed = time.perf_counter() - start + prepared.host_s
        self.stats.steps += 1
        self.stats.tokens += sum(num_accepted) + len(seqs)
        self.policy.accept(choice, num_accepted)
        # a catch-up on tokens of plain decode steps measures switching, not speculating (adaptive.py)
        if steady or not self.ran_plain:
            self.policy.record(len(seqs), choice, (sum(num_accepted) + len(seqs)) / len(seqs), elapsed)
        self.ran_plain = False

    # ------------------------------------------------------------------ draft tree step

    def grow(self, prepared: PreparedStep) -> Verified:
        """propose a tree -> the target verifies its 1+N nodes per request in one forward (tree
        mask) -> walk the target's draws down the tree -> the drafter's and the target's KV of
        the accepted path compacted -> the path accepted as a chain (MTP re-run); the host
        appends in `finish`."""
        start = time.perf_counter()
        seqs, shape = prepared.sampled, prepared.tree
        rows = DraftRows(seqs, self.vocab_size, self.runner.device, tuple(self.eos_ids), self.generator, self.grammars)
        self.phase = f"{self.speculator.mode} propose tree"
        tree = self.speculator.propose_tree(seqs, shape, rows)
        if self.lockstep is not None:
            self.lockstep.pad_mtp(prepared.plan.mtp_before)
        batch = self.build_tree_batch(seqs, tree)
        ctx = self.runner.plan(batch)
        self.phase = "target forward (tree verify)"
        hidden, logits = self.runner.forward(batch, ctx)  # logits [B*(1+N), V]
        self.phase = "verification"
        target_rows = rows.tree_batch(tree)
        uniforms = self.draw_verify_uniforms(seqs, rows, shape.depth)  # [B, D+1] one per depth
        result = walk_tree(self.tree_draws(logits, target_rows, tree, uniforms), tree)
        self.phase = f"{self.speculator.mode} accept tree"
        self.accept_path(seqs, batch, hidden, tree, result)
        if self.lockstep is not None:
            self.lockstep.pad_mtp(prepared.plan.mtp_before + prepared.plan.mtp_after)

        def finish() -> EngineOutputs:
            num_accepted, tokens = result.num_accepted.tolist(), result.tokens.tolist()
            self.phase = "postprocess"
            B, N1 = tree.tokens.shape[0], tree.tokens.shape[1] + 1
            path_rows = (torch.arange(B, device=logits.device)[:, None] * N1 + result.path).flatten()  # [B*(D+1)]
            num_logprobs = [n for n in target_rows.num_logprobs[::N1] for _ in range(shape.depth + 1)]
            logprobs = self.sampler.gather_logprobs_for(logits[path_rows], result.tokens.flatten(), num_logprobs)
            lengths = [s.num_tokens for s in seqs]
            self.speculator.commit_tree(seqs, lengths, num_accepted, tree)
            self.spec_stats.add(shape.depth, num_accepted, shape)
            self.emit(prepared, num_accepted, tokens, logprobs, lengths, shape.num_draft_tokens, shape, tree.steady,
                      start)
            return EngineOutputs(list(seqs))

        return Verified(Outcome(result.tokens, result.num_accepted), finish)

    def accept_path(self, seqs: list[Sequence], batch: Batch, hidden: torch.Tensor, tree: DraftTree,
                    result: TreeResult) -> None:
        """Move the accepted path's KV to consecutive positions (the drafter's, then the
        target's); from then on the path is a chain's verify batch of depth D, which the
        speculator accepts as one (the MTP re-run, over the target's hidden states along it)."""
        self.speculator.accept_tree(seqs, batch, tree, result)
        compact_path(self.runner.cache.layers, page_table(seqs, batch.input_ids.device), self.allocator.page_size,
                     *path_positions(batch, result))
        path = self.build_verify_batch(seqs, tree.depth)
        self.place_drafts(path, result.tokens[:, :-1])
        M = hidden.shape[-1]
        path_hidden = hidden.view(len(seqs), -1, M).gather(1, result.path[:, :, None].expand(-1, -1, M))  # [B, D+1, M]
        self.speculator.accept(seqs, path, self.runner.plan(path), path_hidden.flatten(0, 1), result.num_accepted,
                               result.tokens)

    def build_tree_batch(self, seqs: list[Sequence], tree: DraftTree) -> Batch:
        """Per request: its last token and the tree's N nodes, node i at KV position m-1+i and
        rotary position m-1+depth(i), seeing the context and its ancestors (tree.tree_mask)."""
        N = tree.tokens.shape[1]
        spans = [Span(s.pages, s.num_tokens - 1, [s.output_ids[-1]] + [0] * N) for s in seqs]
        batch = pack_spans(spans, self.allocator.page_size, "verify").to(self.runner.device)
        root = batch.input_ids.view(len(seqs), N + 1)[:, :1]
        batch.input_ids = torch.cat([root, tree.tokens.to(root.device)], 1).flatten()
        batch.kv_positions = batch.positions
        batch.positions = (batch.positions.view(len(seqs), N + 1)[:, :1] + tree.node_depths().to(root.device)).flatten()
        batch.custom_mask = tree_mask([s.num_tokens - 1 for s in seqs], tree.ancestors())
        return batch

    @staticmethod
    def tree_draws(logits: torch.Tensor, target_rows: SamplingBatch, tree: DraftTree,
                   uniforms: torch.Tensor) -> torch.Tensor:
        """The target's own draw at every node [B, 1+N]: greedy and seeded rows their exact draws,
        random rows an inverse-CDF draw with their request's uniform of the node's depth."""
        B, N1 = tree.tokens.shape[0], tree.tokens.shape[1] + 1
        if target_rows.all_greedy:
            return greedy_tokens(logits, target_rows).view(B, N1)
        probs = compute_probs(logits, target_rows)
        draws = exact_tokens(probs, target_rows)
        if target_rows.random_rows:
            random = invert_cdf(probs, uniforms.gather(1, tree.node_depths().to(uniforms.device)).flatten())
            is_random = torch.zeros(B * N1, dtype=torch.bool)
            is_random[list(target_rows.random_rows)] = True
            draws = torch.where(is_random.to(draws.device), random, draws)
        return draws.view(B, N1)

    @staticmethod
    def draw_verify_uniforms(seqs: list[Sequence], rows: DraftRows, k: int) -> torch.Tensor:
        """[B, k+1] uniforms for acceptance tests and the final token of random rows (rejection
        sampling); greedy and seeded rows are verified by their exact draws and need none."""
        if all(s.params.greedy or s.params.seed is not None for s in seqs):
            return torch.zeros(len(seqs), k + 1, dtype=torch.float64, device=rows.device)
        return draw_uniform(rows.batch([]), k + 1)

    def build_verify_batch(self, seqs: list[Sequence], k: int, extra: dict[int, int] | None = None) -> Batch:
        """Per request: its last token and k draft rows (`place_drafts`) at positions m-1 .. m-1+k.
        `extra`: tokens a step in flight may still add to a request (by id): planned for the most."""
        extra = extra or {}
        spans = [Span(s.pages, s.num_tokens - 1 + extra.get(id(s), 0), [s.output_ids[-1]] + [0] * k) for s in seqs]
        return pack_spans(spans, self.allocator.page_size, "verify").to(self.runner.device)

    @staticmethod
    def place_drafts(batch: Batch, drafts: torch.Tensor) -> None:
        """Drafts [B, K] into a verify batch's rows after each request's last token (on the device)."""
        B, K = drafts.shape
        batch.input_ids.view(B, K + 1)[:, 1:] = drafts.to(batch.input_ids.device)

    def verify(self, logits: torch.Tensor, target_rows: SamplingBatch, proposal, uniforms: torch.Tensor):
        """Greedy and seeded rows: the drafts that equal the target's own exact draws (argmax,
        keyed Gumbel-max), then the target's draw; other rows: rejection sampling."""
        B, k = proposal.tokens.shape
        spec = self.config.speculation
        if target_rows.all_greedy and spec.acceptance == "lossless":
            return verify_greedy(greedy_tokens(logits, target_rows).view(B, k + 1), proposal.tokens)
        probs = compute_probs(logits, target_rows)  # [B*(k+1), V]
        if spec.acceptance == "relaxed":
            return verify_relaxed(logits.view(B, k + 1, -1), probs.view(B, k + 1, -1), proposal.probs,
                                  proposal.tokens, uniforms, spec.relaxed_top_n, spec.relaxed_delta)
        random_rows = target_rows.random_rows  # all k + 1 rows of each random request
        if len(random_rows) == B * (k + 1):  # no greedy or seeded request
            return verify_lossless(probs.view(B, k + 1, -1), proposal.probs, proposal.tokens, uniforms)
        exact = verify_greedy(exact_tokens(probs, target_rows).view(B, k + 1), proposal.tokens)
        if not random_rows:
            return exact
        is_random = torch.zeros(B, dtype=torch.bool)
        is_random[[row // (k + 1) for row in random_rows]] = True
        sampled = verify_lossless(probs.view(B, k + 1, -1), proposal.probs, proposal.tokens, uniforms)
        return select_rows(is_random.to(probs.device), sampled, exact)

    def postprocess(self, prepared: PreparedStep, result: SamplerOutput) -> EngineOutputs:
        for chunk in prepared.scheduled.chunks:
            chunk.seq.num_computed = chunk.end
        tokens = result.tokens.tolist()
        updated = []
        for row, seq in enumerate(prepared.sampled):
            lp = result.logprobs[row]
            self.append_tokens(seq, [tokens[row]], [lp])
            updated.append(seq)
        return EngineOutputs(updated)

    def publish(self, seqs: list[Sequence]) -> None:
        """Cache the pages these requests have now computed (finished ones did as they ended)."""
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.publish(seq)

    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """Append tokens one by one, stopping exactly at EOS, stop ids, stop strings or limits."""
        now = time.monotonic()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        for token, lp in zip(tokens, logprobs):
            if seq.grammar is not None and not seq.grammar.accept(token):
                logger.warning("request %s: its grammar allows no token after %d output tokens; ending it",
                               seq.request_id, len(seq.output_ids))
                self.finish(seq, "abort")
                return
            seq.output_ids.append(token)
            seq.metrics.num_generated_tokens += 1
            if lp is not None:
                seq.logprobs.append(TokenLogprob(token, lp.logprob, dict(zip(lp.top_ids, lp.top_logprobs))))
            seq.detokenizer.append([token])
            reason = self.check_stop(seq, token)
            if reason is not None:
                if not isinstance(seq.stop_reason, str):  # not cut at a stop string: all text is final
                    seq.detokenizer.flush()
                    seq.text = seq.detokenizer.text
                self.finish(seq, reason)
                return

    def check_stop(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        check = seq.stop_checker.check(seq.detokenizer.text)
        seq.text = check.text
        seq.streamable_chars = check.stream_len
        if len(seq.output_ids) >= params.min_tokens:
            if token in self.eos_ids and not params.ignore_eos:
                return "stop"
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if check.stopped:
                seq.stop_reason = seq.stop_checker.find_first(seq.detokenizer.text, 0)[1]
                return "stop"
        if seq.grammar is not None and seq.grammar.terminated:  # it accepted EOS, with ignore_eos too
            return "stop"
        if params.max_tokens is not None and len(seq.output_ids) >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        while seq.output_ids and seq.output_ids[-1] == PENDING:  # overlap: steps still in flight
            seq.output_ids.pop()
        self.num_serial -= needs_host_token(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.monotonic()
        seq.streamable_chars = len(seq.text)  # a finished request's text is final
        self.scheduler.finish(seq)  # publishes its pages first: the speculator's state says which are ready
        self.speculator.release(seq)
        self.sequences.pop(seq.request_id, None)

    def record(self, prepared: PreparedStep, host_s: float, device_s: float, wall_s: float | None = None) -> None:
        """`wall_s`: the step's share of wall time (serial: host + device)."""
        s = self.stats
        s.steps += 1
        s.host_s += host_s
        s.device_s += device_s
        s.tokens += len(prepared.sampled)
        if prepared.batch.mode == "decode":
            s.decode_steps += 1
            s.decode_host_s += host_s
            s.decode_device_s += device_s
            s.decode_wall_s += host_s + device_s if wall_s is None else wall_s
