"""What generation returns: one RequestOutput per prompt with its n completions."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moespec.sequence import RequestMetrics, Sequence, TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # generated tokens
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics

    @classmethod
    def from_sequence(cls, index: int, seq: Sequence) -> "CompletionOutput":
        return cls(index, list(seq.output_ids), seq.text, seq.finish_reason, seq.stop_reason,
                   list(seq.logprobs) if seq.params.logprobs is not None else None, dataclasses.replace(seq.metrics))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs

    # the first completion's fields, for the common n == 1 case
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (the fewest over the completions)."""
        return min(o.metrics.num_cached_tokens or 0 for o in self.outputs)
