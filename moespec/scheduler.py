"""Continuous batching: waiting/running queues, admission by free pages and batch limits,
prefix caching, chunked prefill, decode, preemption by recompute when pages run out, abort.

One `schedule()` call decides which requests run this step and how many of their pending
tokens go in, and makes sure their pages cover those tokens (plus `lookahead` slots a
speculator will write during decode). Pages come from the engine's single allocator.

Prefix caching: a request being admitted takes the longest run of cached pages its tokens
start with (at least one token is always left to compute, for logits to sample from) and
prefills the rest. Its full pages are published as they are computed (`publish`), so a
request finishing, aborted or preempted leaves them cached. A waiting request whose next page
another running request is computing right now waits a step for it rather than compute it
twice (requests sharing a system prompt, arriving together, or the n completions of a prompt).
"""
from __future__ import annotations

import functools
import logging
from collections import deque
from dataclasses import dataclass, field

from moespec.config import SchedulerSection
from moespec.kv_cache import PageAllocator, PageKeys
from moespec.sequence import Sequence, Status

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    admitted: bool = False  # the request's first step since it was admitted (or admitted again)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        """The single pending token of a running request that already has outputs. A request
        admitted again after a preemption with all but its last token cached runs that token as
        its prefill: no speculator has seen the position before it."""
        return self.num_tokens == 1 and bool(self.seq.output_ids) and self.completes_prompt and not self.admitted

    @property
    def completes_prompt(self) -> bool:
        """This chunk reaches the last known token: its last position gets sampled."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]
    # requests admitted with cached pages: (seq, how many of those tokens the speculator's caches hold)
    hits: list[tuple[Sequence, int]] = field(default_factory=list)

    @functools.cached_property
    def mode(self) -> str:
        """Read once per step by the engine and the batch (its chunks are not changed after)."""
        decode = sum(c.is_decode for c in self.chunks)
        return "decode" if decode == len(self.chunks) else "prefill" if decode == 0 else "mixed"

    @property
    def is_decode_only(self) -> bool:
        return bool(self.chunks) and self.mode == "decode"


