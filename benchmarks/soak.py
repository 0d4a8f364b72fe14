"""Soak: `moespec serve` under mixed traffic for a while, per speculation mode, with cache pressure.

  python benchmarks/soak.py --minutes 10 --out docs/bench/soak.json

The time is split between deployments (the tiny DeepSeek-V3 with no speculation and with its
MTP layer, tiny Llama with its draft model and with an external MTP head), each served by its
own `moespec serve` process with few KV pages, so that requests are preempted. Client threads
send, until the time is up: completions and chat, greedy and sampled, seeded and not, n > 1,
logprobs, stop strings, streams (some cut mid-way), and requests that must be refused (400/404).
Every answer is checked. Per deployment the report has the requests served, the intended 4xx,
the errors (anything else: must be 0), the preemptions, the server's RSS at start and end, the
KV pages free at the end (must be all of them) and the exit code after SIGTERM (must be 0).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from moespec.machine import run_info

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = {  # name -> (config, overrides)
    "deepseek-none": ("configs/tiny-deepseek-mtp.yaml", ["speculation.mode=none"]),
    "deepseek-mtp": ("configs/tiny-deepseek-mtp.yaml", []),
    "llama-draft": ("configs/tiny-llama-draft.yaml", []),
    "llama-mtp-head": ("configs/tiny-llama-draft.yaml", ["speculation.mode=mtp", "speculation.num_speculative_tokens=3",
                                                         "speculation.mtp_head=checkpoints/tiny-llama-mtp-head"]),
}
PRESSURE = ["cache.num_kv_pages=48", "scheduler.max_num_seqs=16", "model.max_model_len=512"]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "# Read a file line by line\n", "while True:\n    line = input()",
           "def parse(text: str) -> dict:\n    \"\"\"", "try:\n    import json\nexcept ImportError:"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


class Traffic:
    """Client threads sending mixed requests to one server and checking every answer."""

    def __init__(self, url: str, model: str, seed: int) -> None:
        self.url, self.model = url, model
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.served: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.errors: list[str] = []

    def run(self, clients: int, seconds: float, pid: int, every_s: float = 10.0) -> list[float]:
        """Traffic for `seconds`; the server's RSS in MB every `every_s` meanwhile."""
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=self.client, args=(deadline, random.Random(self.rng.random())))
                   for _ in range(clients)]
        for t in threads:
            t.start()
        timeline = [round(rss_mb(pid), 1)]
        while time.monotonic() < deadline:
            time.sleep(min(every_s, max(0.0, deadline - time.monotonic())))
            timeline.append(round(rss_mb(pid), 1))
        for t in threads:
            t.join()
        return timeline

    def client(self, deadline: float, rng: random.Random) -> None:
        kinds = [(self.completion, 5), (self.chat_stream, 3), (self.cut_stream, 1), (self.refused_request, 1)]
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while time.monotonic() < deadline:
                kind = rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]
                try:
                    kind(http, rng)
                except Exception as e:  # a failed request, not a failed soak
                    self.error(f"{kind.__name__}: {type(e).__name__}: {e}")

    def error(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)

    def count(self, counter: Counter, key: str) -> None:
        with self.lock:
            counter[key] += 1

    def sampling(self, rng: random.Random) -> dict:
        body = {"temperature": rng.choice([0.0, 0.7, 1.0]), "max_tokens": rng.randint(4, 96)}
        if rng.random() < 0.5:
            body["seed"] = rng.randint(0, 10**6)
        if rng.random() < 0.3:
            body["top_p"] = 0.9
        if rng.random() < 0.2:
            body["repetition_penalty"] = 1.2
        return body

    def completion(self, http: httpx.Client, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": rng.choice(PROMPTS), **self.sampling(rng), "n": rng.choice([1, 1, 2, 3])}
        stop = None
        if rng.random() < 0.3:
            stop = rng.choice(["\n\n", ")", ":"])
            body["stop"] = [stop]
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
        response = http.post("/v1/completions", json=body)
        if response.status_code != 200:
            return self.error(f"completion: {response.status_code} {response.text[:200]}")
        out = response.json()
        if len(out["choices"]) != body["n"]:
            return self.error(f"completion: {len(out['choices'])} choices for n={body['n']}")
        for choice in out["choices"]:
            if choice["finish_reason"] not in ("stop", "length"):
                return self.error(f"completion: finish_reason {choice['finish_reason']!r}")
            if stop and stop in choice["text"]:
                return self.error(f"completion: stop string {stop!r} leaked into {choice['text']!r}")
            if "logprobs" in body and len(choice["logprobs"]["tokens"]) != len(choice["logprobs"]["token_logprobs"]):
                return self.error("completion: logprobs tokens and values differ in length")
        self.count(self.served, "completion")

    def chat_stream(self, http: httpx.Client, rng: random.Random, cut_after: int | None = None) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                **self.sampling(rng), "stream": True, "stream_options": {"include_usage": True}}
        chunks, done, finish = 0, False, None
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return self.error(f"chat stream: {response.status_code}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return self.error(f"chat stream: {chunk['error']}")
                chunks += 1
                for choice in chunk["choices"]:
                    finish = choice.get("finish_reason") or finish
                if cut_after is not None and chunks >= cut_after:
                    self.count(self.served, "stream cut by the client")
                    return
        if not done or finish not in ("stop", "length"):
            return self.error(f"chat stream: ended without [DONE] or with finish_reason {finish!r}")
        self.count(self.served, "chat stream")

    def cut_stream(self, http: httpx.Client, rng: random.Random) -> None:
        self.chat_stream(http, rng, cut_after=rng.randint(1, 4))

    def refused_request(self, http: httpx.Client, rng: random.Random) -> None:
        body, status = rng.choice([({"prompt": "x", "n": 10**9}, 400), ({"prompt": "x", "temperature": -1}, 400),
                                   ({"prompt": "x", "model": "other"}, 404), ({"prompt": []}, 400),
                                   ({"messages": [{"role": "robot", "content": "x"}]}, 400)])
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = http.post(path, json=body)
        if response.status_code != status:
            return self.error(f"refused request: {response.status_code} instead of {status}")
        self.count(self.refused, str(status))


def soak(name: str, seconds: float, clients: int, seed: int, log_dir: Path) -> dict:
    config, overrides = DEPLOYMENTS[name]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "moespec", "--log-level", "WARNING", "serve", "--config", config,
               "--port", str(port), "--set", "server.drain_timeout_s=20"]
    for override in overrides + PRESSURE:
        command += ["--set", override]
    log = open(log_dir / f"soak-{name}.log", "w")
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        httpx.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=60)
        rss_start = rss_mb(server.pid)
        traffic = Traffic(url, model, seed)
        timeline = traffic.run(clients, seconds, server.pid)
        metrics = wait_idle(url)
        rss_end = rss_mb(server.pid)
        total_pages = int(next(o.split("=")[1] for o in PRESSURE if o.startswith("cache.num_kv_pages")))
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
    return {"deployment": name, "config": config, "overrides": overrides + PRESSURE, "seconds": round(seconds),
            "served": dict(traffic.served), "requests_served": sum(traffic.served.values()),
            "intended_4xx": dict(traffic.refused), "errors": len(traffic.errors), "error_samples": traffic.errors[:5],
            "generated_tokens": metric(metrics, "moespec_generated_tokens_total"),
            "preemptions": metric(metrics, "moespec_preemptions_total"),
            "aborted_sequences": metric(metrics, 'moespec_requests_total\\{finish_reason="abort"\\}'),
            "rss_mb_start": round(rss_start, 1), "rss_mb_end": round(rss_end, 1),
            "rss_mb_every_10s": timeline,
            "kv_pages_free_end": metric(metrics, "moespec_kv_pages_free"), "kv_pages": total_pages,
            "exit_code_after_sigterm": code}


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not become healthy")


def wait_idle(url: str, timeout: float = 60) -> str:
    """/metrics once nothing runs or waits (aborts of cut streams are handed over asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics").text
        busy = metric(text, "moespec_requests_running") + metric(text, "moespec_requests_waiting")
        if not busy or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="total, split between the deployments")
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/bench/soak.json")
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()
    names = args.deployments.split(",")
    seconds = args.minutes * 60 / len(names)
    results = []
    for i, name in enumerate(names):
        result = soak(name, seconds, args.clients, args.seed + i, Path(args.log_dir))
        print(json.dumps(result), flush=True)
        results.append(result)
    report = {**run_info(f"{platform.machine()}, {os.cpu_count()} cores"),
              "minutes": args.minutes, "clients": args.clients, "results": results,
              "requests_served": sum(r["requests_served"] for r in results),
              "errors": sum(r["errors"] for r in results)}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    sys.exit(0 if report["errors"] == 0 and all(r["exit_code_after_sigterm"] == 0 and
                                                   r["kv_pages_free_end"] == r["kv_pages"] for r in results) else 1)


if __name__ == "__main__":
    main()
