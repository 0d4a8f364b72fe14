"""OpenAI response bodies and stream chunks built from engine deltas."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from moespec.sequence import TokenLogprob
from moespec.server.engine_loop import Delta, RequestHandle

MIN_LOGPROB = -9999.0  # JSON has no -inf


class TokenNames:
    """Token id -> its text, as logprobs report it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self.cache.get(token_id)
        if name is None:
            name = self.decode(token_id)
            self.cache[token_id] = name
        return name

    def decode(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(logprobs: list[TokenLogprob], names: TokenNames, offset: int) -> dict:
    """OpenAI's legacy shape; text_offset continues from `offset` (chars already emitted)."""
    tokens = [names(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [{names(t): finite(v) for t, v in lp.top.items()} for lp in logprobs],
            "text_offset": offsets}


def chat_logprob_entry(token_id: int, logprob: float, names: TokenNames) -> dict:
    token = names(token_id)
    return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(logprobs: list[TokenLogprob], names: TokenNames) -> dict:
    content = []
    for lp in logprobs:
        entry = chat_logprob_entry(lp.token_id, lp.logprob, names)
        entry["top_logprobs"] = [chat_logprob_entry(t, v, names) for t, v in lp.top.items()]
        content.append(entry)
    return {"content": content}


@dataclass
class Choice:
    """One choice's deltas accumulated (non-streaming responses)."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason


@dataclass
class UsageTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spec_steps: int = 0
    n: int = 1
    cached: dict[int, int] = field(default_factory=dict)  # per prompt: its choices' fewest cached tokens

    @classmethod
    def for_request(cls, handle: RequestHandle, n: int) -> UsageTotals:
        return cls(prompt_tokens=sum(handle.prompt_tokens[::n]), n=n)  # each prompt counts once, not per choice

    def add(self, delta: Delta) -> None:
        if delta.usage is None:
            return
        u = delta.usage
        self.completion_tokens += u.completion_tokens
        self.draft_tokens += u.draft_tokens
        self.accepted_tokens += u.accepted_tokens
        self.spec_steps += u.spec_steps
        prompt = delta.index // self.n
        self.cached[prompt] = min(self.cached.get(prompt, u.cached_tokens), u.cached_tokens)

    def as_dict(self) -> dict:
        accept_length = (self.accepted_tokens + self.spec_steps) / self.spec_steps if self.spec_steps else None
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
                "speculation": {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                                "accept_length": accept_length}}


def completion_choice(choice: Choice, names: TokenNames, want_logprobs: bool) -> dict:
    logprobs = completion_logprobs(choice.logprobs, names, 0) if want_logprobs else None
    return {"index": choice.index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
