"""Tool calls and reasoning through the official openai client, on the committed tiny
DeepSeek-V3 (its chat template renders tools in DeepSeek-V3's format) under MTP k=2 and
under a draft tree; forced calls are lossless (greedy equals no speculation), and a grammar
waits for the end of the reasoning."""
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from moespec import LLM, SamplingParams
from moespec.config import build_config
from moespec.engine import Engine
from moespec.server import create_app
from moespec.server.chat import tool_mode
from moespec.server.errors import ApiError
from moespec.server.protocol import ChatCompletionRequest
from moespec.server.tool_calls import forced_call_schema
from test_server import RunningServer, post

DEEPSEEK = str(Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-deepseek-v3")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SPECULATION = {"mtp-k2": {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False},
               "mtp-tree": {"mode": "mtp", "num_speculative_tokens": 3, "adaptive": False,
                            "tree": {"top_k": 2, "depth": 3, "num_draft_tokens": 5}}}
GREEDY = dict(temperature=0.0, max_completion_tokens=60)


def serve(speculation: dict | None, **server):
    config = build_config({}, {"model": DEEPSEEK, "dtype": "float32", "served_model_name": "tiny", "page_size": 16,
                               "num_kv_pages": 256, "max_num_seqs": 16, "speculation": speculation,
                               "server": server})
    engine = Engine(config)
    return RunningServer(engine, create_app(engine, "tiny"))


@pytest.fixture(scope="module", params=list(SPECULATION))
def tools_server(request):
    with serve(SPECULATION[request.param], tool_call_parser="deepseek-v3") as running:
        yield running, openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """The same model without speculation: what greedy forced calls must equal."""
    return LLM(model=DEEPSEEK, dtype="float32", page_size=16, num_kv_pages=256, max_num_seqs=8)


def stream_calls(client, **kwargs) -> tuple[list[dict], str | None, str]:
    calls: list[dict] = []
    finish, content = None, ""
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
                calls[call.index]["arguments"] += call.function.arguments or ""
    return calls, finish, content


def test_named_tool_choice_forces_a_valid_call(tools_server, reference):
    _, client = tools_server
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, **GREEDY)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, finish, content = stream_calls(client, messages=MESSAGES, tools=TOOLS, tool_choice=choice, **GREEDY)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert call.function.arguments == greedy_reference(reference, forced_call_schema(
        [t["function"] for t in TOOLS], "get_weather", True))


def test_required_tool_choice_forces_valid_calls(tools_server, reference):
    _, client = tools_server
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, **GREEDY)
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls
    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    calls, finish, _ = stream_calls(client, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, **GREEDY)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    schema = forced_call_schema([t["function"] for t in TOOLS], None, False)
    expected = json.loads(greedy_reference(reference, schema))
    assert [(call.function.name, json.loads(call.function.arguments))] == [(c["name"], c["parameters"])
                                                                           for c in expected]


def greedy_reference(llm: LLM, schema: dict) -> str:
    prompt = llm.engine.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False,
                                                      add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured={"json": schema})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_tool_conversation_and_auto_choice(tools_server):
    """An assistant's calls and the tool's result go through the template; `auto` parses the
    answer (this model answers in text: no calls, and finish_reason is not tool_calls)."""
    _, client = tools_server
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, **GREEDY)
    assert out.choices[0].finish_reason in ("stop", "length") and not out.choices[0].message.tool_calls
    none = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", **GREEDY)
    assert none.choices[0].message.content


def test_chat_completions_parse_with_a_strict_tool(tools_server):
    from typing import Literal

    import pydantic

    class Weather(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: Literal["Paris", "Tokyo"]
        days: Literal[1, 2, 3]

    _, client = tools_server
    out = client.chat.completions.parse(model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(Weather)],
                                        tool_choice={"type": "function", "function": {"name": "Weather"}},
                                        temperature=0.0, max_completion_tokens=60)
    call = out.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
])
def test_tool_fields_the_server_cannot_honour_are_400s(tools_server, extra, param):
    server, _ = tools_server
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, **extra}, key="none")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_auto_without_a_parser_is_refused():
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    with pytest.raises(ApiError, match="server.tool_call_parser") as e:
        tool_mode(body, "none")
    assert e.value.param == "tool_choice"
    assert tool_mode(body, "hermes") == "parse"


