"""Per-request state: tokens, KV pages, sampling state, text, finish reason, metrics."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from moespec.sampling import SamplingParams, TokenCounts

PENDING = -1  # an output token the device has sampled and the host has not read yet (moespec.overlap)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # top-n alternatives: token id -> logprob
    rank: int | None = None  # the token's rank in the vocabulary (1 = most likely); prompt logprobs set it


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (set when first scheduled)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def accept_length(self) -> float | None:
        """Mean tokens emitted per verify step (accepted drafts + the bonus token)."""
        if not self.num_spec_steps:
            return None
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps


@dataclass(eq=False)  # a request is itself: compared by identity (the scheduler's list lookups)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # per prompt token (entry 0 None) when params.prompt_logprobs is set (moespec.prompt_logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    detokenizer: object | None = None
    stop_checker: object | None = None
    streamable_chars: int = 0  # text[:streamable_chars] can be streamed (no partial stop string)
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages (PageKeys)
    num_published: int = 0  # leading pages published to the prefix cache (or found there)
    num_ready: int = 0  # leading pages whose speculator KV is in the cache too
    grammar: object | None = None  # structured.GrammarState: the grammar has seen output_ids
    token_counts: TokenCounts | None = None  # what penalties read, kept while it runs (`counts_for`)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens the host has: overlap scheduling appends a placeholder (PENDING) for each token a
        step in flight samples."""
        n = len(self.output_ids)
        while n and self.output_ids[n - 1] == PENDING:
            n -= 1
        return len(self.prompt_ids) + n

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache (the whole prompt, a prefill remainder, or 1 at decode)."""
        return self.num_tokens - self.num_computed

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1 of prompt + outputs, without concatenating the two
        (a decode step asks for one token of each running request)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n: end - n]
        return self.prompt_ids[start:end] + self.output_ids[: max(end - n, 0)]

    def counts_for(self, vocab_size: int, device: torch.device | str) -> TokenCounts | None:
        """Its tokens as its penalties read them, caught up with its outputs; None without
        repetition, frequency or presence penalties. Its outputs hold no placeholder then: a
        penalized request's steps never overlap (engine.needs_host_token)."""
        if not self.params.penalized:
            return None
        if self.token_counts is None:  # the engine and its speculator read them on one device, one vocabulary
            self.token_counts = TokenCounts(self.prompt_ids, vocab_size, device)
        return self.token_counts.catch_up(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
