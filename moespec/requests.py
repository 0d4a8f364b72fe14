"""The requests one rank holds: validating and queueing them, placing them on the ranks (rank
0), aborts, commands from rank 0, and, as tokens arrive, appending them with the stop checks
and finishing requests (their pages go back to the scheduler, their draft state to the
speculator). Owns `sequences` (request id -> Sequence, unfinished) and the count of requests
whose steps cannot overlap; touches the scheduler's queues and the speculator's per-request
state, nothing of a step's tensors."""
from __future__ import annotations

import itertools
import logging
import time

from moespec.cluster import Abort, Add, Cluster
from moespec.detokenizer import IncrementalDetokenizer, StopChecker
from moespec.distributed import Lockstep
from moespec.overlap import PENDING
from moespec.prompt_logprobs import prompt_logprob_slots, wants_prompt_logprobs
from moespec.sampling import SamplingParams
from moespec.scheduler import Scheduler
from moespec.sequence import Sequence, Status, TokenLogprob
from moespec.step_state import StepStats, needs_host_token
from moespec.structured import Grammars

logger = logging.getLogger(__name__)


class Requests:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_ids: frozenset[int], grammars: Grammars,
                 scheduler: Scheduler, speculator, stats: StepStats, cluster: Cluster | None = None,
                 lockstep: Lockstep | None = None) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len, self.eos_ids = tokenizer, vocab_size, max_model_len, eos_ids
        self.grammars, self.scheduler, self.speculator, self.stats = grammars, scheduler, speculator, stats
        self.cluster, self.lockstep = cluster, lockstep
        self.sequences: dict[str, Sequence] = {}
        self.ids = itertools.count()
        self.num_serial = 0  # queued requests whose steps cannot overlap (needs_host_token)

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

    def add(self, prompt: str | list[int], params: SamplingParams | None = None,
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
            seq.grammar = self.grammars.matcher(params.structured, params.structured_after)
        if wants_prompt_logprobs(seq):
            seq.prompt_logprobs = prompt_logprob_slots(seq)
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
        if seq.params.max_tokens == 0:  # the prompt scored (prompt logprobs), nothing generated
            self.finish(seq, "length")
            return
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