# ---------------------------------------------------------------------- reasoning


@pytest.fixture(scope="module")
def reasoning_server():
    with serve(SPECULATION["mtp-k2"], reasoning_parser="deepseek-r1") as running:
        yield running, openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0, timeout=120)


def stream_reasoning(client, **kwargs) -> list[tuple[str, str, str | None]]:
    per_choice: dict[int, list] = {}
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            got = per_choice.setdefault(choice.index, ["", "", None])
            extra = choice.delta.model_extra or {}
            assert not (extra.get("reasoning_content") and choice.delta.content)  # never in one chunk
            assert extra.get("reasoning_content") == extra.get("reasoning")
            got[0] += extra.get("reasoning_content") or ""
            got[1] += choice.delta.content or ""
            got[2] = choice.finish_reason or got[2]
    return [tuple(per_choice[i]) for i in sorted(per_choice)]


def test_reasoning_streams_as_it_answers_with_n_stop_and_logprobs(reasoning_server):
    _, client = reasoning_server
    kwargs = dict(messages=MESSAGES, n=2, temperature=0.8, seed=5, max_completion_tokens=30, stop=["\n\n"],
                  logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(model="tiny", **kwargs)
    whole = [((c.message.model_extra["reasoning_content"] or ""), c.message.content or "", c.finish_reason)
             for c in out.choices]
    assert all(c.message.model_extra["reasoning"] == c.message.model_extra["reasoning_content"] for c in out.choices)
    assert all(len(c.logprobs.content) > 0 for c in out.choices)
    assert stream_reasoning(client, **kwargs) == whole
    assert any(r for r, _, _ in whole)  # this model never closes its reasoning: all of it is reasoning


def test_a_response_format_leaves_the_reasoning_free(reasoning_server):
    """The grammar waits for </think>: before it the output is what it is without a grammar."""
    _, client = reasoning_server
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    held = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, **GREEDY)
    assert held.choices[0].message.model_extra["reasoning_content"] == free.choices[0].message.model_extra[
        "reasoning_content"]
    assert not free.choices[0].message.model_extra["reasoning_content"].lstrip().startswith("{")


def test_reasoning_ends_at_the_first_think_end_through_the_server(reasoning_server):
    """</think> in the output (its four tokens made likelier by logit_bias, sampled with a seed):
    reasoning_content is the raw output before the first one, content what follows it, streamed
    or not. The raw output is /v1/completions' for the same prompt tokens and sampling."""
    server, client = reasoning_server
    tokenizer = server.engine.tokenizer
    bias = {str(t): 8 for t in tokenizer.encode("</think>", add_special_tokens=False)}
    kwargs = dict(n=8, temperature=1.0, seed=3, max_tokens=20, logit_bias=bias)
    prompt = post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES}, key="none").json()["tokens"]
    raw = [c.text for c in client.completions.create(model="tiny", prompt=prompt, **kwargs).choices]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
    whole = [(c.message.model_extra["reasoning_content"] or "", c.message.content or "", c.finish_reason)
             for c in chat.choices]
    assert [(r, c) for r, c, _ in whole] == [(text.partition("</think>")[0], text.partition("</think>")[2])
                                             for text in raw]
    assert any("</think>" in text for text in raw) and any(c for _, c, _ in whole)
    assert stream_reasoning(client, messages=MESSAGES, **kwargs) == whole


@pytest.mark.parametrize("speculation", [None, *SPECULATION])
def test_a_gated_grammar_constrains_only_after_its_marker(reference, speculation):
    """structured_after: the output up to the token that completes the marker is the free output,
    the rest follows the schema; greedy speculation equals none."""
    llm = reference if speculation is None else LLM(model=DEEPSEEK, dtype="float32", page_size=16, num_kv_pages=256,
                                                    speculation=SPECULATION[speculation])
    prompt = "def parse(text):\n"
    free = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    marker = llm.engine.tokenizer.decode(free.token_ids[:4])
    params = SamplingParams(temperature=0.0, max_tokens=80, structured={"json": WEATHER}, structured_after=marker)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:4] == free.token_ids[:4]
    assert out.text.startswith(marker) and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text[len(marker):]), WEATHER)
    if speculation is not None:
        ref = reference.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref.token_ids
