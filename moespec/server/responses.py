"""OpenAI response bodies and stream chunks built from engine deltas."""
from __future__ import annotations

import itertools
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


def echoed_logprobs(prompt_ids: list[int], scored: list[TokenLogprob | None], names: TokenNames,
                    num_top: int) -> dict:
    """The prompt's part of an echo's legacy logprobs: the first token has none (null)."""
    tokens = [names(t) for t in prompt_ids]
    offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=0))
    return {"tokens": tokens, "token_logprobs": [None if e is None else finite(e.logprob) for e in scored],
            "top_logprobs": [None if e is None else {names(t): finite(v) for t, v in list(e.top.items())[:num_top]}
                             for e in scored],
            "text_offset": offsets}


def joined_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(scored: list[TokenLogprob | None], names: TokenNames) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself, then its top alternatives."""
    out: list[dict | None] = []
    for entry in scored:
        if entry is None:
            out.append(None)
            continue
        ranked = {str(entry.token_id): {"logprob": finite(entry.logprob), "rank": entry.rank,
                                        "decoded_token": names(entry.token_id)}}
        for rank, (token, logprob) in enumerate(entry.top.items(), start=1):
            ranked.setdefault(str(token), {"logprob": finite(logprob), "rank": rank, "decoded_token": names(token)})
        out.append(ranked)
    return out


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
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.prompt_logprobs = delta.prompt_logprobs or self.prompt_logprobs
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


@dataclass(frozen=True)
class CompletionShape:
    """What a completion choice carries besides its text: logprobs (their top n), the echoed
    prompt, vLLM's prompt_logprobs."""

    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: bool = False
    prompt_texts: tuple[str, ...] = ()  # per prompt, echoed
    prompt_ids: tuple[tuple[int, ...], ...] = ()  # per prompt
    n: int = 1

    def prompt_of(self, index: int) -> int:
        return index // self.n


def completion_choice(choice: Choice, names: TokenNames, shape: CompletionShape) -> dict:
    return completion_payload(choice.index, choice.text, choice.logprobs, choice.prompt_logprobs, names, shape,
                              offset=0, opening=True) | {"finish_reason": choice.finish_reason,
                                                         "stop_reason": choice.stop_reason}


def completion_payload(index: int, text: str, logprobs: list[TokenLogprob], scored: list[TokenLogprob | None] | None,
                       names: TokenNames, shape: CompletionShape, offset: int, opening: bool) -> dict:
    """One choice's text and logprobs (`offset`: characters this choice already sent); the
    `opening` part of an echo carries the prompt before its completion."""
    prompt = shape.prompt_of(index)
    payload = completion_logprobs(logprobs, names, offset) if shape.logprobs is not None else None
    if opening and shape.echo:
        prompt_text = shape.prompt_texts[prompt]
        if payload is not None:
            echoed = echoed_logprobs(list(shape.prompt_ids[prompt]), scored or [], names, shape.logprobs)
            payload = joined_logprobs(echoed, completion_logprobs(logprobs, names, offset + len(prompt_text)))
        text = prompt_text + text
    body = {"index": index, "text": text, "logprobs": payload}
    if opening and shape.prompt_logprobs:
        body["prompt_logprobs"] = vllm_prompt_logprobs(scored or [], names)
    return body


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
