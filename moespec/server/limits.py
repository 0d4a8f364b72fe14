"""What one request may ask for, checked before anything is allocated or tokenized.

Bounds that depend on the deployment (model, tokenizer, config) live here; the ones that
hold everywhere are field constraints in protocol.py. A request over a bound gets a 400
that names the field: it could never succeed, so "retry later" (429) would be wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

from moespec.config import ServerSection
from moespec.server.errors import ApiError
from moespec.server.protocol import ChatMessage, Prompt, check_vocab

CANDIDATE_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class RequestLimits:
    max_n: int
    max_prompts: int
    max_sequences: int  # server.max_waiting_requests: more sequences could never be queued at once
    max_model_len: int
    vocab_size: int
    max_prompt_chars: int  # no text longer than this can fit in max_model_len tokens
    roles: tuple[str, ...]  # chat roles the template renders

    @classmethod
    def build(cls, server: ServerSection, max_model_len: int, vocab_size: int, tokenizer) -> RequestLimits:
        return cls(server.max_n, server.max_prompts_per_request, server.max_waiting_requests, max_model_len,
                   vocab_size, max_model_len * longest_token_chars(tokenizer), template_roles(tokenizer))

    def check_n(self, n: int, num_prompts: int) -> None:
        if n > self.max_n:
            raise ApiError(400, f"n: at most {self.max_n} completions per prompt on this server (server.max_n), "
                                f"got {n}", "n")
        if num_prompts > self.max_prompts:
            raise ApiError(400, f"prompt: at most {self.max_prompts} prompts per request on this server "
                                f"(server.max_prompts_per_request), got {num_prompts}", "prompt")
        if n * num_prompts > self.max_sequences:
            raise ApiError(400, f"n: {num_prompts} prompts x n={n} = {n * num_prompts} sequences can never be "
                                f"queued at once (server.max_waiting_requests = {self.max_sequences})", "n")

    def check_prompts(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_text("prompt", len(prompt))
            else:
                self.check_ids(prompt)

    def check_text(self, field: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"{field}: {chars} characters cannot fit in max_model_len {self.max_model_len} "
                                f"tokens (at most {self.max_prompt_chars} characters)", field)

    def check_ids(self, ids: list[int]) -> None:
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"prompt: {len(ids)} tokens leave no room to generate within max_model_len "
                                f"{self.max_model_len}", "prompt")
        check_vocab("prompt", ids, self.vocab_size)

    def check_messages(self, messages: list[ChatMessage]) -> None:
        if not self.roles:
            raise ApiError(400, "messages: this model has no chat template; use /v1/completions", "messages")
        for i, message in enumerate(messages):
            if message.role not in self.roles:
                raise ApiError(400, f"messages.{i}.role: {message.role!r} is not a role this model's chat template "
                                    f"accepts; allowed: {', '.join(self.roles)}", "messages")
        self.check_text("messages", sum(len(m.as_template_input()["content"]) for m in messages))


def longest_token_chars(tokenizer) -> int:
    """The most prompt characters one token can stand for: its longest vocabulary entry (a byte-level
    BPE entry has one character per byte), doubled for normalizers that fold two characters into one."""
    if tokenizer is None:
        return 1
    return 2 * max((len(token) for token in tokenizer.get_vocab()), default=1)


def template_roles(tokenizer) -> tuple[str, ...]:
    """The chat roles the tokenizer's template renders (a template may refuse the others)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return ()
    roles = []
    for role in CANDIDATE_ROLES:
        try:
            tokenizer.apply_chat_template([{"role": role, "content": "x"}], tokenize=False,
                                          add_generation_prompt=True)
        except Exception:  # jinja's TemplateError, or raise_exception() in the template
            continue
        roles.append(role)
    return tuple(roles)
