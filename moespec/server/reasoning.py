"""Reasoning parsers: a reasoning model's output split into its reasoning and its answer.

DeepSeek-R1 thinks between `<think>` and `</think>`; its chat template opens `<think>` in
the prompt, so the output starts inside the reasoning, and a `<think>` at the very start of
the output is dropped too. Everything after the first `</think>` is the answer (`content`);
an output without `</think>` is all reasoning.

`ReasoningSplitter` works on text deltas as they stream: what it emits never depends on
where the output was cut. Text that could be the start of a marker (`</thi` at the end of a
delta) is held back until the next delta shows whether it is one, so a marker cut in two is
never emitted, and the streamed pieces concatenate to `split_reasoning(whole output)`.
"""
from __future__ import annotations

from typing import NamedTuple

REASONING_PARSERS = ("none", "deepseek-r1")
THINK_START, THINK_END = "<think>", "</think>"


class Split(NamedTuple):
    reasoning: str
    content: str


def held_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`
    (text that the next delta may turn into a marker)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class ReasoningSplitter:
    """Incremental deepseek-r1 parser: `feed` each text delta, `finish` once at the end; every
    call returns the (reasoning, content) text it can emit now."""

    def __init__(self, start: str = THINK_START, end: str = THINK_END) -> None:
        self.start, self.end = start, end
        self.pending = ""  # text not emitted yet: a possible marker start
        self.at_start = True  # nothing emitted yet: a leading start marker is still dropped
        self.in_reasoning = True

    def feed(self, text: str) -> Split:
        self.pending += text
        if self.at_start and not self.drop_start():
            return Split("", "")
        if not self.in_reasoning:
            return Split("", self.take(len(self.pending)))
        cut = self.pending.find(self.end)
        if cut >= 0:
            reasoning = self.take(cut)
            self.pending = self.pending[len(self.end):]
            self.in_reasoning = False
            return Split(reasoning, self.take(len(self.pending)))
        return Split(self.take(len(self.pending) - held_length(self.pending, (self.end,))), "")

    def finish(self) -> Split:
        rest = self.take(len(self.pending))
        return Split(rest, "") if self.in_reasoning else Split("", rest)

    def drop_start(self) -> bool:
        """Drops a leading start marker; False while the output so far may still become one."""
        if self.pending.startswith(self.start):
            self.pending = self.pending[len(self.start):]
        elif self.start.startswith(self.pending):
            return False
        self.at_start = False
        return True

    def take(self, count: int) -> str:
        taken, self.pending = self.pending[:count], self.pending[count:]
        return taken


def split_reasoning(text: str) -> Split:
    """The whole output's (reasoning, content): what a splitter fed all of it emits."""
    splitter = ReasoningSplitter()
    first, rest = splitter.feed(text), splitter.finish()
    return Split(first.reasoning + rest.reasoning, first.content + rest.content)


def reasoning_splitter(parser: str) -> ReasoningSplitter | None:
    """The splitter `server.reasoning_parser` names (None for "none")."""
    if parser == "none":
        return None
    if parser == "deepseek-r1":
        return ReasoningSplitter()
    raise ValueError(f"server.reasoning_parser: unknown parser {parser!r}; allowed: {', '.join(REASONING_PARSERS)}")
