"""The chat route's own parts: rendering messages (with tools) through the chat template, and
turning each choice's text into chat deltas (reasoning, content, tool calls).

`ChatOutput` is the one place text becomes a message: a stream sends each of its deltas as
one chunk (reasoning and content never share a chunk), and a non-streaming response merges
the deltas of one `ChatOutput` fed the whole text, so both carry the same fields.

Tool modes (`tool_mode`): `parse` finds calls in the answer with server.tool_call_parser
(tool_choice auto); `named` and `required` are forced by a grammar (protocol.py:
tool_constraint), so the answer is the named function's arguments, or a JSON list of calls.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Literal

from moespec.config import ServerSection
from moespec.sampling import SamplingParams
from moespec.server.errors import ApiError
from moespec.server.protocol import ChatCompletionRequest
from moespec.server.reasoning import THINK_END, ReasoningSplitter, Split, reasoning_splitter
from moespec.server.responses import Choice, TokenNames, chat_logprobs
from moespec.server.tool_calls import Call, Piece, ToolCallSplitter, forced_calls, tool_call_splitter

ToolMode = Literal["off", "parse", "named", "required"]


def tool_mode(body: ChatCompletionRequest, parser: str) -> ToolMode:
    if not body.tools or body.tool_choice == "none":
        return "off"
    if body.tool_choice in (None, "auto"):
        if parser == "none":
            raise ApiError(400, "tool_choice: auto needs a tool-call parser on the server (server.tool_call_parser, "
                                "--tool-call-parser); 'required' or a named function work without one", "tool_choice")
        return "parse"
    return "required" if body.tool_choice == "required" else "named"


def render_chat(tokenizer, body: ChatCompletionRequest, mode: ToolMode) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "messages: this model has no chat template; use /v1/completions", "messages")
    messages = [m.as_template_input() for m in body.messages]
    tools = [{"type": "function", "function": t.function.template_input()} for t in body.tools or []]
    extra = {"tools": tools} if tools and mode != "off" else {}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # jinja's TemplateError, raise_exception() in the template
        raise ApiError(400, f"messages: {e}", "messages") from None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutput:
    """One choice's text in, its chat deltas out (dicts of an OpenAI `delta`, without role)."""

    def __init__(self, reasoning_parser: str, mode: ToolMode, tool_parser: str, forced: str | None) -> None:
        self.reasoning: ReasoningSplitter | None = reasoning_splitter(reasoning_parser)
        self.tools: ToolCallSplitter | None = tool_call_splitter(tool_parser) if mode == "parse" else None
        self.mode, self.forced = mode, forced
        self.calls = 0
        self.answer = ""  # a `required` answer, parsed once complete

    def feed(self, text: str) -> list[dict]:
        split = self.reasoning.feed(text) if self.reasoning is not None else Split("", text)
        return self.deltas(split, final=False)

    def finish(self) -> list[dict]:
        split = self.reasoning.finish() if self.reasoning is not None else Split("", "")
        return self.deltas(split, final=True)

    def deltas(self, split: Split, final: bool) -> list[dict]:
        out = [{"reasoning_content": split.reasoning, "reasoning": split.reasoning}] if split.reasoning else []
        return out + self.answer_deltas(split.content, final)

    def answer_deltas(self, text: str, final: bool) -> list[dict]:
        if self.mode == "named":
            return [self.call_delta(Call(self.forced, text) if self.calls == 0 else None, text)] if text else []
        if self.mode == "required":
            self.answer += text
            return self.required_deltas() if final else []
        if self.tools is None:
            return [{"content": text}] if text else []
        pieces = self.tools.feed(text) + (self.tools.finish() if final else [])
        return [self.piece_delta(p) for p in pieces]

    def required_deltas(self) -> list[dict]:
        calls = forced_calls(self.answer)
        if calls is None:  # cut short (max_tokens): the text as it is
            return [{"content": self.answer}] if self.answer else []
        return [self.call_delta(call, call.arguments) for call in calls]

    def piece_delta(self, piece: Piece) -> dict:
        if piece.call is not None:
            return self.call_delta(piece.call, piece.call.arguments)
        return self.call_delta(None, piece.arguments) if piece.arguments else {"content": piece.content}

    def call_delta(self, call: Call | None, arguments: str) -> dict:
        """A call's first delta names it (call given); later ones of the same call add arguments."""
        if call is None:
            return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": arguments}}]}
        self.calls += 1
        return {"tool_calls": [{"index": self.calls - 1, "id": call_id(), "type": "function",
                                "function": {"name": call.name, "arguments": arguments}}]}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason


def merge_deltas(deltas: list[dict], with_reasoning: bool) -> dict:
    """The message the deltas of one choice add up to."""
    message: dict = {"role": "assistant", "content": ""}
    calls: list[dict] = []
    reasoning = ""
    for delta in deltas:
        message["content"] += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    if with_reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning or None
    if calls:
        message["tool_calls"] = calls
    if calls or with_reasoning:
        message["content"] = message["content"] or None
    return message


def chat_params(params: SamplingParams, settings: ServerSection, mode: ToolMode) -> SamplingParams:
    """The request's sampling as the parsers need it: DeepSeek-V3's call markers are special tokens
    (kept in the text), and a grammar waits for the end of the reasoning."""
    changes: dict = {}
    if mode == "parse" and settings.tool_call_parser == "deepseek-v3":
        changes["skip_special_tokens"] = False
    if params.structured is not None and settings.reasoning_parser != "none":
        changes["structured_after"] = THINK_END
    return dataclasses.replace(params, **changes) if changes else params


def chat_choice(choice: Choice, names: TokenNames, want_logprobs: bool, output: ChatOutput) -> dict:
    message = merge_deltas(output.feed(choice.text) + output.finish(), output.reasoning is not None)
    return {"index": choice.index, "message": message,
            "logprobs": chat_logprobs(choice.logprobs, names) if want_logprobs else None,
            "finish_reason": output.finish_reason(choice.finish_reason), "stop_reason": choice.stop_reason}
