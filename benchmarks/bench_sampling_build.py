"""Host time of one step's sampling tensors for penalized requests: token counts kept across
steps (`TokenCounts`, what the engine does) against counting every row's whole token lists at
every step (what `SamplingBatch.build` does for rows without kept counts), side by side.

  .venv/bin/python benchmarks/bench_sampling_build.py [--rows 16] [--contexts 1000 4000 16000] \
      [--vocab 4096 129280] [--out docs/bench/sampling-build.json]

Each request has a prompt of `context` tokens and repetition, frequency and presence penalties;
a step appends one output token to each and builds the batch (the kept side catches its counts
up first). Both sides run the same steps, interleaved, after the same warm-up; each reports the
median over the steps of its repeats.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from moespec.machine import run_info
from moespec.sampling import SamplingBatch, SamplingParams, TokenCounts


def step_seconds(rows: int, context: int, vocab: int, steps: int, repeats: int) -> dict[str, float]:
    rng = random.Random(0)
    params = [SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
              ] * rows
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(rows)]
    times: dict[str, list[float]] = {"kept": [], "lists": []}
    for _ in range(repeats):
        outputs: list[list[int]] = [[] for _ in range(rows)]
        kept = [TokenCounts(prompt, vocab, "cpu") for prompt in prompts]
        for step in range(steps + 2):  # the first two steps warm up
            for out in outputs:
                out.append(rng.randrange(vocab))
            start = time.perf_counter()
            SamplingBatch.build(params, prompts, outputs, vocab, "cpu",
                                counts=[k.catch_up(out) for k, out in zip(kept, outputs)])
            middle = time.perf_counter()
            SamplingBatch.build(params, prompts, outputs, vocab, "cpu")
            end = time.perf_counter()
            if step >= 2:
                times["kept"].append(middle - start)
                times["lists"].append(end - middle)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 16000])
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 129280])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for vocab in args.vocab:
        for context in args.contexts:
            seconds = step_seconds(args.rows, context, vocab, args.steps, args.repeats)
            row = {"rows": args.rows, "context": context, "vocab": vocab,
                   "kept_ms": round(1e3 * seconds["kept"], 3), "lists_ms": round(1e3 * seconds["lists"], 3),
                   "lists_over_kept": round(seconds["lists"] / seconds["kept"], 2)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
                  "torch": torch.__version__, "statistic": "median over steps of interleaved repeats",
                  "results": results}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
