"""What a grammar costs per engine step: constrained (JSON schema) against unconstrained
decoding, side by side, at batch 1 and 16, without speculation and with the MTP layer (k=3).

  python benchmarks/bench_structured.py --out docs/bench/structured.json

Every request generates exactly `max_tokens` tokens in both variants: unconstrained ones with
ignore_eos, constrained ones under a schema that cannot close that soon (an array of at least
50 records with nested objects, enums and bounded integers), so both decode the same number of
tokens from the same prompts. Each repeat runs the two variants back to back (after one
warm-up run of each), so a slow phase of the machine falls on both alike; the table gives the
median over repeats of each run's median decode-step time, the host time spent on grammar masks
per step (filling bitmasks, advancing and rolling back matchers, unpacking on the device), and
the accept length.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from moespec.machine import run_info

RECORD = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "kind": {"enum": ["module", "class", "function"]},
                         "meta": {"type": "object",
                                  "properties": {"line": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                 "public": {"type": "boolean"}},
                                  "required": ["line", "public"]}},
          "required": ["name", "kind", "meta"]}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 50}
MODES = {"none": None, "mtp-k3": {"mode": "mtp", "num_speculative_tokens": 3, "adaptive": False}}


class MaskTimer:
    """Wall time inside the grammar hooks (Grammars.masks, DraftMasks.advance/verify_rows, the
    engine's matcher advance and the device unpack), accumulated while installed."""

    def __init__(self) -> None:
        from moespec import sampling, structured
        self.seconds, self.depth = 0.0, 0  # only the outermost hook counts (advance calls accept)
        self.targets = [(structured.Grammars, "masks"), (structured.DraftMasks, "advance"),
                        (structured.GrammarState, "accept"), (structured.GrammarState, "rollback"),
                        (sampling, "unpack_bitmask")]
        self.originals = [getattr(owner, name) for owner, name in self.targets]
        for (owner, name), original in zip(self.targets, self.originals):
            setattr(owner, name, self.timed(original))

    def timed(self, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            self.depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1
                if not self.depth:
                    self.seconds += time.perf_counter() - start
        return wrapper


def run_once(llm, prompts: list[list[int]], params) -> dict:
    """Generate, stepping the engine by hand; decode steps are those after every prompt's first token."""
    engine, timer = llm.engine, llm.mask_timer
    seqs = [engine.add_request(p, params) for p in prompts]
    stats = engine.spec_stats
    before = (stats.steps, stats.accepted_tokens)
    step_s, mask_s = [], []
    while engine.has_unfinished():
        decoding = all(s.output_ids for s in seqs)
        masked, start = timer.seconds, time.perf_counter()
        engine.step()
        if decoding:
            step_s.append(time.perf_counter() - start)
            mask_s.append(timer.seconds - masked)
    assert all(len(s.output_ids) == params.max_tokens for s in seqs)
    steps, accepted = stats.steps - before[0], stats.accepted_tokens - before[1]
    return {"step_ms": 1e3 * statistics.median(step_s), "mask_ms": 1e3 * statistics.median(mask_s),
            "steps": len(step_s), "accept_length": (accepted + steps) / steps if steps else 1.0}


def run(args: argparse.Namespace) -> dict:
    from moespec.bench import heldout_prompts
    from moespec.llm import LLM
    from moespec.sampling import SamplingParams
    from moespec.structured import StructuredOutputs

    torch.set_num_threads(args.threads)
    timer = MaskTimer()
    variants = {"unconstrained": SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                                ignore_eos=True),
                "json schema": SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                              structured=StructuredOutputs(json=SCHEMA))}
    results = []
    for mode, spec in MODES.items():
        llm = LLM(model=args.model, dtype="float32", speculation=spec, page_size=16, num_kv_pages=1024,
                  max_num_seqs=max(args.batches))
        llm.mask_timer = timer
        for batch in args.batches:
            prompts = heldout_prompts(llm.get_tokenizer(), batch, args.prompt_len)
            runs = {name: [] for name in variants}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for name, params in variants.items():
                    measured = run_once(llm, prompts, params)
                    if repeat:
                        runs[name].append(measured)
            row = {"mode": mode, "batch": batch}
            for name, measured in runs.items():
                row[name] = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
            row["overhead_ms_per_step"] = row["json schema"]["step_ms"] - row["unconstrained"]["step_ms"]
            results.append(row)
            print(f"{mode:7s} batch {batch:3d}  step ms unconstrained {row['unconstrained']['step_ms']:.1f}  "
                  f"json {row['json schema']['step_ms']:.1f} (masks {row['json schema']['mask_ms']:.2f})  "
                  f"accept length {row['unconstrained']['accept_length']:.2f} / "
                  f"{row['json schema']['accept_length']:.2f}", flush=True)
        llm.close()
    return {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
            "model": args.model, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
            "temperature": args.temperature, "repeats": args.repeats, "schema": SCHEMA, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/tiny-deepseek-v3")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/bench/structured.json")
    args = parser.parse_args()
    report = run(args)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
