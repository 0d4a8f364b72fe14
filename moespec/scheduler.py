"""Continuous batching: waiting/running queues, admission by free pages and batch limits,
chunked prefill, decode, preemption by recompute when pages run out, abort.

One `schedule()` call decides which requests run this step and how many of their pending
tokens go in, and makes sure their pages cover those tokens (plus `lookahead` slots a
speculator will write during decode). Pages come from the engine's single allocator.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from moespec.config import SchedulerSection
from moespec.kv_cache import PageAllocator
from moespec.sequence import Sequence, Status

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        """The single pending token of a request that already has outputs."""
        return self.num_tokens == 1 and bool(self.seq.output_ids) and self.completes_prompt

    @property
    def completes_prompt(self) -> bool:
        """This chunk reaches the last known token: its last position gets sampled."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]

    @property
    def mode(self) -> str:
        decode = sum(c.is_decode for c in self.chunks)
        return "decode" if decode == len(self.chunks) else "prefill" if decode == 0 else "mixed"

    @property
    def is_decode_only(self) -> bool:
        return bool(self.chunks) and self.mode == "decode"


class Scheduler:
    def __init__(self, config: SchedulerSection, allocator: PageAllocator, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.release(seq)
                    return seq
        return None

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []

    # ------------------------------------------------------------------ one step

    def schedule(self, lookahead: int = 0) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks, preempted = [], []
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an earlier request
                continue
            num = min(seq.num_pending, budget) if self.config.enable_chunked_prefill else seq.num_pending
            if num == 0 or num > budget:
                continue
            extra = lookahead if num == seq.num_pending else 0
            if not self.reserve(seq, min(seq.num_computed + num + extra, self.max_model_len), preempted):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, num))
            budget -= num
        if not preempted:
            chunks += self.admit_waiting(budget, lookahead)
        return SchedulerOutput(chunks, preempted)

    def reserve(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Grow seq's pages to cover num_tokens, preempting the newest running requests if needed."""
        need = self.allocator.pages_for(num_tokens) - len(seq.pages)
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.allocator.allocate(need)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free all pages; the request recomputes prompt + outputs when it is admitted again."""
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.info("preempted request %s (%d tokens) to free KV pages", seq.request_id, seq.num_tokens)

    def admit_waiting(self, budget: int, lookahead: int) -> list[ScheduledChunk]:
        chunks = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num = seq.num_pending
            if num > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num = budget
            extra = lookahead if num == seq.num_pending else 0  # a draft writes one token past the prompt
            need = self.allocator.pages_for(min(seq.num_computed + num + extra, self.max_model_len)) - len(seq.pages)
            if not self.allocator.can_allocate(need):
                break
            seq.pages += self.allocator.allocate(need)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed, num))
            budget -= num
        return chunks
