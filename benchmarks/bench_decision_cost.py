"""What adaptive speculation's decision costs per step: the same workload through an adaptive
speculating engine per `speculation.adaptive_decide_every` value (1: a decision every step), and
per engine the time spent in `Engine.report` (where the policy decides, with the requests'
rooms and catch-up it reads) per decode step. A run is `--waves`
x `--batch` prompts (the first tokens of held-out text), output lengths 64 +- 50%, after the
bench's warm-up; the engines take turns, run by run.

  .venv/bin/python benchmarks/bench_decision_cost.py --config configs/tiny-deepseek-mtp.yaml \
      --batch 64 --temperature 0.7 --runs 3 --threads 1 --decide-every 1,8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from profile_policy_run import build  # this directory: the script's own

from moespec.bench import WARMUP_TOKENS, heldout_prompts, output_lengths
from moespec.config import load_config
from moespec.llm import LLM
from moespec.models import load_tokenizer
from moespec.sampling import SamplingParams


def timed_reports(llm: LLM) -> list[float]:
    """Wrap the engine's `report`; returns the list its decode steps' seconds are appended to."""
    engine, seconds = llm.engine, []
    report = engine.report

    def timed(scheduled, *args, **kwargs):
        start = time.perf_counter()
        out = report(scheduled, *args, **kwargs)
        if scheduled.chunks and scheduled.is_decode_only:
            seconds.append(time.perf_counter() - start)
        return out
    engine.report = timed
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--k", type=int, default=3, help="the most a step drafts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--decide-every", default="1,8")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config)
    every = [int(n) for n in args.decide_every.split(",")]
    engines = {}
    for n in every:
        spec = replace(config.speculation, num_speculative_tokens=args.k, adaptive=True, adaptive_decide_every=n)
        engines[n] = build(replace(config, speculation=spec), spec.mode, args.batch)
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
    count = args.waves * args.batch
    prompts = [w[:64] for w in heldout_prompts(tokenizer, count + 1, 64)]
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=0)
              for n in output_lengths(count, 64, 0.5)]
    warm = SamplingParams(temperature=args.temperature, max_tokens=WARMUP_TOKENS, ignore_eos=True, seed=0)
    for llm in engines.values():
        llm.generate(prompts[-1:] * args.batch, warm, use_tqdm=False)
    reports = {n: timed_reports(llm) for n, llm in engines.items()}
    for run in range(args.runs):
        for llm in engines.values():
            llm.generate(prompts[:count], params, use_tqdm=False)
    rows = {}
    for n in every:
        rows[n] = {"report_ms_mean": 1000 * statistics.fmean(reports[n]),
                   "report_ms_median": 1000 * statistics.median(reports[n]), "decode_steps": len(reports[n])}
        print(f"decide_every {n}: report {rows[n]['report_ms_mean']:.3f} ms mean, {rows[n]['report_ms_median']:.3f} ms "
              f"median over {len(reports[n])} decode steps")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "batch": args.batch, "temperature": args.temperature,
                       "runs": args.runs, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