class Scheduler:
    def __init__(self, config: SchedulerSection, allocator: PageAllocator, max_model_len: int,
                 keys: PageKeys | None = None, speculator=None) -> None:
        """`keys`: prefix caching on. `speculator` (a Speculator): which positions its caches hold
        (`kv_tokens`), and whether it can compute its KV of cached pages that lack it
        (`kv_from_tokens`: a draft model can; the MTP layer needs the target's hidden states)."""
        self.config = config
        self.max_model_len = max_model_len
        self.allocator = allocator
        self.keys, self.speculator = keys, speculator
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
        self.publish(seq)  # what it computed stays cached
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_published = seq.num_ready = 0
        seq.token_counts = None  # rebuilt if it runs again: memory for penalties is held by running requests only

    # ------------------------------------------------------------------ one step

    def schedule(self, lookahead: int = 0, can_preempt: bool = True) -> SchedulerOutput | None:
        """`can_preempt` False: None where a running request's pages would need another's (overlap
        scheduling under speculation prepares steps that way: a preemption releases draft state
        a step in flight is using)."""
        budget = self.config.max_num_batched_tokens
        chunks, preempted = [], []
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an earlier request
                continue
            num = min(seq.num_pending, budget) if self.config.enable_chunked_prefill else seq.num_pending
            if num == 0 or num > budget:
                continue
            extra = lookahead if num == seq.num_pending else 0
            num_tokens = min(seq.num_computed + num + extra, self.max_model_len)
            if not can_preempt and not self.allocator.can_allocate(self.allocator.pages_for(num_tokens) - len(seq.pages)):
                return None
            if not self.reserve(seq, num_tokens, preempted):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, num))
            budget -= num
        hits = []
        if not preempted:
            admitted, hits = self.admit_waiting(budget, lookahead)
            chunks += admitted
        return SchedulerOutput(chunks, preempted, hits)

    def schedule_ahead(self, in_flight: dict[int, int], lookahead: int) -> SchedulerOutput | None:
        """Every running request's next decode step, decided while its current step runs; that step
        adds at most in_flight[id(seq)] tokens to it, and pages are reserved for the most (the
        verify step is shifted back on the device once the accepted lengths are known). None when
        the step cannot be decided before that one's outcome: a running request not in it (a
        prefill in progress), a waiting request that could be admitted, or pages that would need
        a preemption."""
        running = self.running
        if self.waiting and len(running) < self.config.max_num_seqs:
            return None
        if len(running) > self.config.max_num_batched_tokens:
            return None
        if any(id(seq) not in in_flight or seq.num_pending != 1 for seq in running):
            return None
        need = [self.allocator.pages_for(min(seq.num_tokens + in_flight[id(seq)] + lookahead, self.max_model_len))
                - len(seq.pages) for seq in running]
        if not self.allocator.can_allocate(sum(n for n in need if n > 0)):
            return None
        for seq, n in zip(running, need):
            if n > 0:
                seq.pages += self.allocator.allocate(n)
        return SchedulerOutput([ScheduledChunk(seq, seq.num_computed, 1) for seq in running], [])

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

    def admit_waiting(self, budget: int, lookahead: int) -> tuple[list[ScheduledChunk], list]:
        chunks, hits = [], []
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return chunks, hits  # the common decode step: nothing to admit, no keys to gather
        computing = self.computing_keys()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            cached, spec_tokens = self.find_cached(seq)
            if self.computes_soon(seq, len(cached), computing):
                continue  # its next page is being computed by another request: take it next step
            num = seq.num_pending - len(cached) * self.allocator.page_size
            if num > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num = budget
            start = len(cached) * self.allocator.page_size
            extra = lookahead if start + num == seq.num_tokens else 0  # a draft writes one token past the prompt
            need = self.allocator.pages_for(min(start + num + extra, self.max_model_len)) - len(cached)
            if not self.allocator.can_take(cached, need):
                break
            self.admit(seq, cached, need, spec_tokens)
            computing.update(seq.page_keys[len(cached):])
            if cached:
                hits.append((seq, spec_tokens))
            chunks.append(ScheduledChunk(seq, start, num, admitted=True))
            budget -= num
        return chunks, hits

    def admit(self, seq: Sequence, cached: list[int], need: int, spec_tokens: int) -> None:
        self.allocator.take(cached)
        seq.pages = cached + self.allocator.allocate(need)
        seq.num_computed = len(cached) * self.allocator.page_size
        seq.num_published, seq.num_ready = len(cached), spec_tokens // self.allocator.page_size
        if seq.metrics.num_cached_tokens is None:
            seq.metrics.num_cached_tokens = seq.num_computed
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    # ------------------------------------------------------------------ prefix cache

    def find_cached(self, seq: Sequence) -> tuple[list[int], int]:
        """The cached pages seq can start with (leaving at least one token to compute), and how
        many of their tokens have the speculator's KV too. None for a request that wants prompt
        logprobs: a cached page has no logits to score its tokens with."""
        if self.keys is None or seq.params.prompt_logprobs is not None:  # its prompt's logits are needed
            return [], 0
        keys = self.keys.update(seq)[: (seq.num_tokens - 1) // self.allocator.page_size]
        pages = self.allocator.lookup(keys)
        ready = next((i for i, page in enumerate(pages) if page not in self.allocator.ready), len(pages))
        if self.speculator is not None and not self.speculator.kv_from_tokens:
            pages = pages[:ready]
        return pages, ready * self.allocator.page_size

    def computing_keys(self) -> set[bytes]:
        """Keys of pages running requests have yet to compute and publish."""
        if self.keys is None:
            return set()
        return {key for seq in self.running for key in seq.page_keys[seq.num_published:]}

    def computes_soon(self, seq: Sequence, num_cached: int, computing: set[bytes]) -> bool:
        return num_cached < len(seq.page_keys) and seq.page_keys[num_cached] in computing

    def publish(self, seq: Sequence) -> None:
        """Publish seq's pages that are now full in the target's cache (keyed by their tokens), and
        mark those whose positions the speculator's caches hold too."""
        if self.keys is None or not seq.pages:
            return
        spec_tokens = self.speculator.kv_tokens(seq) if self.speculator is not None else seq.num_tokens
        S, keys = self.allocator.page_size, self.keys.update(seq)
        full = min(seq.num_computed // S, len(keys), len(seq.pages))
        for i in range(seq.num_published, full):
            self.allocator.publish(seq.pages[i], keys[i])
        seq.num_published = max(seq.num_published, full)
        ready = min(spec_tokens // S, seq.num_published)
        for i in range(seq.num_ready, ready):
            self.allocator.mark_ready(seq.pages[i])
        seq.num_ready = max(seq.num_ready, ready)
