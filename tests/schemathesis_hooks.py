"""Schemathesis hooks for tests/test_openapi_fuzz.py: keep out of the positive cases the few
constraints the schema can only state in words (its field descriptions), so that every
schema-valid request it sends should be served. Loaded with SCHEMATHESIS_HOOKS; the served
deployment is described by MOESPEC_FUZZ_* environment variables."""
import os

import schemathesis
from transformers import AutoTokenizer

TOKENIZER = AutoTokenizer.from_pretrained(os.environ["MOESPEC_FUZZ_TOKENIZER"])
MAX_MODEL_LEN = int(os.environ["MOESPEC_FUZZ_MAX_MODEL_LEN"])
VOCAB_SIZE = int(os.environ["MOESPEC_FUZZ_VOCAB_SIZE"])


@schemathesis.hook
def filter_case(ctx, case) -> bool:
    """Positive cases only (negative ones must be refused whatever they hold)."""
    operation = ctx.operation
    if operation is not None and operation.path == "/tokenize" and isinstance(case.body, dict):
        return not case.body.get("continue_final_message")  # its rule is in words (the field's description)
    if operation is None or operation.path not in ("/v1/completions", "/v1/chat/completions"):
        return True
    if case.meta is not None and not case.meta.generation.mode.is_positive:
        return True
    try:
        return satisfies_described_constraints(case.body, chat=operation.path.endswith("chat/completions"))
    except (KeyError, TypeError, ValueError, AttributeError):  # not a body of the schema's shape: keep it
        return True


def satisfies_described_constraints(body: dict, chat: bool) -> bool:
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens", None if chat else 16)
    if max_tokens is not None and (body.get("min_tokens") or 0) > max_tokens:
        return False
    if chat and body.get("top_logprobs") is not None and not body.get("logprobs"):
        return False
    if not chat and max_tokens == 0 and not body.get("echo") and body.get("prompt_logprobs") is None:
        return False
    if any(int(token) >= VOCAB_SIZE for token in (body.get("logit_bias") or {})):
        return False
    if not structured_output_compiles(body, chat):
        return False
    if chat and not tools_are_served(body):
        return False
    return all(0 < n < MAX_MODEL_LEN for n in prompt_lengths(body, chat))


def tools_are_served(body: dict) -> bool:
    """The fuzzed server has no tool-call parser: tools need tool_choice none, required or a named
    function among them (distinct names)."""
    from moespec.server.errors import ApiError
    from moespec.server.protocol import ChatCompletionRequest
    try:
        ChatCompletionRequest.model_validate(body).check_tools()
    except (ApiError, ValueError):
        return False
    return not body.get("tools") or body.get("tool_choice") not in (None, "auto")


def structured_output_compiles(body: dict, chat: bool = False) -> bool:
    """At most one structured-output field (a forced tool call is one), one that compiles, and
    min_tokens 0 beside it."""
    from moespec.config import ServerSection
    from moespec.server.errors import ApiError
    from moespec.server.limits import GrammarLimits
    from moespec.server.protocol import ChatCompletionRequest, CompletionRequest
    from moespec.structured import parse
    try:
        if chat:
            request = ChatCompletionRequest.model_validate(body)
            request.check_tools()
        else:
            request = CompletionRequest.model_validate({**body, "prompt": "x"})
        grammar = request.grammar()
        if grammar is not None:
            GrammarLimits.build(ServerSection()).check(grammar)  # the fuzzed server's bounds
            parse(grammar.spec)
    except (ApiError, ValueError):  # pydantic's ValidationError is a ValueError
        return False
    return grammar is None or not body.get("min_tokens")


def prompt_lengths(body: dict, chat: bool) -> list[int]:
    if chat:  # rendered as the server renders it (tools and earlier tool calls too)
        from moespec.server.chat import render_chat, tool_mode
        from moespec.server.protocol import ChatCompletionRequest
        from moespec.server.errors import ApiError
        request = ChatCompletionRequest.model_validate(body)
        try:
            text = render_chat(TOKENIZER, request, tool_mode(request, "none"))
        except ApiError:  # the template refuses it: not a case the server must serve
            return [MAX_MODEL_LEN]
        return [len(TOKENIZER.encode(text, add_special_tokens=False))]
    prompt = body["prompt"]
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    return [len(TOKENIZER.encode(p, add_special_tokens=False)) if isinstance(p, str) else len(p) for p in prompt]
