"""What a speculating engine costs while it decodes plainly: an engine with speculation off
(`mode: none`) against the same config's speculative engine forced to draft nothing
(`speculation.schedule: {1: 0}`, adaptive off), over the same prompts and output lengths. The
two take turns on each batch and the order alternates each repeat; the ratio is the median of
the per-repeat ratios of tokens per second. Near 1.00 means plain steps carry no speculative
upkeep (held MTP hidden states, draft bookkeeping).

  .venv/bin/python benchmarks/bench_plain_upkeep.py --config configs/tiny-deepseek-mtp.yaml \
      --batch-size 64 --temperature 0.7 --repeats 5 [--out docs/bench/plain-upkeep-mtp-b64.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch

from moespec.arguments import load_engine_config
from moespec.bench import heldout_prompts, output_lengths, run_modes
from moespec.llm import LLM
from moespec.machine import run_info
from moespec.models import load_tokenizer
from moespec.sampling import SamplingParams


def build(base, batch_size: int, **speculation) -> LLM:
    return LLM(config=replace(base, scheduler=replace(base.scheduler, max_num_seqs=batch_size),
                              cache=replace(base.cache, prefix_caching=False),
                              speculation=replace(base.speculation, **speculation)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-deepseek-mtp.yaml")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-tokens-spread", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = load_engine_config(argparse.Namespace(config=args.config, overrides=[]))
    B = args.batch_size
    engines = {"none": build(base, B, mode="none"), "plain": build(base, B, schedule={1: 0}, adaptive=False)}
    prompts = heldout_prompts(load_tokenizer(base.model.tokenizer or base.model.path), 2 * B + 1, 64)
    warm, prompts = prompts[-1:] * B, prompts[:2 * B]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    per = [replace(params, max_tokens=n) for n in output_lengths(len(prompts), args.max_tokens, args.max_tokens_spread)]
    for llm in engines.values():
        llm.generate(warm, replace(params, max_tokens=4), use_tqdm=False)
    runs = []
    for r in range(args.repeats):
        order = ["none", "plain"] if r % 2 == 0 else ["plain", "none"]
        rows = run_modes(engines, order, prompts, per, B)
        runs.append({k: round(v["tok_s"], 1) for k, v in rows.items()})
        print(r, runs[-1], round(runs[-1]["plain"] / runs[-1]["none"], 3), flush=True)
    ratios = [run["plain"] / run["none"] for run in runs]
    report = {**run_info(f"{args.threads} thread(s), CPU"), "command": "python benchmarks/bench_plain_upkeep.py "
              f"--config {args.config} --batch-size {B} --temperature {args.temperature} --repeats {args.repeats}",
              "runs": runs, "plain_over_none": [round(x, 3) for x in ratios],
              "median": round(statistics.median(ratios), 3)}
    print("plain / none: median", report["median"], report["plain_over_none"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
