"""Aggregate decode throughput of EP=2 with data-parallel attention against EP=2 with replicated
attention, at the same total batch, through the whole engine (scheduler, KV cache, sampler,
speculator, per-step agreement, request channel).

  .venv/bin/python benchmarks/bench_dp_attention.py --requests 32 --max-tokens 48 --repeats 4 \
      [--spec none,mtp] [--out docs/bench/dp-attention.json]

Two local ranks (processes, gloo) run both layouts on the same process group, taking turns
(dp, replicated, then replicated, dp, ...), so both see the same machine load. Each run adds all
requests at once (greedy, ignore_eos) to rank 0, which places them (dp: over both ranks;
replicated: on both). Decode tokens/s = tokens generated after every request has its first token
/ time from then until the last finishes. The first round of each layout is a warm-up and is not
counted; the median of the rest is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date

from moespec.config import load_config
from moespec.parallel.local_launch import run_ranks

CONFIG = "configs/tiny-deepseek-mtp-ep2.yaml"
PROMPTS = ["def main():", "import os\nimport sys", "class Parser:", "for i in range(", "# utilities for",
           "return self.", "with open(path) as f:", "if __name__ =="]


def engine_config(attention: str, spec: str, args: argparse.Namespace):
    speculation = {"mode": "none"} if spec == "none" else {"mode": "mtp", "num_speculative_tokens": 1,
                                                           "adaptive": False}
    return load_config(CONFIG, {"parallel.attention": attention, "speculation": speculation,
                                "parallel.microbatch": args.microbatch, "parallel.timeout_s": 120})


def run_once(engine, args: argparse.Namespace) -> dict:
    from moespec.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    seqs = [engine.add_request(PROMPTS[i % len(PROMPTS)], params) for i in range(args.requests)]
    decode_start = None
    while engine.has_unfinished():
        engine.step()
        if decode_start is None and all(s.output_ids for s in seqs):
            decode_start, at_start = time.perf_counter(), sum(len(s.output_ids) for s in seqs)
    seconds = time.perf_counter() - decode_start
    tokens = sum(len(s.output_ids) for s in seqs) - at_start
    steps = sum(s.metrics.num_spec_steps for s in seqs)
    accept = (sum(s.metrics.num_accepted_tokens for s in seqs) + steps) / steps if steps else None
    return {"decode_tokens_per_s": tokens / seconds, "decode_s": seconds, "tokens": tokens, "accept_length": accept}


def bench_rank(rank: int, args: argparse.Namespace) -> dict | None:
    import torch

    from moespec.distributed import join_ranks
    from moespec.engine import Engine
    torch.set_num_threads(1)
    ranks = join_ranks(engine_config("dp", "none", args))
    results: dict[str, list[dict]] = {}
    try:
        for spec in args.spec.split(","):
            for rnd in range(args.repeats + 1):
                order = ("dp", "replicated") if rnd % 2 == 0 else ("replicated", "dp")
                for attention in order:
                    config = engine_config(attention, spec, args)
                    ranks.runtime.dp = attention == "dp"
                    engine = Engine(config, ranks=ranks)
                    if ranks.ctx.leader:
                        run = run_once(engine, args)
                        engine.stop_ranks()
                        if rnd:  # round 0 warms both layouts up
                            results.setdefault(f"{spec}/{attention}", []).append(run)
                    else:
                        engine.serve_forever()
    finally:
        ranks.close()
    return results if rank == 0 else None


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for key, values in runs.items():
        rates = [v["decode_tokens_per_s"] for v in values]
        out[key] = {"median_decode_tokens_per_s": statistics.median(rates), "runs": rates,
                    "accept_length": values[-1]["accept_length"]}
    for spec in {key.split("/")[0] for key in runs}:
        dp, rep = out[f"{spec}/dp"], out[f"{spec}/replicated"]
        out[f"{spec}/dp_over_replicated"] = dp["median_decode_tokens_per_s"] / rep["median_decode_tokens_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--spec", default="none,mtp", help="comma list of none, mtp (MTP k=1)")
    parser.add_argument("--microbatch", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = run_ranks(bench_rank, 2, args, timeout_s=3600)
    for result in results:
        if result.error:
            raise SystemExit(f"rank {result.rank} failed: {result.error}")
    summary = summarize(results[0].value)
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "config": CONFIG, "requests": args.requests, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "microbatch": args.microbatch, "results": summary}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
