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

The engine is the façade `LLM`, the server and the ranks use, and the plain step pipeline
(schedule -> agree -> prepare -> execute -> postprocess). Its rooms, each owning its part:
  moespec.requests       Requests: the requests this rank holds, adding, aborting, appending
                         tokens with the stop checks, finishing
  moespec.verification   SpeculativeSteps: a speculative step's drafting, verification and
                         emission (chains and trees), and the speculation figures
  moespec.overlap_driver OverlapDriver: steps run while the next one is prepared
  moespec.step_state     the records a step carries and the engine's measurements
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from moespec.batch import build_batch
from moespec.cluster import Cluster
from moespec.config import EngineConfig, SpeculationSection, TreeShape
from moespec.distributed import Lockstep, StepPlan, StepReport, build_balancer, decide, ep_layers
from moespec.kv_cache import PageAllocator, PageKeys
from moespec.model_runner import ModelRunner
from moespec.models import load_model, load_tokenizer
from moespec.overlap import InFlight
from moespec.overlap_driver import OverlapDriver
from moespec.parallel import ep_experts_factory
from moespec.plan import resolve_kv_pages
from moespec.prompt_logprobs import record_prompt_logprobs
from moespec.requests import Requests
from moespec.sampling import Sampler, SamplerOutput, SamplingBatch, SamplingParams
from moespec.scheduler import Scheduler, SchedulerOutput
from moespec.sequence import Sequence
from moespec.speculation import create_speculator
from moespec.speculation.adaptive import SpeculationPolicy
from moespec.static_step import static_spec
from moespec.step_state import EngineOutputs, PreparedStep, SpecStats, StepProgress, StepStats
from moespec.structured import Grammars
from moespec.verification import SpeculativeSteps

logger = logging.getLogger(__name__)


def page_keys(config: EngineConfig, speculator) -> PageKeys | None:
    """Prefix-cache keys: a page's tokens, those before it and what else sets its KV."""
    c = config
    if not c.cache.prefix_caching:
        return None
    identity = (c.model.path, c.model.dtype, c.model.quantization, c.speculation.mode, c.draft.model,
                c.speculation.draft_model, c.speculation.mtp_head)
    return PageKeys(c.cache.page_size, speculator.kv_lookahead, repr(identity))


def resolve_max_model_len(config: EngineConfig, model, allocator: PageAllocator) -> int:
    model_max = model.config.max_position_embeddings
    wanted = config.model.max_model_len or model_max
    if wanted > model_max:
        logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", wanted, model_max)
    capacity = allocator.num_pages * allocator.page_size
    if wanted > capacity:
        logger.warning("max_model_len %d capped to the KV cache capacity of %d tokens", wanted, capacity)
    return min(wanted, capacity)


