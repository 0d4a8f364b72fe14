"""The overlapped step driver (`scheduler.overlap`; the design is in moespec.overlap): each call
runs step n on the engine's thread while the helper thread schedules, agrees, packs and plans
step n+1 through the engine's own phases, then processes n's results. Owns the helper thread and
the step in flight; runs the engine's phases (schedule, agree, prepare, execute, the
speculative steps) in that order and changes requests' host state only as they do (a
placeholder per token in flight, filled when its step is processed).

Shapes legend: B requests, Q rows per request of a verify batch (1 + k), P rows filled from the
previous step's outcome.
"""
from __future__ import annotations

import time

import torch

from moespec.overlap import PENDING, HostWorker, InFlight, Outcome
from moespec.sampling import SamplerOutput
from moespec.scheduler import ScheduledChunk, SchedulerOutput
from moespec.static_step import mark_kv_dynamic
from moespec.step_state import EngineOutputs, PreparedStep


class OverlapDriver:
    def __init__(self, engine) -> None:
        """`engine`: the moespec.engine.Engine whose phases this drives."""
        self.engine = engine
        self.requests, self.verifier, self.progress = engine.requests, engine.verifier, engine.progress
        self.runner, self.scheduler, self.speculator = engine.runner, engine.scheduler, engine.speculator
        self.stats, self.lockstep = engine.stats, engine.lockstep
        self.worker = HostWorker()
        self.in_flight: InFlight | None = None  # the prepared step that runs at the next call

    def close(self) -> None:
        self.worker.close()

    def run(self, stop: bool = False) -> EngineOutputs:
        """Run step n (prepared by the previous call) while a helper thread schedules, packs and
        plans step n+1; then process step n's results. A step that needs a token on the host
        runs serially, and so does rank 0's last step, which stops the ranks (moespec.overlap)."""
        start = time.perf_counter()
        self.engine.apply_commands()
        ready, self.in_flight = self.in_flight, None
        if ready is not None:
            ready = self.settle(ready, start)
        if ready is not None and ready.plan.stop:
            return self.engine.stop_here(ready.plan)
        if self.requests.num_serial or stop:  # a request needs its previous token on the host
            outputs = self.run_prepared(ready, None, start) if ready is not None else EngineOutputs()
            return EngineOutputs(outputs.updated + self.engine.run_serial(stop).updated)
        if ready is None:  # the pipeline starts: prepare a step here first
            ready = self.prepare_next(None, start)
            if ready is None:
                return EngineOutputs()
            if ready.plan.stop:
                return self.engine.stop_here(ready.plan)
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
        prepared = self.engine.prepare(SchedulerOutput(chunks, []), flight.plan, start, tree=tree)
        return self.advance(prepared, None, start)

    def run_prepared(self, flight: InFlight, following, start: float) -> EngineOutputs:
        """Step n's device side on this thread (step n-1's outcome put in place first), then, once
        the helper has prepared step n+1 (`following`), n's results processed. Across ranks a
        step with no requests here joins the others' forwards."""
        prepared = flight.prepared
        self.engine.begin(flight.plan)
        device_start = time.perf_counter()
        try:
            if flight.rows is not None:
                self.place_previous(flight)
            if prepared is None:
                self.engine.join_step(flight.plan)
                result = outcome = None
            elif prepared.num_spec:
                result = self.verifier.speculate(prepared)
                outcome = result.outcome
            else:
                result = self.engine.execute(prepared, flight.observed)
                outcome = Outcome(result.tokens[:, None])
        finally:
            flight.observed.set()  # the helper never waits on a step that failed
        device_s = time.perf_counter() - device_start
        if following is not None:
            self.progress.phase = "wait for the next step's preparation"
            self.in_flight = following.result()
            if self.in_flight is not None:
                self.in_flight.previous = outcome
                self.stats.ahead_steps += 1
                self.stats.shifted_steps += self.in_flight.ahead
        if prepared is None:
            outputs = EngineOutputs()
        elif prepared.num_spec:
            outputs = self.verifier.finish_speculative(prepared, result, start)
        else:
            outputs = self.process(flight, result, device_s, start)
        if self.in_flight is not None and self.in_flight.prepared is not None:
            self.requests.publish([c.seq for c in self.in_flight.prepared.scheduled.chunks])  # their tokens are known now
        return outputs

    def prepare_next(self, previous: InFlight | None, start: float) -> InFlight | None:
        """Schedule, agree (across ranks), pack and plan a step, and advance the host's view of a
        plain step's requests: KV computed through their chunks, one placeholder token per sampled
        request. Runs on the helper thread while `previous` computes. After a speculative step
        only another one is prepared, for that step's longest outcome (moespec.overlap). None:
        nothing to run, or nothing that can be decided before `previous` has run (then no
        agreement was made either)."""
        self.progress.phase = "schedule"
        if previous is not None and previous.prepared is None:
            previous = None  # it joined the others' forwards: nothing of this rank's in flight
        extra = previous.widths() if previous is not None and previous.speculative else {}
        if extra:
            scheduled = self.scheduler.schedule_ahead(extra, self.speculator.lookahead)
        else:  # a preemption would release draft state the step in flight uses
            scheduled = self.engine.schedule(can_preempt=previous is None or not self.speculator.max_tokens)
        if scheduled is None or (not scheduled.chunks and self.lockstep is None):
            return None
        if previous is not None and not extra and self.engine.mtp_in_lockstep:
            self.progress.phase = "wait for the step before's target forward"
            previous.observed.wait()  # its MTP bookkeeping (held hidden states) decides this report
        self.progress.phase = "agree on the step with the other ranks"
        plan = self.engine.agree(scheduled, False, extra)
        if plan.stop:
            return InFlight(plan, None)
        if not scheduled.chunks:  # the others run a step: join it, or nothing runs anywhere
            return InFlight(plan, None) if plan.run else None
        if extra and not plan.ks[self.lockstep.rank if self.lockstep else 0]:
            # a plain step needs the last token on the host: prepared once the step before is processed
            return InFlight(plan, None, scheduled=scheduled) if self.lockstep is not None else None
        prepared = self.engine.prepare(scheduled, plan, start, extra, self.engine.next_tree)
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
        self.progress.phase = "postprocess"
        tokens = result.tokens.tolist()
        updated = []
        for row, (seq, at) in enumerate(zip(flight.prepared.sampled, flight.pending_at)):
            if seq.is_finished:
                continue
            later = len(seq.output_ids) - at - 1  # placeholders of steps prepared after this one
            del seq.output_ids[at:]
            self.requests.append_tokens(seq, [tokens[row]], [result.logprobs[row]])
            if not seq.is_finished:
                seq.output_ids += [PENDING] * later
            updated.append(seq)
        host_s = flight.prepared.host_s + time.perf_counter() - start
        wall_s = time.perf_counter() - call_start
        self.engine.record(flight.prepared, host_s, device_s, wall_s)
        if flight.prepared.batch.mode == "decode" and self.speculator.max_tokens:  # a plain decode step, measured
            self.engine.policy.record(len(flight.prepared.sampled), 0, 1.0, wall_s)
            self.verifier.ran_plain = True
        return EngineOutputs(updated)
