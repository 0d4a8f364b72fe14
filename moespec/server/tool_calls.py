"""Tool-call parsers: the function calls in a chat answer, found by their markers.

`server.tool_call_parser` names the format the model writes calls in:
- `deepseek-v3`: DeepSeek-V3's special tokens,
  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
- `hermes`: <tool_call>{"name": NAME, "arguments": {...}}</tool_call> (Hermes/Qwen-style templates).

`ToolCallSplitter` works on text deltas like reasoning.ReasoningSplitter: text that could be
the start of a marker is held back, a call is emitted whole once its closing marker arrives
(its arguments as one fragment), and what it emits never depends on where the text was cut.
A call whose body does not parse stays in the content as the model wrote it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from moespec.server.reasoning import held_length

TOOL_CALL_PARSERS = ("none", "deepseek-v3", "hermes")
DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, DEEPSEEK_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_BODY = re.compile(r"\s*(?:function)?" + re.escape(DEEPSEEK_SEP) + r"(?P<name>[^\n]+)\n```(?:json)?\n"
                           r"(?P<arguments>.*?)\n?```\s*", re.DOTALL)


class Call(NamedTuple):
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


class Piece(NamedTuple):
    """What the splitter emits: answer text, or one whole call."""

    content: str = ""
    call: Call | None = None


def parse_deepseek(body: str) -> Call | None:
    match = DEEPSEEK_BODY.fullmatch(body)
    if match is None:
        return None
    return Call(match["name"].strip(), match["arguments"].strip())


def parse_hermes(body: str) -> Call | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        return Call(call["name"], arguments)
    return Call(call["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class ToolFormat:
    open: str  # starts one call
    close: str  # ends it
    dropped: tuple[str, ...]  # markers around a group of calls, removed from the content
    parse: Callable[[str], Call | None]  # a call's body (between open and close)


FORMATS = {
    "deepseek-v3": ToolFormat(DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END),
                              parse_deepseek),
    "hermes": ToolFormat("<tool_call>", "</tool_call>", (), parse_hermes),
}


class ToolCallSplitter:
    """Incremental tool-call parser: `feed` each text delta, `finish` once at the end."""

    def __init__(self, form: ToolFormat) -> None:
        self.form = form
        self.markers = (form.open, *form.dropped)
        self.pending = ""
        self.in_call = False

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        while self.step(pieces):
            pass
        return [p for p in pieces if p.call is not None or p.content]

    def finish(self) -> list[Piece]:
        body, self.pending = self.pending, ""
        if not self.in_call:
            return [Piece(body)] if body else []
        self.in_call = False
        call = self.form.parse(body)
        return [Piece(call=call)] if call is not None else [Piece(self.form.open + body)]

    def step(self, pieces: list[Piece]) -> bool:
        """Emits what the pending text settles; True while more may follow."""
        if self.in_call:
            return self.close_call(pieces)
        found = [(self.pending.find(m), m) for m in self.markers]
        found = [(at, m) for at, m in found if at >= 0]
        if not found:
            keep = held_length(self.pending, self.markers)
            pieces.append(Piece(self.take(len(self.pending) - keep)))
            return False
        at, marker = min(found)
        pieces.append(Piece(self.take(at)))
        self.take(len(marker))
        self.in_call = marker == self.form.open
        return True

    def close_call(self, pieces: list[Piece]) -> bool:
        end = self.pending.find(self.form.close)
        if end < 0:
            return False
        body = self.take(end)
        self.take(len(self.form.close))
        self.in_call = False
        call = self.form.parse(body)
        pieces.append(Piece(call=call) if call is not None else Piece(self.form.open + body + self.form.close))
        return True

    def take(self, count: int) -> str:
        taken, self.pending = self.pending[:count], self.pending[count:]
        return taken


def tool_call_splitter(parser: str) -> ToolCallSplitter | None:
    if parser == "none":
        return None
    if parser not in FORMATS:
        raise ValueError(f"server.tool_call_parser: unknown parser {parser!r}; allowed: {', '.join(TOOL_CALL_PARSERS)}")
    return ToolCallSplitter(FORMATS[parser])


def parse_tool_calls(parser: str, text: str) -> list[Piece]:
    """The whole answer's pieces: what a splitter fed all of it emits (adjacent content joined)."""
    splitter = tool_call_splitter(parser)
    return join_content([*splitter.feed(text), *splitter.finish()])


def join_content(pieces: list[Piece]) -> list[Piece]:
    joined: list[Piece] = []
    for piece in pieces:
        if piece.call is None and joined and joined[-1].call is None:
            joined[-1] = Piece(joined[-1].content + piece.content)
        else:
            joined.append(piece)
    return joined


def forced_call_schema(functions: list[dict], name: str | None, parallel: bool) -> dict:
    """The JSON schema a forced call's output follows: a named function's arguments object, or
    for `required` a list of {"name", "parameters"} calls (at most one unless parallel)."""
    parameters = {f["name"]: f.get("parameters") or {"type": "object"} for f in functions}
    if name is not None:
        return parameters[name]
    calls = [{"type": "object", "properties": {"name": {"const": fname}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for fname, schema in parameters.items()]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    return schema if parallel else {**schema, "maxItems": 1}


def forced_calls(text: str) -> list[Call] | None:
    """The calls of a `required` answer (forced_call_schema's list), None if it is not one."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [Call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]
