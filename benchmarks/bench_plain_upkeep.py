"""What a plain step costs inside a speculating engine: the same requests stepped through an engine
without speculation (`none`) and one with speculation configured but drafting nothing
(`speculation.schedule: {1: 0}`, so every decode step is plain), the two engines taking turns
step by step in one process.

Both engines get the same prompts and sampling (max_tokens large enough that no request ends
while measured). The prefill steps are timed first, then `--steps` decode steps; each step's
cost is the process's CPU time (`time.process_time`, which another process on a shared machine
does not inflate) and its wall time. The ratio per step is speculating / none, taken step by step
(step i of one engine against step i of the other, which runs the same batch), and reported as
the median over steps, with the totals. An MTP engine's plain step holds the target's hidden
states for its layer.

  .venv/bin/python benchmarks/bench_plain_upkeep.py --config configs/smollm2-135m-mtp.yaml --batch 64 \
      --steps 48 --threads 1 [--chat-prompts FILE] [--out docs/bench/plain-upkeep-steps.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace

import torch

from moespec.bench import chat_prompts, heldout_prompts
from moespec.config import load_config
from moespec.llm import LLM
from moespec.machine import run_info
from moespec.models import load_tokenizer
from moespec.sampling import SamplingParams


def build(config, speculating: bool, batch: int) -> LLM:
    scheduler = replace(config.scheduler, max_num_seqs=batch)
    cache = replace(config.cache, prefix_caching=False)
    if speculating:
        speculation = replace(config.speculation, adaptive=False, schedule={1: 0})
    else:
        speculation = replace(config.speculation, mode="none", tree=None)
    return LLM(config=replace(config, scheduler=scheduler, cache=cache, speculation=speculation))


def timed_step(llm: LLM) -> tuple[float, float, str]:
    """One engine step -> (CPU seconds, wall seconds, the kind of batch it ran)."""
    decode_steps = llm.engine.stats.decode_steps
    cpu, wall = time.process_time(), time.perf_counter()
    llm.engine.step()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu, wall, "decode" if llm.engine.stats.decode_steps > decode_steps else "prefill"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48, help="decode steps measured per engine")
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--chat-prompts", default=None)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config)
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
    if args.chat_prompts:
        prompts = chat_prompts(tokenizer, args.chat_prompts, args.batch)
    else:
        prompts = heldout_prompts(tokenizer, args.batch, args.prompt_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 16, ignore_eos=True, seed=0)
    engines = {"none": build(config, False, args.batch), "plain": build(config, True, args.batch)}
    for llm in engines.values():  # warm-up: one short request through every kind of step
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        for prompt in prompts:
            llm.add(prompt, params)
    steps: dict[str, dict[str, list]] = {label: {"prefill": [], "decode": []} for label in engines}
    while any(len(s["decode"]) < args.steps for s in steps.values()):
        for label, llm in engines.items():
            if len(steps[label]["decode"]) < args.steps:
                cpu, wall, kind = timed_step(llm)
                steps[label]["decode" if kind == "decode" else "prefill"].append((cpu, wall))
    report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"), "config": args.config,
              "batch": args.batch, "steps": args.steps, "temperature": args.temperature, "chat_prompts": args.chat_prompts}
    for phase in ("prefill", "decode"):
        none, plain = steps["none"][phase], steps["plain"][phase]
        n = min(len(none), len(plain))
        for i, what in enumerate(("cpu", "wall")):
            ratios = [p[i] / q[i] for p, q in zip(plain[:n], none[:n])]
            report[f"{phase}_{what}"] = {
                "none_s": sum(q[i] for q in none), "plain_s": sum(p[i] for p in plain),
                "none_step_ms": 1e3 * statistics.median(q[i] for q in none[:n]) if n else None,
                "plain_step_ms": 1e3 * statistics.median(p[i] for p in plain[:n]) if n else None,
                "median_ratio": statistics.median(ratios) if ratios else None, "steps": n}
            print(f"{phase:7s} {what:4s}: " + json.dumps(report[f"{phase}_{what}"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
