"""The HTTP server end to end: the official openai client and httpx against a real uvicorn
server on 127.0.0.1, serving a random tiny DeepSeek-V3 with an MTP layer (mode mtp, k=2)."""
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from moespec.config import build_config
from moespec.engine import Engine
from moespec.sampling import SamplingParams
from moespec.server import create_app
from tiny_models import save_tiny_deepseek

API_KEY = "test-key"
MODEL = "tiny-mtp"
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "tokenizer"
GREEDY = dict(temperature=0.0, max_tokens=10, extra_body={"ignore_eos": True})


def save_tiny_deepseek_mtp(path: Path, vocab_size: int) -> None:
    """A random tiny DeepSeek-V3 with an MTP layer over the project tokenizer's vocabulary."""
    save_tiny_deepseek(path, mtp=True, vocab_size=vocab_size, layers=2)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, engine: Engine, app) -> None:
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished() or self.engine.allocator.num_free != self.engine.allocator.num_pages:
            assert time.monotonic() < deadline, "engine still busy"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mtp")
    save_tiny_deepseek_mtp(path, vocab_size=4096)
    config = build_config({}, {"model": str(path), "served_model_name": MODEL, "page_size": 4, "num_kv_pages": 512,
                               "max_num_seqs": 32, "speculation": {"mode": "mtp", "num_speculative_tokens": 2,
                                                                    "adaptive": False},
                               "server": {"max_waiting_requests": 64}})
    engine = Engine(config)
    app = create_app(engine, MODEL, API_KEY)
    with RunningServer(engine, app) as running:
        app.state.server.bodies.wait_ready(timeout=120)  # its large-body process has imported what it needs
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path: str, body, key: str = API_KEY) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def stream_text(client, **kwargs) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


def test_completion_chat_and_models(client):
    out = client.completions.create(model=MODEL, prompt="def fibonacci(n):", **GREEDY)
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens > 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_prompt_forms_and_n(client):
    texts = client.completions.create(model=MODEL, prompt=["import os", "class A:"], n=2, **GREEDY)
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]
    assert texts.choices[0].text == texts.choices[1].text  # greedy: the n copies agree
    ids = client.completions.create(model=MODEL, prompt=[5, 17, 301], **GREEDY)
    batch = client.completions.create(model=MODEL, prompt=[[5, 17, 301], [9, 9]], **GREEDY)
    assert batch.choices[0].text == ids.choices[0].text and len(batch.choices) == 2
    assert ids.usage.prompt_tokens == 3 and batch.usage.completion_tokens == 20


