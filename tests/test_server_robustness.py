"""No request can stall the server: a random tiny DeepSeek-V3 with its MTP layer behind a real
uvicorn server, sent what an attacker would send. While each is prepared, /health must keep
its pace (nothing slow on the event loop); grammars are bounded, timed, cancelled with their
client and capped in number; every input gets a clean status naming its field and rule."""
import json
import socket
import threading
import time

import httpx
import pytest

from moespec.config import build_config
from moespec.engine import Engine
from moespec.server import create_app
from moespec.structured import StructuredOutputs
from test_server import RunningServer, save_tiny_deepseek_mtp

KEY = {"Authorization": "Bearer k"}
HEALTH_LIMIT_S = 1.0  # a 200-deep schema compiled on the engine's side held /health for seconds; on two loaded
# cores one probe in a few hundred has taken 0.52 s while a compile process started
COMPILE_TIMEOUT_S = 2.0


def nested_schema(depth: int) -> dict:
    """An object nested `depth` deep: xgrammar's parse time grows steeply with it."""
    inner: dict = {"type": "integer"}
    for _ in range(depth):
        inner = {"type": "object", "properties": {"a": inner, "b": {"type": "integer"}}, "required": ["a", "b"]}
    return inner


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mtp")
    save_tiny_deepseek_mtp(path, vocab_size=4096)
    config = build_config({}, {
        "model": str(path), "page_size": 4, "num_kv_pages": 512, "max_model_len": 256, "max_num_seqs": 16,
        "speculation": {"mode": "mtp", "num_speculative_tokens": 2},
        "server": {"grammar_compile_timeout_s": COMPILE_TIMEOUT_S, "max_concurrent_compiles": 1,
                   "max_schema_depth": 2000, "max_schema_bytes": 4 << 20, "max_enum_items": 1000,
                   "body_read_timeout_s": 1.0}})
    engine = Engine(config)
    app = create_app(engine, "tiny", "k")
    with RunningServer(engine, app) as running:
        app.state.server.bodies.wait_ready(timeout=120)
        running.state = app.state.server
        yield running


def post(server, path: str, body: dict | str, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=timeout,
                      headers={**KEY, "Content-Type": "application/json"})


