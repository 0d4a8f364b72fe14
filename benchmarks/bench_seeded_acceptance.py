"""Accept length of seeded requests (keyed Gumbel-max, accepted on exact agreement with the
target's own draw) against unseeded ones (rejection sampling), same drafts, same prompts.

  python benchmarks/bench_seeded_acceptance.py --out docs/bench/seeded-acceptance.json

For each drafter and temperature, the held-out prompts run twice through one engine: every
request seeded (seed = its index), then none seeded. Both use the same speculation settings
(draft length k, adaptive off), so the difference is the verification rule alone.
"""
from __future__ import annotations

import argparse
import json
import platform
from dataclasses import replace
from pathlib import Path

import torch

from moespec.machine import run_info

DRAFTERS = {  # name -> (config, overrides)
    "deepseek-mtp-k3": ("configs/tiny-deepseek-mtp.yaml", {"speculation.num_speculative_tokens": 3}),
    "llama-draft-k3": ("configs/tiny-llama-draft.yaml", {"speculation.num_speculative_tokens": 3}),
    "llama-mtp-head-k3": ("configs/tiny-llama-draft.yaml", {"speculation.mode": "mtp", "speculation.num_speculative_tokens": 3,
                                                            "speculation.mtp_head": "checkpoints/tiny-llama-mtp-head"}),
}


def measure(llm, prompts: list[list[int]], params, seeded: bool) -> dict:
    stats = llm.engine.spec_stats
    before = (stats.steps, stats.accepted_tokens, stats.draft_tokens)
    per_prompt = [replace(params, seed=i if seeded else None) for i in range(len(prompts))]
    llm.generate(prompts, per_prompt, use_tqdm=False)
    steps, accepted, drafted = (stats.steps - before[0], stats.accepted_tokens - before[1],
                                stats.draft_tokens - before[2])
    return {"accept_length": (accepted + steps) / steps, "acceptance_rate": accepted / drafted, "steps": steps}


def run(args: argparse.Namespace) -> dict:
    from moespec.bench import heldout_prompts
    from moespec.config import load_config
    from moespec.llm import LLM
    from moespec.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    results = []
    for name in args.drafters.split(","):
        path, overrides = DRAFTERS[name]
        config = load_config(path, {**overrides, "speculation.adaptive": False,
                                    "scheduler.max_num_seqs": args.batch})
        llm = LLM(config=config)
        prompts = heldout_prompts(llm.get_tokenizer(), args.num_prompts, args.prompt_len)
        for temperature in args.temperatures:
            params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True)
            row = {"drafter": name, "temperature": temperature,
                   "seeded": measure(llm, prompts, params, seeded=True),
                   "unseeded": measure(llm, prompts, params, seeded=False)}
            results.append(row)
            print(f"{name:18s} T={temperature:.1f}  accept length seeded {row['seeded']['accept_length']:.2f}  "
                  f"unseeded {row['unseeded']['accept_length']:.2f}", flush=True)
        llm.close()
    return {**run_info(f"{platform.machine()}, {args.threads} threads"),
            "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "batch": args.batch, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/bench/seeded-acceptance.json")
    args = parser.parse_args()
    report = run(args)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