def resolve_eos_ids(model, tokenizer) -> frozenset[int]:
    ids = set(model.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def policy_for(spec: SpeculationSection, trees: tuple) -> SpeculationPolicy:
    """The speculation section's policy (speculation.adaptive, .schedule, .adaptive_margin, ...)."""
    return SpeculationPolicy(spec.num_speculative_tokens, spec.schedule, spec.adaptive, margin=spec.adaptive_margin,
                             trees=trees, sureness=spec.adaptive_sureness, decide_every=spec.adaptive_decide_every,
                             keep_margin=spec.adaptive_keep_margin, shift_sigmas=spec.adaptive_shift_sigmas,
                             explore_share=spec.adaptive_explore_share, explore_loss=spec.adaptive_explore_loss)


def rooms_left(chunks: list, lengths: list[int], max_model_len: int) -> list[int]:
    """Tokens each request of a decode step may still emit (its max_tokens, the model's length),
    at least 1; `lengths`: its tokens, counting those a step in flight may still add."""
    return [max(1, min(max_model_len - n, (c.seq.params.max_tokens or max_model_len) - (n - len(c.seq.prompt_ids))))
            for c, n in zip(chunks, lengths)]


def decision_inputs(policy: SpeculationPolicy, speculator, chunks: list, lengths: list[int],
                    max_model_len: int) -> tuple[list[int] | None, int]:
    """What the policy's decision reads, where it decides this step (`due`): the tokens each
    request may still emit, and the positions a draft would catch up on (priced once measured)."""
    if not policy.due(len(chunks)):
        return None, 0
    behind = speculator.behind([c.seq for c in chunks]) if policy.switch_price else 0
    return rooms_left(chunks, lengths, max_model_len), behind


class Engine:
    """Owns the model, its runner and KV pages, the scheduler, the speculator and its policy, the
    sampler and the ranks' lockstep; runs a plain step's phases itself and hands the rest to its
    rooms: `requests`, `verifier` (speculative steps), `driver` (overlap)."""

    def __init__(self, config: EngineConfig, model=None, tokenizer=None, ranks=None) -> None:
        """`ranks` (from distributed.join_ranks) when experts are sharded over several processes."""
        if model is None or config.cache.num_kv_pages == "auto":
            config = resolve_kv_pages(config)  # before any weight is read: fits, or a ConfigError saying why not
        self.config = config
        c = config
        if c.parallel.ep_size > 1 and ranks is None:
            raise ValueError("parallel.ep_size > 1: join the ranks first (moespec.startup.start_engine)")
        self.ranks = ranks
        experts = {} if ranks is None else {
            "experts_factory": ep_experts_factory(ranks.runtime, c.parallel.eplb.num_redundant_experts)}
        self.model = model or load_model(c.model.path, c.model.dtype, c.model.device,
                                         quantization=c.model.quantization, **experts)
        tokenizer = tokenizer if model is not None else load_tokenizer(c.model.tokenizer or c.model.path)
        self.vocab_size = self.model.config.vocab_size
        self.allocator = PageAllocator(c.cache.num_kv_pages, c.cache.page_size)
        self.max_model_len = resolve_max_model_len(c, self.model, self.allocator)
        self.runner = ModelRunner(self.model, c.cache.num_kv_pages, c.cache.page_size, c.model.attention_backend,
                                  c.model.device, static=static_spec(c, self.max_model_len),
                                  pack=c.model.pack_linears)
        self.speculator = create_speculator(c, self.model, self.runner)
        self.scheduler = Scheduler(c.scheduler, self.allocator, self.max_model_len, page_keys(c, self.speculator),
                                   self.speculator)
        self.lockstep: Lockstep | None = None
        self.cluster: Cluster | None = None
        self.stopped = False  # rank 0 ended the ranks' loop
        self.last_step = time.monotonic()
        if ranks is not None:
            self.attach_ranks(ranks)
        self.policy = policy_for(c.speculation, self.speculator.trees)
        self.next_tree: TreeShape | None = None  # the tree the policy chose for the step being scheduled
        self.sampler = Sampler()
        # data-parallel ranks draw independent streams; replicated ranks must draw the same ones
        offset = ranks.ctx.ep_rank if ranks is not None and ranks.dp else 0
        self.generator = torch.Generator().manual_seed(c.model.seed + offset)
        self.eos_ids = resolve_eos_ids(self.model, tokenizer)
        self.grammars = Grammars(tokenizer, self.vocab_size, self.eos_ids, backend=c.structured.backend)
        self.stats = StepStats()
        self.progress = StepProgress()  # what the current step is doing, for a watchdog that finds it stuck
        self.warm_up_s = 0.0  # every warm_up so far (captured steps are captured when the engine starts)
        self.requests = Requests(tokenizer, self.vocab_size, self.max_model_len, self.eos_ids, self.grammars,
                                 self.scheduler, self.speculator, self.stats, self.cluster, self.lockstep)
        self.verifier = SpeculativeSteps(c.speculation, self.runner, self.speculator, self.requests, self.policy,
                                         self.sampler, self.generator, c.cache.page_size, self.stats, self.progress,
                                         self.lockstep)
        self.driver = OverlapDriver(self) if c.scheduler.overlap else None  # scheduler.overlap (moespec.overlap)
        if self.lockstep is not None:
            self.step()  # every rank's first agreement: rank 0 learns each rank's load before any request

    # ------------------------------------------------------------------ what the rooms hold, for callers

    @property
    def tokenizer(self):
        return self.requests.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.requests.tokenizer = tokenizer

    @property
    def phase(self) -> str:
        return self.progress.phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self.progress.phase = phase

    @property
    def spec_stats(self) -> SpecStats:
        return self.verifier.spec_stats

    @property
    def in_flight(self) -> InFlight | None:
        return self.driver.in_flight if self.driver is not None else None

    # ------------------------------------------------------------------ ranks and lifetime

    def attach_ranks(self, ranks) -> None:
        """Every forward with MoE layers (target, built-in MTP) runs on all ranks in lockstep."""
        builtin_mtp = self.speculator.mode == "mtp" and not self.config.speculation.mtp_head
        mtp_all = ep_layers(self.model.mtp) if hasattr(self.model, "mtp") else []
        target_layers = [m for m in ep_layers(self.model) if not any(m is t for t in mtp_all)]
        mtp_layers = mtp_all if builtin_mtp else []
        balancer = build_balancer(self.config.parallel.eplb, target_layers + mtp_all, ranks.ctx, self.model.config)
        self.lockstep = Lockstep(ranks, target_layers, mtp_layers, self.runner.dtype, self.config.uses_fixed_exchange,
                                 balancer)
        ranks.runtime.configure(self.config, self.model.config, self.runner.dtype)  # engines in turn may differ
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
        if self.driver is not None:
            self.driver.close()
        if self.ranks is None:
            return
        try:
            self.stop_ranks()
        finally:
            self.ranks.close()
            self.ranks = None

    def keep_alive(self) -> None:
        """An idle server's empty step now and then: ranks waiting in the agreement do not time out."""
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

    # ------------------------------------------------------------------ requests (moespec.requests)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        """Validate and queue a request; across ranks, place it (it starts at the next step)."""
        return self.requests.add(prompt, params, request_id)

    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.requests.encode(prompt)

    def abort(self, request_id: str) -> None:
        self.requests.abort(request_id)

    def num_waiting(self) -> int:
        """Sequences waiting to be scheduled, on every rank (rank 0's latest view)."""
        return self.requests.num_waiting()

    def rank_loads(self) -> list | None:
        """Per-rank running, waiting and KV pages as of the last step's agreement (None: one process)."""
        return self.requests.rank_loads()

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self.in_flight is not None
                or (self.cluster is not None and self.cluster.has_unfinished()))

    # ------------------------------------------------------------------ one step

    def step(self, stop: bool = False) -> EngineOutputs:
        """One step; across ranks every rank calls it in lockstep (`stop`: rank 0 ends them all)."""
        try:
            outputs = self.run_step(stop)
            if self.cluster is not None:
                outputs = self.exchange_updates(outputs)
            return outputs
        finally:
            self.progress.phase = "idle"
            self.last_step = time.monotonic()

    def run_step(self, stop: bool = False) -> EngineOutputs:
        return self.driver.run(stop) if self.driver is not None else self.run_serial(stop)

    def apply_commands(self) -> None:
        """Rank 0's commands (add, abort) that the last agreement counted, applied here: every rank
        applies them at the same step, before it schedules the next one."""
        if self.cluster is not None and self.lockstep.latest is not None:
            self.progress.phase = "receive commands from rank 0"
            for command in self.cluster.take_commands(self.lockstep.latest.sent[self.cluster.rank]):
                self.requests.apply(command)

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
        self.progress.phase = "schedule"
        start = time.perf_counter()
        scheduled = self.schedule()
        self.progress.phase = "agree on the step with the other ranks"
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
            return self.verifier.finish_speculative(prepared, self.verifier.speculate(prepared))
        start = time.perf_counter()
        result = self.execute(prepared)
        device_s = time.perf_counter() - start
        start = time.perf_counter()
        self.progress.phase = "postprocess"
        outputs = self.postprocess(prepared, result)
        self.requests.publish([c.seq for c in prepared.scheduled.chunks])
        host_s = prepared.host_s + time.perf_counter() - start
        self.record(prepared, host_s, device_s)
        if prepared.batch.mode == "decode" and self.speculator.max_tokens:  # a plain decode step, measured
            self.policy.record(len(prepared.sampled), 0, 1.0, host_s + device_s)
            self.verifier.ran_plain = True
        return outputs

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
            choice = self.policy.choose(len(chunks), *decision_inputs(self.policy, spec, chunks, lengths,
                                                                        self.max_model_len))
            k_wish = self.fit_choice(choice, lengths)
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
                          moe_tokens, int(self.lockstep is not None and self.lockstep.rebalance_due()))

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
        self.progress.phase = "join the other ranks' forwards (no work here)"
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
                batch = self.verifier.build_verify_batch(sampled, num_spec, extra)
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
        self.verifier.spec_stats.steps += steps  # the other ranks' speculation counts too (not per position)
        self.verifier.spec_stats.draft_tokens += drafted
        self.verifier.spec_stats.accepted_tokens += accepted
        for seq in changed:
            if seq.is_finished:
                self.requests.sequences.pop(seq.request_id, None)
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
        self.progress.phase = f"target forward ({prepared.batch.mode})"
        hidden, logits = self.runner.forward(prepared.batch, prepared.ctx)
        record_prompt_logprobs(self.model, hidden, prepared.scheduled.chunks, prepared.batch)
        self.speculator.observe(prepared.scheduled.chunks, prepared.batch, hidden)
        if observed is not None:
            observed.set()
        if self.lockstep is not None:
            self.lockstep.pad_mtp(plan.mtp_before + plan.mtp_after)
        self.progress.phase = "sampling"
        return self.sampler(logits, prepared.sampling)

    def postprocess(self, prepared: PreparedStep, result: SamplerOutput) -> EngineOutputs:
        for chunk in prepared.scheduled.chunks:
            chunk.seq.num_computed = chunk.end
        tokens = result.tokens.tolist()
        updated = []
        for row, seq in enumerate(prepared.sampled):
            lp = result.logprobs[row]
            self.requests.append_tokens(seq, [tokens[row]], [lp])
            updated.append(seq)
        return EngineOutputs(updated)

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
