"""Reasoning and tool-call parsers over every way an output can be cut into deltas: what they
stream concatenates to what they parse from the whole output (a marker cut in two is never
emitted), shown failing for a naive parser that does not hold a marker's start back."""
import itertools
import json
import random

import pytest

from moespec.server.chat import ChatOutput, merge_deltas
from moespec.server.reasoning import THINK_END, ReasoningSplitter, Split, held_length, split_reasoning
from moespec.server.tool_calls import (DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END,
                                       DEEPSEEK_SEP, Call, Piece, forced_call_schema, join_content, parse_tool_calls,
                                       tool_call_splitter)

# "tokens" an output is drawn from: whole markers, markers cut in pieces, and text around them
REASONING_TOKENS = ["<think>", "</think>", "<", "</", "th", "ink", ">", "</thi", "nk>", "a", " b", "\n", '{"x": 1}',
                    "think", "/", "<th", "<thi", "k>\n"]
DEEPSEEK_CALL = (f"{DEEPSEEK_CALL_BEGIN}function{DEEPSEEK_SEP}get_weather\n```json\n" + '{"city": "Paris"}'
                 + f"\n```{DEEPSEEK_CALL_END}")
TOOL_TOKENS = ["hi ", DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN, "function", DEEPSEEK_SEP, "get_weather\n", "```json\n",
               '{"city": ', '"Paris"}', "\n```", DEEPSEEK_CALL_END, DEEPSEEK_CALLS_END, "<｜tool", "▁call", "▁begin｜>",
               "<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "f", "arguments": {"a": 1}}', "\n", "x"]


def groupings(tokens: list[str], rng: random.Random, limit: int = 300):
    """Splits of the tokens into deltas of 1-6 tokens: all of them for short outputs, else a sample."""
    n = len(tokens)
    if n <= 9:
        for cuts in itertools.product([False, True], repeat=max(n - 1, 0)):
            bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
            if all(b - a <= 6 for a, b in zip(bounds, bounds[1:])):
                yield ["".join(tokens[a:b]) for a, b in zip(bounds, bounds[1:])]
        return
    for _ in range(limit):
        deltas, i = [], 0
        while i < n:
            size = rng.randint(1, 6)
            deltas.append("".join(tokens[i:i + size]))
            i += size
        yield deltas


def char_splits(text: str, rng: random.Random, count: int = 20):
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def all_splits(tokens: list[str], rng: random.Random):
    yield from groupings(tokens, rng)
    yield from char_splits("".join(tokens), rng)


def stream_reasoning(splitter, deltas: list[str]) -> Split:
    parts = [splitter.feed(d) for d in deltas] + [splitter.finish()]
    return Split("".join(p.reasoning for p in parts), "".join(p.content for p in parts))


class NaiveReasoning:
    """What not to do: looks for the markers in each delta alone, emitting a cut marker as text."""

    def __init__(self) -> None:
        self.in_reasoning = True

    def feed(self, text: str) -> Split:
        if self.in_reasoning and THINK_END in text:
            before, after = text.split(THINK_END, 1)
            self.in_reasoning = False
            return Split(before.removeprefix("<think>"), after)
        return Split(text.removeprefix("<think>"), "") if self.in_reasoning else Split("", text)

    def finish(self) -> Split:
        return Split("", "")


def consistent(make_splitter, tokens: list[str], rng: random.Random) -> bool:
    whole = split_reasoning("".join(tokens))
    return all(stream_reasoning(make_splitter(), deltas) == whole for deltas in all_splits(tokens, rng))


def random_outputs(alphabet: list[str], count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        yield [rng.choice(alphabet) for _ in range(rng.randint(0, 16))], rng


def test_reasoning_streams_what_it_parses_for_every_split():
    for tokens, rng in random_outputs(REASONING_TOKENS, 150, seed=0):
        assert consistent(ReasoningSplitter, tokens, rng), tokens


def test_the_property_fails_for_a_parser_that_emits_a_cut_marker():
    rng = random.Random(1)
    assert not consistent(NaiveReasoning, ["a", "</thi", "nk>", "b"], rng)
    assert not all(consistent(NaiveReasoning, tokens, rng) for tokens, rng in random_outputs(REASONING_TOKENS, 50, 2))


def test_deepseek_r1_split():
    assert split_reasoning("I think.</think>\n\nThe answer.") == Split("I think.", "\n\nThe answer.")
    assert split_reasoning("<think>hm</think>ok</think>") == Split("hm", "ok</think>")
    assert split_reasoning("still thinking") == Split("still thinking", "")
    assert split_reasoning("<thi") == Split("<thi", "")  # a start marker cut short is text
    splitter = ReasoningSplitter()
    assert splitter.feed("ab</th") == Split("ab", "")  # held back: may be the marker
    assert splitter.feed("ink>{") == Split("", "{")
    assert held_length("x</thin", ("</think>",)) == 6 and held_length("x<", ("</think>",)) == 1


def stream_tools(parser: str, deltas: list[str]) -> list[Piece]:
    splitter = tool_call_splitter(parser)
    pieces = [p for d in deltas for p in splitter.feed(d)] + splitter.finish()
    assert all(p.call is not None or p.content for p in pieces)
    return join_content(pieces)


@pytest.mark.parametrize("parser", ["deepseek-v3", "hermes"])
def test_tool_calls_stream_what_they_parse_for_every_split(parser):
    for tokens, rng in random_outputs(TOOL_TOKENS, 120, seed=3):
        whole = parse_tool_calls(parser, "".join(tokens))
        for deltas in all_splits(tokens, rng):
            assert stream_tools(parser, deltas) == whole, (tokens, deltas)


def test_tool_call_formats_parse():
    text = f"Let me check.{DEEPSEEK_CALLS_BEGIN}{DEEPSEEK_CALL}{DEEPSEEK_CALL}{DEEPSEEK_CALLS_END}"
    call = Call("get_weather", '{"city": "Paris"}')
    assert parse_tool_calls("deepseek-v3", text) == [Piece("Let me check."), Piece(call=call), Piece(call=call)]
    hermes = 'ok <tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'
    assert parse_tool_calls("hermes", hermes) == [Piece("ok "), Piece(call=Call("f", '{"a": [1, 2]}'))]
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls("hermes", broken) == [Piece(broken)]  # stays text, as written
    assert parse_tool_calls("hermes", "<tool_call>{") == [Piece("<tool_call>{")]  # cut short


def test_deepseek_arguments_stream_as_they_come():
    splitter = tool_call_splitter("deepseek-v3")
    header = f"{DEEPSEEK_CALLS_BEGIN}{DEEPSEEK_CALL_BEGIN}function{DEEPSEEK_SEP}get_weather\n```json\n"
    assert splitter.feed(header + '{"city": ') == [Piece(call=Call("get_weather", "")), Piece(arguments='{"city":')]
    assert splitter.feed('"Paris"}\n``') == [Piece(arguments=' "Paris"}')]  # the fence's start is held back
    assert splitter.feed(f"`{DEEPSEEK_CALL_END}{DEEPSEEK_CALLS_END}") == []


def test_a_naive_tool_parser_loses_a_cut_marker():
    """Without hold-back, `<tool_` + `call>...` streams the marker as content: the property sees it."""
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    deltas = ["<tool_", text[len("<tool_"):]]
    naive = [Piece(deltas[0])] + parse_tool_calls("hermes", deltas[1])  # each delta parsed on its own
    assert join_content(naive) != parse_tool_calls("hermes", text)
    assert stream_tools("hermes", deltas) == parse_tool_calls("hermes", text)


def without_ids(message: dict) -> dict:
    for call in message.get("tool_calls", []):
        call["id"] = "x"
    return message


@pytest.mark.parametrize("mode,tool_parser,forced,text", [
    ("parse", "deepseek-v3", None, f"hm</think>Sure.{DEEPSEEK_CALLS_BEGIN}{DEEPSEEK_CALL}{DEEPSEEK_CALLS_END}"),
    ("parse", "hermes", None, 'hm</think>ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'),
    ("named", "none", "get_weather", 'plan</think>{"city": "Paris"}'),
    ("required", "none", None, 'x</think>[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'),
])
def test_chat_output_streams_the_message_it_returns(mode, tool_parser, forced, text):
    whole_output = ChatOutput("deepseek-r1", mode, tool_parser, forced)
    whole = without_ids(merge_deltas(whole_output.feed(text) + whole_output.finish(), True))
    assert whole["tool_calls"] and whole["reasoning_content"] and whole_output.finish_reason("stop") == "tool_calls"
    rng = random.Random(4)
    for deltas in char_splits(text, rng, 60):
        output = ChatOutput("deepseek-r1", mode, tool_parser, forced)
        streamed = [d for piece in deltas for d in output.feed(piece)] + output.finish()
        assert all(len(d) == 1 or "reasoning" in d for d in streamed)  # reasoning and content never share one
        assert without_ids(merge_deltas(streamed, True)) == whole


def test_forced_call_schemas():
    functions = [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                 {"name": "g"}]
    assert forced_call_schema(functions, "f", True) == functions[0]["parameters"]
    required = forced_call_schema(functions, None, False)
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    json.dumps(required)


def test_parsers_are_config_keys_and_serve_flags():
    from moespec.arguments import load_engine_config
    from moespec.cli import build_parser, parser_overrides
    from moespec.config import ConfigError, build_config
    config = "configs/tiny-deepseek-mtp.yaml"
    args = build_parser(["serve"]).parse_args(["serve", "--config", config, "--reasoning-parser", "deepseek-r1",
                                               "--tool-call-parser", "hermes"])
    server = load_engine_config(args, parser_overrides(args)).server
    assert (server.reasoning_parser, server.tool_call_parser) == ("deepseek-r1", "hermes")
    model = {"model": {"path": "checkpoints/tiny-deepseek-v3"}}
    assert build_config(model).server.reasoning_parser == "none"
    with pytest.raises(ConfigError, match="tool_call_parser"):
        build_config({**model, "server": {"tool_call_parser": "qwen"}})