def test_streaming_matches_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt="for i in range(", **GREEDY)
    assert stream_text(client, prompt="for i in range(", **GREEDY) == (full.choices[0].text, "length")
    messages = [{"role": "user", "content": "write a loop"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_stop_strings(client):
    params = dict(GREEDY, max_tokens=16)
    text = client.completions.create(model=MODEL, prompt="while True:", **params).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    expected = text[: text.index(stop)]
    out = client.completions.create(model=MODEL, prompt="while True:", stop=[stop, "never-there"], **params)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
    assert stream_text(client, prompt="while True:", stop=stop, **params) == (expected, "stop")


def test_seeded_sampling_is_reproducible(client):
    params = dict(prompt="import sys", temperature=1.0, top_p=0.9, max_tokens=12, extra_body={"ignore_eos": True})
    a = client.completions.create(model=MODEL, seed=7, n=2, **params)
    b = client.completions.create(model=MODEL, seed=7, n=2, **params)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    second = client.completions.create(model=MODEL, seed=8, **params)  # choice i is seeded with seed + i
    assert second.choices[0].text == a.choices[1].text


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="x = ", logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                         top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 10
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and bytes(entry.bytes).decode() == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_usage_reports_speculation(client):
    out = client.completions.create(model=MODEL, prompt="def main():", **GREEDY)
    spec = out.usage.model_extra["speculation"]
    assert spec["draft_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert 1.0 <= spec["accept_length"] <= 3.0


def test_usage_reports_cached_prompt_tokens(client, server):
    """OpenAI's usage.prompt_tokens_details.cached_tokens, in both APIs; cache_salt keeps apart."""
    system = "You are a terse assistant who answers in one line. " * 4
    first = client.completions.create(model=MODEL, prompt=system + "Q: sum", **GREEDY)
    again = client.completions.create(model=MODEL, prompt=system + "Q: product", **GREEDY)
    salted = client.completions.create(model=MODEL, prompt=system + "Q: product", temperature=0.0, max_tokens=10,
                                       extra_body={"cache_salt": "x"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 4 == 0
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model=MODEL, messages=messages[:1] + [{"role": "user", "content": "bye"}],
                                          max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    text = httpx.get(f"{server.url}/metrics").text
    hits = float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("moespec_prefix_cache_hits_total")))
    assert hits >= cached
    assert "moespec_prefix_cache_queries_total" in text


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "a", "cache_salt": ""}, 400, "cache_salt"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"prompt": "a", "temperature": "0.5"}, 400, "temperature"),
    ({"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "a", "seed": 1.5}, 400, "seed"),
    ({"prompt": "a", "stop": ""}, 400, "stop"),
    ({"prompt": "a", "stop_token_ids": [5000]}, 400, "stop_token_ids"),
    ({"prompt": "a", "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ({"prompt": "a", "top_p": 2}, 400, "top_p"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"prompt": [1] * 200}, 400, "prompt"),
    ({"prompt": [99999]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"temperature": 0}, 400, "prompt"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "a", "n": 100}, 400, "n"),
    ({"prompt": ["a"] * 129}, 400, "prompt"),
    ({"prompt": ["a"] * 5, "n": 16}, 400, "n"),
    ({"prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt": "a", "echo": True, "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "a", "temperature": 1e400}, 400, "temperature"),
    ({"prompt": "a", "stop": ["x"] * 17}, 400, "stop"),
])
def test_bad_completion_requests(server, body, status, param):
    response = post(server, "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, "prompt_logprobs"),  # never ignored
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
])
def test_bad_chat_requests(server, body, param):
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_malformed_json_auth_and_client_errors(server, client):
    response = post(server, "/v1/completions", '{"prompt": "a",')
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "a"}, key="wrong").status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", extra_body={"top_k": -5})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def stream_one(url: str, index: int, disconnect: bool, results: list) -> None:
    body = {"model": MODEL, "prompt": f"def f{index}(x):", "max_tokens": 24, "stream": True, "ignore_eos": True,
            "temperature": 0.8, "seed": index}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chunks = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                results[index] = "done"
                return
            chunks += 1
            if disconnect and chunks == 2:
                results[index] = "left"
                return  # closing the connection mid-stream