def health_while(server, action) -> tuple[object, list[float]]:
    """action()'s result, and /health's latencies polled every 20 ms while it ran."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(value=action()))
    thread.start()
    latencies = []
    with httpx.Client() as client:
        while thread.is_alive():
            start = time.monotonic()
            assert client.get(f"{server.url}/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    thread.join()
    return result.get("value"), latencies


def warm_compiles(server) -> None:
    """A compile process started (its imports take seconds on a loaded machine) and idle."""
    response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "guided_choice": ["warm"]})
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------------- 1, 2: grammars off the loop, bounded


def test_a_deep_schema_neither_stalls_health_nor_runs_past_its_compile_budget(server):
    """A 300-deep object schema (xgrammar parses it for tens of seconds): /health keeps its pace
    and the request ends at the compile budget with a 400 naming the field and the key."""
    warm_compiles(server)
    body = {"prompt": "x", "max_tokens": 4, "response_format": schema_format(nested_schema(300))}
    start = time.monotonic()
    response, latencies = health_while(server, lambda: post(server, "/v1/completions", body))
    elapsed = time.monotonic() - start
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "response_format", error
    assert "server.grammar_compile_timeout_s" in error["message"] and error["code"] == "grammar_compile_timeout"
    assert elapsed < COMPILE_TIMEOUT_S + 3, elapsed
    assert max(latencies) < HEALTH_LIMIT_S, sorted(latencies)[-5:]


@pytest.mark.parametrize("field, constraint, key", [
    ("response_format", schema_format({"type": "string", "enum": [f"s{i}" for i in range(100_000)]}),
     "server.max_enum_items"),
    ("guided_choice", [f"c{i}" for i in range(2000)], "server.max_enum_items"),
    ("guided_regex", "a" * 20_000, "server.max_grammar_chars"),
    ("guided_json", {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                                      for i in range(40_000)}}, "server.max_schema_bytes"),
])
def test_grammars_over_a_bound_are_refused_up_front_naming_it(server, field, constraint, key):
    start = time.monotonic()
    response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, field: constraint}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and key in error["message"], error
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": schema_format(
        {"type": "object", "properties": {"x": {"type": "integer", "not": {"const": 3}}}})}, "response_format",
     "keyword 'not' at $.properties.x is not enforced by xgrammar"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object", "properties": {"d": {
        "type": "string", "pattern": "^[0-9]{2}(\\.[0-9]{1,4})?$"}}}}, "guided_json",
     "keyword 'pattern' at $.properties.d is not enforced by xgrammar"),
])
def test_a_schema_the_engine_would_serve_loosely_gets_400_naming_keyword_and_path(server, path, body, param, message):
    """Refused where the server compiles (a compile process), before anything is generated."""
    response = post(server, path, {**body, "max_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_schema_depth_bound_of_the_default_config():
    from moespec.config import ServerSection
    from moespec.server.errors import ApiError
    from moespec.server.limits import GrammarLimits
    from moespec.server.protocol import CompletionRequest

    limits = GrammarLimits.build(ServerSection())
    request = CompletionRequest.model_validate({"prompt": "x", "response_format": schema_format(nested_schema(200))})
    with pytest.raises(ApiError, match=r"^response_format: a JSON schema nested 401 deep; at most 32 "
                                       r"\(server.max_schema_depth\)"):
        limits.check(request.grammar())
    limits.check(CompletionRequest.model_validate({"prompt": "x", "guided_json": nested_schema(10)}).grammar())


def compile_processes(server) -> int:
    compiles = server.state.compiles
    return sum(w.process.is_alive() for w in compiles.busy)


def test_a_compile_whose_client_left_is_killed_and_compiles_are_capped(server):
    compiles = server.state.compiles
    compiles.timeout_s = 60.0  # only the client's leaving can end these compiles
    try:
        body = {"prompt": "x", "max_tokens": 4, "response_format": schema_format(nested_schema(301))}
        clients = [threading.Thread(target=lambda: pytest.raises(httpx.ReadTimeout, post, server, "/v1/completions",
                                                                 body, timeout=3)) for _ in range(2)]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert len(compiles.busy) <= 1  # server.max_concurrent_compiles = 1
            time.sleep(0.05)
        for client in clients:
            client.join()
        deadline = time.monotonic() + 10
        while compile_processes(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert compile_processes(server) == 0  # both clients left: no compile runs on
    finally:
        compiles.timeout_s = COMPILE_TIMEOUT_S
    ok = {"prompt": "x", "max_tokens": 8, "temperature": 0, "guided_json": nested_schema(3)}
    first = post(server, "/v1/completions", ok)
    assert first.status_code == 200, first.text
    idle = list(compiles.idle)
    assert post(server, "/v1/completions", ok).status_code == 200
    assert server.state.engine.grammars.cached(StructuredOutputs.unparsed(json=nested_schema(3))) is not None
    assert compiles.idle == idle  # the second request found the grammar in the cache


# ---------------------------------------------------------------------- 4: large bodies off the loop


def test_millions_of_token_ids_do_not_stall_health(server):
    body = '{"prompt": [[' + ",".join(["1"] * 5_000_000) + ']], "max_tokens": 1}'  # 10 MB
    response, latencies = health_while(server, lambda: post(server, "/v1/completions", body))
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "max_model_len" in response.json()["error"]["message"]
    assert max(latencies) < HEALTH_LIMIT_S, sorted(latencies)[-5:]


def test_a_body_that_trickles_in_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        sock.settimeout(10)
        start = time.monotonic()
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "server.body_read_timeout_s" in reply and time.monotonic() - start < 5


# ---------------------------------------------------------------------- 5, 6: clean errors for every input


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 x"}]}, "messages"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "\ud800"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["a", "\udfff"]}}, "structured_outputs"),
])
def test_lone_surrogates_get_400_naming_the_field(server, path, body, param):
    response = post(server, path, {**body, "max_tokens": 2})  # json.dumps writes them as \ud800 escapes
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and "surrogate" in error["message"], error


def test_errors_state_the_rule_and_the_field(server):
    stops = post(server, "/v1/completions", {"prompt": "x", "stop": ["s"] * 1000}).json()["error"]
    assert stops["param"] == "stop" and "16" in stops["message"] and "256" in stops["message"], stops
    digits = post(server, "/v1/completions", '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}")
    error = digits.json()["error"]
    assert digits.status_code == 400 and error["param"] == "max_tokens", error
    assert "5000 digits" in error["message"] and "4300" in error["message"], error


BAD_TEXT = ["\ud800", "a\udfffb", "\ufffe\uffff", "\ufdd0\U0010ffff", "\x00"]


def string_fields(text: str) -> list[tuple[str, dict]]:
    """Every string field of both APIs (and the strings inside their lists and objects) set to text."""
    sampling = [{"model": text}, {"stop": text}, {"stop": [text]}, {"user": text}, {"cache_salt": text},
                {"guided_regex": text}, {"guided_grammar": text}, {"guided_choice": [text]}, {"guided_json": text},
                {"guided_json": {"type": "string", "enum": [text]}}, {"guided_json": {text: 1}},
                {"structured_outputs": {"regex": text}}, {"structured_outputs": {"json": text}},
                {"logit_bias": {text: 1}},
                {"response_format": {"type": "json_schema", "json_schema": {"name": text, "description": text,
                                                                            "schema": {"const": text}}}},
                {"response_format": {"type": text}}]
    message = {"role": "user", "content": "hi"}
    chat = [{"messages": [{"role": "user", "content": text}]}, {"messages": [{"role": text, "content": "x"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
            {"messages": [{"role": "user", "content": "x", "name": text}]},
            *({"messages": [message], **fields} for fields in sampling)]
    completion = [{"prompt": text}, {"prompt": [text, "x"]}, *({"prompt": "x", **fields} for fields in sampling)]
    return [("/v1/chat/completions", body) for body in chat] + [("/v1/completions", body) for body in completion]


def test_fuzzed_text_in_every_string_field_gets_no_5xx(server):
    statuses: dict[int, int] = {}
    with httpx.Client(headers={**KEY, "Content-Type": "application/json"}, timeout=60) as client:
        for text in BAD_TEXT:
            for path, body in string_fields(text):
                response = client.post(f"{server.url}{path}", content=json.dumps({**body, "max_tokens": 2}))
                assert response.status_code < 500, (path, body, response.text)
                assert "error" in response.json() or response.status_code == 200
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
    assert statuses.get(200) and statuses.get(400), statuses  # some texts are served, lone surrogates are not
    server.wait_idle()
