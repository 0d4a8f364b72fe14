"""Where the time of a decode step goes, with and without speculation: wall time per engine step
split over the engine's and the speculator's phases, batch 1, greedy, held-out prompts.

  .venv/bin/python benchmarks/profile_spec_step.py --model checkpoints/tiny-llama \
      --speculation '{"mode": "draft", "draft_model": "checkpoints/tiny-llama-draft", "num_speculative_tokens": 4}'
  .venv/bin/python benchmarks/profile_spec_step.py --model checkpoints/tiny-deepseek-v3 \
      --speculation '{"mode": "mtp", "num_speculative_tokens": 1}' [--compile] --out docs/bench/profile-deepseek-mtp1.json
  .venv/bin/python benchmarks/profile_spec_step.py --model checkpoints/tiny-deepseek-v3 \
      --speculation '{"mode": "mtp", "num_speculative_tokens": 3, "tree": {"top_k": 2, "depth": 3, "num_draft_tokens": 6}}'

Each phase is timed by wrapping the method that implements it; nested phases (the draft's
forward inside `propose`) are reported inside their parent, so the rows do not add up to the
step. Speculation runs with `adaptive: false`, so every decode step speculates.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import platform
import time
from pathlib import Path

import torch

from moespec import LLM, SamplingParams
from moespec.bench import heldout_prompts
from moespec.machine import run_info

# (object path from the engine, method, label)
PHASES = [
    ("", "step", "engine step"),
    ("", "prepare", "pack + plan (plain steps, a chain's verify batch)"),
    ("runner", "plan", "target plan"),
    ("runner", "forward", "target forward (decode or verify)"),
    ("", "execute", "forward + sample (plain steps)"),
    ("speculator", "propose", "propose (draft catch-up + k drafts)"),
    ("speculator", "catch_up", "  draft catch-up"),
    ("speculator", "step", "  draft step (draft model)"),
    ("speculator", "chain_step", "  chain step (MTP k > 1)"),
    ("verifier", "build_verify_batch", "  build verify batch"),
    ("verifier", "verify", "verify (acceptance + final token)"),
    ("speculator", "accept", "accept (MTP re-run over the verify batch)"),
    ("speculator", "propose_tree", "propose tree (draft catch-up + frontier levels)"),
    ("verifier", "build_tree_batch", "build tree verify batch"),
    ("verifier", "tree_draws", "tree: the target's draws at every node"),
    ("verifier", "accept_path", "tree: compact the path's KV + accept it as a chain"),
    ("requests", "append_tokens", "append tokens + stop checks"),
]


def wrap_phases(engine, totals: collections.Counter, calls: collections.Counter) -> None:
    for path, method, label in PHASES:
        owner = getattr(engine, path) if path else engine
        if not hasattr(owner, method):
            continue
        original = getattr(owner, method)

        @functools.wraps(original)
        def timed(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - start
                calls[_label] += 1

        setattr(owner, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--speculation", default=None, help="JSON speculation section (default: none)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="static steps at batch 1 (model.compile), compiled first")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    speculation = {**json.loads(args.speculation), "adaptive": False} if args.speculation else None
    llm = LLM(model=args.model, dtype="float32", speculation=speculation,
              **({"compile": True, "compile_batch_sizes": [1]} if args.compile else {}))
    llm.engine.warm_up()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = heldout_prompts(llm.get_tokenizer(), args.prompts, 64)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    totals, calls = collections.Counter(), collections.Counter()
    wrap_phases(llm.engine, totals, calls)
    start = time.perf_counter()
    tokens = sum(len(out.token_ids) for prompt in prompts for out in llm.generate([prompt], params, use_tqdm=False))
    elapsed = time.perf_counter() - start
    steps = calls["engine step"]
    phases = {label: {"ms_per_step": round(1e3 * totals[label] / steps, 3),
                      "calls_per_step": round(calls[label] / steps, 2)} for label in totals}
    report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
              "model": args.model, "speculation": speculation, "compile": args.compile, "tokens_per_s": round(tokens / elapsed, 1),
              "tokens_per_step": round(tokens / steps, 2), "ms_per_step": round(1e3 * elapsed / steps, 3),
              "phases": phases}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    llm.close()


if __name__ == "__main__":
    main()
