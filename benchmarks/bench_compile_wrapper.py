"""Compiled static steps (model.compile) on the CPU with inductor's C++ wrapper, as moespec compiles
them, against inductor's default Python wrapper (the generated function that calls each kernel
and op of the graph), side by side in one process: the same checkpoint, prompts and warm-up, the
two engines taking turns; tokens/s are medians, the ratio the median of the per-repeat ratios.

  .venv/bin/python benchmarks/bench_compile_wrapper.py --model checkpoints/tiny-deepseek-v3 \
      --batch-sizes 1 16 [--out docs/bench/compile-wrapper-tiny-deepseek-v3.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import moespec.static_step as static_step
from moespec import LLM, SamplingParams
from moespec.bench import heldout_prompts
from moespec.machine import run_info


def python_wrapper(compile_fn):
    """torch.compile with inductor's Python wrapper, whatever moespec asks for."""
    def compile_with(fn, **kwargs):
        return compile_fn(fn, **{**kwargs, "options": {**kwargs.get("options", {}), "cpp_wrapper": False}})
    return compile_with


def measure(model: str, batch: int, repeats: int, max_tokens: int) -> dict:
    engines = {}
    for name in ("cpp_wrapper", "python_wrapper"):
        compile_fn = static_step.torch.compile
        if name == "python_wrapper":
            static_step.torch.compile = python_wrapper(compile_fn)
        try:  # each shape compiles in the warm-up, under the wrapper chosen here
            llm = LLM(model=model, page_size=16, num_kv_pages=512, max_num_seqs=batch, compile=True,
                      compile_batch_sizes=[batch])
            llm.engine.warm_up()
        finally:
            static_step.torch.compile = compile_fn
        engines[name] = llm
    prompts = heldout_prompts(engines["cpp_wrapper"].get_tokenizer(), batch, 32)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {name: [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
              for name, llm in engines.items()}  # the warm-up run
    if tokens["cpp_wrapper"] != tokens["python_wrapper"]:
        raise SystemExit("the two wrappers gave different tokens")
    seconds = {name: [] for name in engines}
    for r in range(repeats):
        for name in (list(engines) if r % 2 else list(engines)[::-1]):
            start = time.perf_counter()
            engines[name].generate(prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
    ratios = [p / c for p, c in zip(seconds["python_wrapper"], seconds["cpp_wrapper"])]
    return {"batch": batch, **{f"{name}_tok_s": round(batch * max_tokens / statistics.median(s), 1)
                               for name, s in seconds.items()},
            "cpp_over_python": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/tiny-deepseek-v3")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for batch in args.batch_sizes:
        results.append(measure(args.model, batch, args.repeats, args.max_tokens))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        report = {**run_info(f"{platform.machine()}, {args.threads} threads"),
                  "model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats, "results": results}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
