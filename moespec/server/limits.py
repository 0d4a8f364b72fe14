"""What one request may ask for, checked before anything is allocated or tokenized.

Bounds that depend on the deployment (model, tokenizer, config) live here; the ones that
hold everywhere are field constraints in protocol.py. A request over a bound gets a 400
that names the field: it could never succeed, so "retry later" (429) would be wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from moespec.config import ServerSection
from moespec.server.errors import ApiError
from moespec.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, Prompt, RequestGrammar,
                                     SamplingRequest, check_vocab)
from moespec.server.tokens import DetokenizeRequest, TokenizePrompt, TokenizeRequest

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
    grammar: GrammarLimits

    @classmethod
    def build(cls, server: ServerSection, max_model_len: int, vocab_size: int, tokenizer) -> RequestLimits:
        return cls(server.max_n, server.max_prompts_per_request, server.max_waiting_requests, max_model_len,
                   vocab_size, max_model_len * longest_token_chars(tokenizer), template_roles(tokenizer),
                   GrammarLimits.build(server))

    def check_request(self, request: SamplingRequest) -> None:
        """Every bound a parsed request body can be checked against before it is served."""
        if isinstance(request, CompletionRequest):
            prompts = request.prompts()
            self.check_n(request.n or 1, len(prompts))
            self.check_prompts(prompts)
        elif isinstance(request, ChatCompletionRequest):
            self.check_n(request.n or 1, 1)
            self.check_messages(request.messages)
            request.check_tools()
        elif isinstance(request, (TokenizeRequest, DetokenizeRequest)):
            self.check_token_request(request)
            return
        grammar = request.grammar()
        if grammar is not None:
            self.grammar.check(grammar)

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

    def check_token_request(self, request: TokenizeRequest | DetokenizeRequest) -> None:
        if isinstance(request, DetokenizeRequest):
            if len(request.tokens) > self.max_model_len:
                raise ApiError(400, f"tokens: at most max_model_len ({self.max_model_len}) token ids, got "
                                    f"{len(request.tokens)}", "tokens")
            check_vocab("tokens", request.tokens, self.vocab_size)
        elif isinstance(request.root, TokenizePrompt):
            self.check_text("prompt", len(request.root.prompt))
        else:
            self.check_messages(request.root.messages)

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


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a structured output, checked before xgrammar sees it: its work grows with the
    schema's size and depth, an enum's length and a regex's or grammar's length (a 400-deep
    object schema took xgrammar 38 s to parse, a 100,000-string enum did not compile in 300 s)."""

    max_schema_bytes: int
    max_schema_depth: int
    max_enum_items: int
    max_grammar_chars: int

    @classmethod
    def build(cls, server: ServerSection) -> GrammarLimits:
        return cls(server.max_schema_bytes, server.max_schema_depth, server.max_enum_items, server.max_grammar_chars)

    def check(self, grammar: RequestGrammar) -> None:
        spec, param = grammar
        if spec.json is not None:
            self.check_schema(spec.json, param)
        for text, what in ((spec.regex, "a regex"), (spec.grammar, "a grammar")):
            if text is not None and len(text) > self.max_grammar_chars:
                raise ApiError(400, f"{param}: {what} of {len(text)} characters; at most {self.max_grammar_chars} "
                                    "(server.max_grammar_chars)", param)
        if spec.choice is not None:
            self.check_items(len(spec.choice), param, "choice list")
            chars = sum(map(len, spec.choice))
            if chars > self.max_grammar_chars:
                raise ApiError(400, f"{param}: choices of {chars} characters together; at most "
                                    f"{self.max_grammar_chars} (server.max_grammar_chars)", param)

    def check_schema(self, schema: str, param: str) -> None:
        if len(schema) > self.max_schema_bytes:
            raise ApiError(400, f"{param}: a JSON schema of {len(schema)} bytes (as compact JSON); at most "
                                f"{self.max_schema_bytes} (server.max_schema_bytes)", param)
        depth, longest = schema_shape(json.loads(schema))
        if depth > self.max_schema_depth:
            raise ApiError(400, f"{param}: a JSON schema nested {depth} deep; at most {self.max_schema_depth} "
                                "(server.max_schema_depth)", param)
        self.check_items(longest, param, "enum, anyOf or oneOf list")

    def check_items(self, count: int, param: str, what: str) -> None:
        if count > self.max_enum_items:
            raise ApiError(400, f"{param}: a {what} of {count} items; at most {self.max_enum_items} "
                                "(server.max_enum_items)", param)


def schema_shape(schema: object) -> tuple[int, int]:
    """(nesting depth of objects and arrays, longest enum/anyOf/oneOf list), without recursion."""
    depth = longest = 0
    stack = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, level)
            for key, value in node.items():
                if key in ("enum", "anyOf", "oneOf") and isinstance(value, list):
                    longest = max(longest, len(value))
                stack.append((value, level + 1))
        elif isinstance(node, list):
            depth = max(depth, level)
            stack.extend((item, level + 1) for item in node)
    return depth, longest
