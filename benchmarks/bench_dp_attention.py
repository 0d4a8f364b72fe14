"""Aggregate decode throughput of EP=2 with data-parallel attention against EP=2 with replicated
attention, at the same total batch, through the whole engine (scheduler, KV cache, sampler,
speculator, per-step agreement, request channel); or of EP=2 with data-parallel attention,
serial against overlap scheduling (`--compare overlap`, `scheduler.overlap`), or eager against
compiled steps (`--compare compile`, `model.compile`; buckets of 8 and 16 requests per rank,
every rank compiling them before each run, as `moespec serve` does), or microbatching within
each MoE layer against two-batch overlap (`--compare two_batch`, `parallel.two_batch_overlap`).

  .venv/bin/python benchmarks/bench_dp_attention.py --requests 32 --max-tokens 48 --repeats 4 \
      [--spec none,mtp] [--compare attention|overlap|compile|two_batch] [--out docs/bench/dp-attention.json]

Two local ranks (processes, gloo) run both settings on the same process group, taking turns
(a, b, then b, a, ...), so both see the same machine load. Each run adds all
requests at once (greedy, ignore_eos) to rank 0, which places them (dp: over both ranks;
replicated: on both). Decode tokens/s = tokens generated after every request has its first token
/ time from then until the last finishes. The first round of each layout is a warm-up and is not
counted; the median of the rest is reported. Each setting also reports the share of rank 0's
decode and verify steps' host + device time that ran beside the device (`host_hidden_share`, as
`moespec bench` does: under overlap, the next step scheduled, agreed, packed and planned
meanwhile; 0 without).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from moespec.bench import hidden_share, step_times
from moespec.config import load_config
from moespec.machine import run_info
from moespec.parallel.local_launch import run_ranks

CONFIG = "configs/tiny-deepseek-mtp-ep2.yaml"
PROMPTS = ["def main():", "import os\nimport sys", "class Parser:", "for i in range(", "# utilities for",
           "return self.", "with open(path) as f:", "if __name__ =="]


SETTINGS = {"attention": (("dp", {"parallel.attention": "dp"}), ("replicated", {"parallel.attention": "replicated"})),
            "overlap": (("overlap", {"scheduler.overlap": True}), ("serial", {"scheduler.overlap": False})),
            "compile": (("compiled", {"model.compile": True, "model.compile_batch_sizes": [8, 16]}),
                        ("eager", {"model.compile": False})),
            "two_batch": (("two_batch", {"parallel.two_batch_overlap": True}),
                          ("microbatched", {"parallel.two_batch_overlap": False}))}


def engine_config(setting: dict, spec: str, args: argparse.Namespace):
    speculation = {"mode": "none"} if spec == "none" else {"mode": "mtp", "num_speculative_tokens": 1,
                                                           "adaptive": False}
    return load_config(CONFIG, {"parallel.attention": "dp", **setting, "speculation": speculation,
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
    return {"decode_tokens_per_s": tokens / seconds, "decode_s": seconds, "tokens": tokens, "accept_length": accept,
            "host_hidden_share": hidden_share(*step_times(engine.stats)[1:])}


def bench_rank(rank: int, args: argparse.Namespace) -> dict | None:
    import torch

    from moespec.distributed import join_ranks
    from moespec.engine import Engine
    torch.set_num_threads(1)
    ranks = join_ranks(engine_config({}, "none", args))
    results: dict[str, list[dict]] = {}
    try:
        for spec in args.spec.split(","):
            for rnd in range(args.repeats + 1):
                pair = SETTINGS[args.compare]
                for label, setting in pair if rnd % 2 == 0 else pair[::-1]:
                    config = engine_config(setting, spec, args)
                    engine = Engine(config, ranks=ranks)
                    engine.warm_up()  # model.compile: every bucket now, on every rank (no collectives)
                    if ranks.ctx.leader:
                        run = run_once(engine, args)
                        engine.stop_ranks()
                        if rnd:  # round 0 warms both layouts up
                            results.setdefault(f"{spec}/{label}", []).append(run)
                    else:
                        engine.serve_forever()
    finally:
        ranks.close()
    return results if rank == 0 else None


def summarize(runs: dict[str, list[dict]], compare: str) -> dict:
    out = {}
    for key, values in runs.items():
        rates = [v["decode_tokens_per_s"] for v in values]
        out[key] = {"median_decode_tokens_per_s": statistics.median(rates), "runs": rates,
                    "accept_length": values[-1]["accept_length"],
                    "host_hidden_share": statistics.median(v["host_hidden_share"] for v in values)}
    (a, _), (b, _) = SETTINGS[compare]
    for spec in {key.split("/")[0] for key in runs}:
        out[f"{spec}/{a}_over_{b}"] = (out[f"{spec}/{a}"]["median_decode_tokens_per_s"]
                                       / out[f"{spec}/{b}"]["median_decode_tokens_per_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--spec", default="none,mtp", help="comma list of none, mtp (MTP k=1)")
    parser.add_argument("--microbatch", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compare", choices=sorted(SETTINGS), default="attention",
                        help="attention: dp against replicated; overlap: serial against scheduler.overlap; "
                             "compile: eager against model.compile (both dp); two_batch: microbatched "
                             "within MoE layers against parallel.two_batch_overlap")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = run_ranks(bench_rank, 2, args, timeout_s=3600)
    for result in results:
        if result.error:
            raise SystemExit(f"rank {result.rank} failed: {result.error}")
    summary = summarize(results[0].value, args.compare)
    report = {**run_info(f"{platform.machine()}, {os.cpu_count()} cores"),
              "config": CONFIG, "requests": args.requests, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "microbatch": args.microbatch, "compare": args.compare, "results": summary}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
