"""Request bodies of the OpenAI API (pydantic), and their translation to SamplingParams.

Sampling fields are nullable: OpenAI clients send `null` for "use the default".
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moespec.sampling import MAX_LOGPROBS, SamplingParams
from moespec.server.errors import ApiError, bad_request

Prompt = str | list[int]


STRICT = ConfigDict(extra="ignore", strict=True)  # unknown fields are ignored; "1" is not a number


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model_config = STRICT

    model: str | None = None
    n: int | None = 1
    max_tokens: int | None = None
    min_tokens: int | None = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)  # what torch generators take
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int) -> SamplingParams:
        bias = parse_logit_bias(self.logit_bias, vocab_size)
        check_vocab("stop_token_ids", self.stop_token_ids or [], vocab_size)
        options = dict(n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
                       top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
                       stop_token_ids=self.stop_token_ids, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                       logit_bias=bias, ignore_eos=self.ignore_eos, logprobs=logprobs,
                       skip_special_tokens=self.skip_special_tokens,
                       include_stop_str_in_output=self.include_stop_str_in_output)
        try:
            return SamplingParams(**{k: v for k, v in options.items() if v is not None})
        except ValueError as e:
            raise bad_request(e) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        parsed = {int(token): value for token, value in bias.items()}
    except ValueError:
        raise ApiError(400, f"logit_bias: keys must be token ids as strings, got {list(bias)[:3]}",
                       "logit_bias") from None
    check_vocab("logit_bias", parsed, vocab_size)
    return parsed


def check_vocab(name: str, token_ids, vocab_size: int) -> None:
    outside = [t for t in token_ids if not 0 <= t < vocab_size]
    if outside:
        raise ApiError(400, f"{name}: token ids must be in [0, {vocab_size}), got {outside[:3]}", name)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's legacy default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[Prompt]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return [prompt]  # type: ignore[list-item]  # one prompt given as token ids
        return list(prompt)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