def run_streams(url: str, count: int) -> list:
    """`count` concurrent streams, every fourth one leaving after two chunks: how each ended."""
    results: list = [None] * count
    threads = [threading.Thread(target=stream_one, args=(url, i, i % 4 == 0, results)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    return results


def test_concurrent_streams_with_disconnects_free_every_page(server):
    results = run_streams(server.url, 32)
    assert results.count("done") == 24 and results.count("left") == 8
    server.wait_idle()
    assert server.engine.allocator.num_free == server.engine.allocator.num_pages
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'moespec_requests_total{finish_reason="abort"}' in metrics


def aborted_count(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith('moespec_requests_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_non_streaming_client_that_leaves_is_aborted(server, monkeypatch):
    """The client closes its socket once the engine runs its request, well before 16 x 100 tokens
    are done; the server, polling for the disconnect every 10 ms here, aborts it."""
    monkeypatch.setattr("moespec.server.app.DISCONNECT_POLL_S", 0.01)
    server.wait_idle()
    before = aborted_count(server)
    body = json.dumps({"model": MODEL, "prompt": "import os", "max_tokens": 100, "n": 16, "ignore_eos": True})
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + body.encode())
        deadline = time.monotonic() + 30
        while not server.engine.has_unfinished():
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.001)
    server.wait_idle()
    assert aborted_count(server) > before


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="import re", **GREEDY)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("moespec_requests_total", "moespec_time_to_first_token_seconds_bucket",
                 "moespec_time_per_output_token_seconds_count", "moespec_requests_running", "moespec_requests_waiting",
                 "moespec_kv_cache_usage_ratio", "moespec_spec_accept_length",
                 'moespec_spec_acceptance_rate{position="1"}', "moespec_generated_tokens_total"):
        assert name in text, name


def test_expert_load_needs_expert_parallelism(server):
    response = httpx.get(f"{server.url}/expert_load")  # one process: no EP layers record loads
    assert response.status_code == 404 and "parallel.ep_size > 1" in response.json()["error"]["message"]


def test_openapi_schema(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"):
        assert path in spec["paths"], path
    schemas = spec["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest"} <= set(schemas)
    refs = list(find_refs(spec))
    assert refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref


def find_refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from find_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from find_refs(value)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_requests_that_could_never_fit_are_refused_at_once(server):
    before = rss_bytes()
    for body, param in (({"prompt": "a", "n": 10**9, "max_tokens": 1}, "n"),
                        ({"prompt": ["a"] * 5000, "max_tokens": 1}, "prompt"),
                        ({"prompt": [[1, 2]] * 16, "n": 16, "max_tokens": 1}, "n")):  # 256 sequences > 64 waiting
        start = time.monotonic()
        response = post(server, "/v1/completions", body)
        assert time.monotonic() - start < 1.0
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert rss_bytes() - before < 20 * 2**20
    assert not server.engine.scheduler.waiting


def test_a_huge_prompt_does_not_delay_other_requests(server):
    body = {"prompt": [5, 17, 301], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    assert post(server, "/v1/completions", body).status_code == 200
    alone = time.monotonic() - start
    huge: dict = {}

    def send_huge() -> None:
        start = time.monotonic()
        response = post(server, "/v1/completions", {"prompt": "x" * 10_000_000, "max_tokens": 1})
        huge.update(status=response.status_code, param=response.json()["error"]["param"],
                    seconds=time.monotonic() - start)

    thread = threading.Thread(target=send_huge)
    thread.start()
    start = time.monotonic()
    assert post(server, "/v1/completions", body).status_code == 200
    beside = time.monotonic() - start
    thread.join(timeout=60)
    assert huge["status"] == 400 and huge["param"] == "prompt" and huge["seconds"] < 5, huge
    assert beside < alone + 0.5, (alone, beside)


def test_429_only_while_the_queue_is_full(server):
    """64 sequences: 32 run (max_num_seqs) and 32 wait; 33 more cannot wait now (429) but fit later."""
    first_chunk = threading.Event()

    def fill() -> None:
        body = {"model": MODEL, "prompt": ["import os"] * 4, "n": 16, "max_tokens": 60, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    first_chunk.set()

    filler = threading.Thread(target=fill)
    filler.start()
    assert first_chunk.wait(timeout=60)
    extra = {"prompt": ["a", "b", "c"], "n": 11, "max_tokens": 1}
    response = post(server, "/v1/completions", extra)
    assert response.status_code == 429 and response.json()["error"]["code"] == "too_many_waiting_requests"
    filler.join(timeout=120)
    server.wait_idle()
    assert post(server, "/v1/completions", extra).status_code == 200


def test_overlap_scheduling_under_speculation_serves_streams_and_aborts(tmp_path):
    """scheduler.overlap with MTP behind the server: concurrent streams, a quarter of them
    leaving mid-stream (aborts with a speculative step in flight); greedy text equals the serial
    engine's and every page comes back."""
    save_tiny_deepseek_mtp(tmp_path, vocab_size=4096)
    options = {"model": str(tmp_path), "served_model_name": MODEL, "page_size": 4, "num_kv_pages": 512,
               "max_num_seqs": 8, "speculation": {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}}
    engine = Engine(build_config({}, {**options, "overlap": True}))
    with RunningServer(engine, create_app(engine, MODEL, API_KEY)) as running:
        results = run_streams(running.url, 16)
        assert results.count("done") == 12 and results.count("left") == 4
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        got = client.completions.create(model=MODEL, prompt="def main():", max_tokens=20, temperature=0.0)
        running.wait_idle()
        assert engine.stats.spec_steps > 0 and engine.stats.shifted_steps > 0  # verify steps planned ahead
    serial = Engine(build_config({}, options))
    ref = serial.add_request(serial.encode("def main():"), SamplingParams(temperature=0.0, max_tokens=20))
    while serial.has_unfinished():
        serial.step()
    assert got.choices[0].text == ref.text
