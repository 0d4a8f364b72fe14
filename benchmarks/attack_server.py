"""Attacks on a local `moespec serve`, and what they do to everyone else.

Starts `moespec serve` (configs/tiny-deepseek-mtp.yaml unless --config) on 127.0.0.1 only,
then for each attack: a quiet window (no attack) and an attack window, each measuring
/health latency (a probe every 20 ms: p50, p99, max) and an unrelated 16-token completion's
latency (median of the completions sent during the window). Every attack runs in a bounded
loop for a bounded time; nothing leaves the loopback interface.

    .venv/bin/python benchmarks/attack_server.py --out docs/bench/attacks.json

Goal: /health p99 under 50 ms and the unrelated completion under 2x its quiet time during
every attack.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
UNRELATED = {"prompt": "def main():", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


def nested_schema(depth: int) -> dict:
    inner: dict = {"type": "integer"}
    for _ in range(depth):
        inner = {"type": "object", "properties": {"a": inner, "b": {"type": "integer"}}, "required": ["a", "b"]}
    return inner


def schema_body(schema: dict) -> dict:
    return {"prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def post(url: str, path: str, body: bytes | dict, timeout: float = 60) -> int:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        return httpx.post(url + path, content=content, timeout=timeout,
                          headers={"Content-Type": "application/json"}).status_code
    except httpx.HTTPError as e:
        return {httpx.ReadTimeout: -1}.get(type(e), -2)


def repeat(send, stop: threading.Event, limit: int = 1000) -> list[int]:
    """send() until the window ends (at most `limit` times); the statuses."""
    statuses = []
    while not stop.is_set() and len(statuses) < limit:
        statuses.append(send())
    return statuses


def slowloris(url: str, stop: threading.Event, connections: int = 200) -> list[int]:
    """`connections` sockets that each promise a 1 KB body and send a byte a second."""
    socks = []
    for _ in range(connections):
        s = socket.create_connection((HOST, int(url.rsplit(":", 1)[1])))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1024\r\n\r\n{")
        socks.append(s)
    closed = 0
    while not stop.wait(1.0):
        for s in socks:
            try:
                s.sendall(b" ")
            except OSError:
                closed += 1
    for s in socks:
        s.close()
    return [closed]


def attacks(url: str) -> dict:
    """name -> one attacker's loop (a function of the window's stop event)."""
    ids = ("{\"prompt\": [[" + ",".join(["1"] * 14_000_000) + "]], \"max_tokens\": 1}").encode()  # 28 MB
    enum = schema_body({"type": "string", "enum": [f"value-{i}" for i in range(100_000)]})
    distinct = iter(range(10**9))
    return {
        "nested schema N=200": [lambda s: repeat(lambda: post(url, "/v1/completions", schema_body(nested_schema(200))), s)],
        "nested schema N=400": [lambda s: repeat(lambda: post(url, "/v1/completions", schema_body(nested_schema(400))), s)],
        "enum of 100k strings": [lambda s: repeat(lambda: post(url, "/v1/completions", enum), s)],
        "28 MB of token ids x3": [lambda s: repeat(lambda: post(url, "/v1/completions", ids), s)] * 3,
        "distinct schemas x8 (compile flood)": [lambda s: repeat(lambda: post(url, "/v1/completions", schema_body(
            {"type": "object", "properties": {f"k{next(distinct)}": nested_schema(12)}})), s)] * 8,
        "lone surrogates": [lambda s: repeat(lambda: post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "\ud800 x"}], "guided_regex": "\ud800"}), s)],
        "1000 stop strings, 5000-digit max_tokens": [lambda s: repeat(lambda: post(url, "/v1/completions", (
            '{"prompt": "x", "stop": ' + json.dumps(["s"] * 1000) + ', "max_tokens": ' + "9" * 5000 + "}"
        ).encode()), s)],
        "30 MB prompt": [lambda s: repeat(lambda: post(url, "/v1/completions", {"prompt": "x" * 30_000_000}), s)],
        "slowloris x200": [lambda s: slowloris(url, s)],
    }


def measure(url: str, seconds: float, attackers: list) -> dict:
    stop = threading.Event()
    results: list = []
    threads = [threading.Thread(target=lambda a=a: results.append(a(stop)), daemon=True) for a in attackers]
    for t in threads:
        t.start()
    health, completions = [], []
    completer = threading.Thread(target=lambda: completions.extend(unrelated(url, stop)), daemon=True)
    completer.start()
    deadline = time.monotonic() + seconds
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            start = time.monotonic()
            client.get(url + "/health", timeout=60)
            health.append(time.monotonic() - start)
            time.sleep(0.02)
    stop.set()
    completer.join()
    for t in threads:
        t.join(timeout=120)
    statuses: dict[str, int] = {}
    for result in results:
        for status in result:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"health_ms": percentiles(health), "completion_s": round(statistics.median(completions), 3),
            "completions": len(completions), "attack_statuses": statuses}


def unrelated(url: str, stop: threading.Event) -> list[float]:
    times = []
    while not stop.is_set() or not times:
        start = time.monotonic()
        assert post(url, "/v1/completions", UNRELATED) == 200
        times.append(time.monotonic() - start)
        stop.wait(0.2)
    return times


def percentiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    at = lambda q: round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)  # noqa: E731
    return {"p50": at(0.5), "p99": at(0.99), "max": round(1000 * ordered[-1], 1), "n": len(ordered)}


def start_server(config: str, port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "moespec", "serve", "--config", config, "--host", HOST,
                                "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not become healthy")


def machine() -> dict:
    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_average_1m": os.getloadavg()[0],
            "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny-deepseek-mtp.yaml")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--seconds", type=float, default=10.0, help="each quiet and each attack window")
    parser.add_argument("--only", nargs="*", help="attack names to run (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    url = f"http://{HOST}:{args.port}"
    process = start_server(args.config, args.port)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "config": args.config,
              "window_s": args.seconds, "attacks": {}}
    try:
        measure(url, 3, [])  # warm up
        for name, attackers in attacks(url).items():
            if args.only and name not in args.only:
                continue
            quiet = measure(url, args.seconds, [])
            attacked = measure(url, args.seconds, attackers)
            report["attacks"][name] = {"quiet": quiet, "attack": attacked,
                                       "completion_ratio": round(attacked["completion_s"] / quiet["completion_s"], 2)}
            print(name, json.dumps(report["attacks"][name]), flush=True)
    finally:
        process.terminate()
        report["exit_code_after_sigterm"] = process.wait(timeout=120)
        report["machine"]["load_average_1m_after"] = os.getloadavg()[0]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
