"""Whole runs of the same workload through several engines, each profiled (cProfile): where a
speculating engine's time goes beyond a plain one's, calls included that a step's timer misses
(admission, sampling, the policy, holding the draft's inputs).

`--modes` as `moespec bench`'s: `none`, `mtp:plain` or `draft:plain` (the speculating engine,
its draft loaded and kept, drafting nothing), `mtp:3` (the config's speculation at k = 3,
adaptive where the config says so). Each run is `4 x --batch` prompts served `--batch` at a time, output
lengths 64 +- 50% as `moespec bench --max-tokens-spread 0.5`, after the bench's warm-up; the
engines run in turn, their order reversed every other run. Prints each run's wall seconds per
engine, then per engine the functions by time spent in them, and the functions whose time
differs most from the first engine's.

  .venv/bin/python benchmarks/profile_whole_runs.py --config configs/smollm2-135m-mtp.yaml --batch 32 \\
      --temperature 0.7 --modes none,mtp:plain,mtp:3 --runs 4 --threads 1 \\
      --chat-prompts checkpoints/smollm2-135m-mtp-head/data/heldout_prompts.jsonl
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from dataclasses import replace

import torch

from moespec.bench import WARMUP_TOKENS, chat_prompts, heldout_prompts, output_lengths, parse_modes
from moespec.config import load_config
from moespec.llm import LLM
from moespec.models import load_tokenizer
from moespec.sampling import SamplingParams


def build(config, spec: dict, batch: int) -> LLM:
    """An engine for a --modes entry's speculation fields (`moespec.bench.parse_mode`)."""
    return LLM(config=replace(config, scheduler=replace(config.scheduler, max_num_seqs=batch),
                              cache=replace(config.cache, prefix_caching=False),
                              speculation=replace(config.speculation, **spec)))


def own_times(profile: cProfile.Profile) -> dict[str, float]:
    """Function (file:line:name) -> seconds spent in it, not in what it calls."""
    return {f"{path.rsplit('/', 1)[-1]}:{line}:{name}": row[2]
            for (path, line, name), row in pstats.Stats(profile).stats.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--modes", default="none,mtp:plain")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--chat-prompts", default=None)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--top", type=int, default=25, help="functions listed per engine and in the difference")
    args = parser.parse_args()
    try:
        specs = dict(parse_modes(args.modes))
    except ValueError as e:
        parser.error(str(e))
    modes = list(specs)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config)
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
    count = 4 * args.batch
    windows = heldout_prompts(tokenizer, count + 1, 64)
    warm = windows[-1]  # never a measured prompt
    prompts = chat_prompts(tokenizer, args.chat_prompts, count) if args.chat_prompts else windows[:count]
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=0)
              for n in output_lengths(count, 64, 0.5)]
    engines = {mode: build(config, specs[mode], args.batch) for mode in modes}
    for llm in engines.values():
        llm.engine.warm_up()
        llm.generate([warm] * args.batch, replace(params[0], max_tokens=WARMUP_TOKENS), use_tqdm=False)
    profiles = {mode: cProfile.Profile() for mode in modes}
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(args.runs):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            start = time.perf_counter()
            profiles[mode].enable()
            engines[mode].generate(prompts, params, use_tqdm=False)
            profiles[mode].disable()
            walls[mode].append(time.perf_counter() - start)
        print(f"run {r}: " + ", ".join(f"{m} {walls[m][-1]:.2f} s" for m in modes), flush=True)
    print("wall seconds over all runs: " + ", ".join(f"{m} {sum(walls[m]):.2f}" for m in modes))
    for mode in modes:
        text = io.StringIO()
        pstats.Stats(profiles[mode], stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"\n=== {mode}\n{text.getvalue()}")
    base = own_times(profiles[modes[0]])
    for mode in modes[1:]:
        times = own_times(profiles[mode])
        diffs = sorted(((times.get(k, 0.0) - base.get(k, 0.0), k) for k in set(base) | set(times)), reverse=True)
        print(f"\n=== {mode} less {modes[0]}: total {sum(times.values()) - sum(base.values()):+.3f} s; most added")
        for diff, key in diffs[:args.top]:
            print(f"{diff:+8.3f} s  {key}")


if __name__ == "__main__":
    main()
