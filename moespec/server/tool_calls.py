"""Tool-call parsers: the function calls in a chat answer, found by their markers.

`server.tool_call_parser` names the format the model writes calls in:
- `deepseek-v3`: DeepSeek-V3's special tokens,
  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
- `hermes`: <tool_call>{"name": NAME, "arguments": {...}}</tool_call> (Hermes/Qwen-style templates).

`ToolCallSplitter` works on text deltas like reasoning.ReasoningSplitter: text that could be
the start of a marker is held back, and what it emits never depends on where the text was
cut. A DeepSeek-V3 call is announced (id, name) once its header `function<｜tool▁sep｜>NAME\n```json\n`
is complete, and its arguments stream as they come (the closing fence and blanks before it
held back); a Hermes call is emitted whole once `</tool_call>` arrives. A call whose body does
not parse stays in the content as the model wrote it.
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
DEEPSEEK_HEADER = re.compile(r"\s*(?:function)?" + re.escape(DEEPSEEK_SEP) + r"(?P<name>[^\n]+)\n```(?:json)?\n")
FENCE_TAIL = re.compile(r"[\s`]*\Z")  # what may close a DeepSeek call's arguments: blanks and its fence


class Call(NamedTuple):
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


class Piece(NamedTuple):
    """What the splitter emits: answer text, a call (its name and first arguments), or more
    arguments of the last call."""

    content: str = ""
    call: Call | None = None
    arguments: str = ""


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
    parse: Callable[[str], Call | None] | None = None  # a whole call's body (between open and close)
    header: re.Pattern | None = None  # or: a call's header (group "name"), its arguments after it


FORMATS = {
    "deepseek-v3": ToolFormat(DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END),
                              header=DEEPSEEK_HEADER),
    "hermes": ToolFormat("<tool_call>", "</tool_call>", (), parse=parse_hermes),
}


class ToolCallSplitter:
    """Incremental tool-call parser: `feed` each text delta, `finish` once at the end."""

    def __init__(self, form: ToolFormat) -> None:
        self.form = form
        self.markers = (form.open, *form.dropped)
        self.pending = ""
        self.state = "text"  # text | call (its body so far is pending) | arguments (a header was read)

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        while self.step(pieces):
            pass
        return [p for p in pieces if p.call is not None or p.content or p.arguments]

    def finish(self) -> list[Piece]:
        rest, state = self.take(len(self.pending)), self.state
        self.state = "text"
        if state == "arguments":
            return [Piece(arguments=FENCE_TAIL.sub("", rest))] if FENCE_TAIL.sub("", rest) else []
        if state == "call":
            call = self.form.parse(rest) if self.form.parse is not None else None
            return [Piece(call=call)] if call is not None else [Piece(self.form.open + rest)]
        return [Piece(rest)] if rest else []

    def step(self, pieces: list[Piece]) -> bool:
        """Emits what the pending text settles; True while more may follow."""
        if self.state == "call":
            return self.read_call(pieces)
        if self.state == "arguments":
            return self.read_arguments(pieces)
        found = [(self.pending.find(m), m) for m in self.markers]
        found = [(at, m) for at, m in found if at >= 0]
        if not found:
            keep = held_length(self.pending, self.markers)
            pieces.append(Piece(self.take(len(self.pending) - keep)))
            return False
        at, marker = min(found)
        pieces.append(Piece(self.take(at)))
        self.take(len(marker))
        self.state = "call" if marker == self.form.open else "text"
        return True

    def read_call(self, pieces: list[Piece]) -> bool:
        """A call's body: up to its header (streamed calls) or its closing marker (whole calls)."""
        end = self.pending.find(self.form.close)
        header = self.form.header.match(self.pending) if self.form.header is not None else None
        if header is not None and (end < 0 or header.end() <= end):
            self.take(header.end())
            pieces.append(Piece(call=Call(header["name"].strip(), "")))
            self.state = "arguments"
            return True
        if end < 0:
            return False
        body = self.take(end)
        self.take(len(self.form.close))
        self.state = "text"
        call = self.form.parse(body) if self.form.parse is not None else None
        pieces.append(Piece(call=call) if call is not None else Piece(self.form.open + body + self.form.close))
        return True

    def read_arguments(self, pieces: list[Piece]) -> bool:
        """A streamed call's arguments, up to the fence and blanks that may close them."""
        end = self.pending.find(self.form.close)
        if end >= 0:
            pieces.append(Piece(arguments=FENCE_TAIL.sub("", self.take(end))))
            self.take(len(self.form.close))
            self.state = "text"
            return True
        settled = self.pending[:len(self.pending) - held_length(self.pending, (self.form.close,))]
        pieces.append(Piece(arguments=self.take(len(FENCE_TAIL.sub("", settled)))))
        return False

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
    """Adjacent content joined, and each call's streamed arguments joined into it."""
    joined: list[Piece] = []
    for piece in pieces:
        if piece.arguments:
            last = joined[-1].call
            joined[-1] = Piece(call=Call(last.name, last.arguments + piece.arguments))
        elif piece.call is None and joined and joined[-1].call is None:
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
