"""Where an adaptive speculating engine's decode time goes, run by run: the same workload through
an engine without speculation (`none`) and the config's adaptive one, one after the other, and
per run the speculating engine's steps as its policy records them: plain steps, speculative
steps that measure their choice, and those that do not (a catch-up after plain steps, a
length's cold first steps), each split by whether it ran the bucket's leader or explored, and
what the speculative ones lost against plain decoding (their seconds less the policy's
predicted plain step at their batch size times the tokens they kept per request).

A run is `--waves` x `--batch` prompts (the first tokens of held-out text), output lengths
64 +- 50% as `moespec bench --max-tokens-spread 0.5`, after the bench's warm-up. The ratio is
of whole runs in turn, not interleaved: read it against the time of the parts, not as a speedup.
`--cycle 3,3,0,0,2,2,1,1` scripts the choices instead of the policy, and then reports per draft
length the measured steps in the batch's top half by whether the step was the first at its batch
size (its shapes run for the first time): how many, their mean batch size and median time.

  .venv/bin/python benchmarks/profile_policy_run.py --config configs/tiny-deepseek-mtp.yaml \
      --batch 64 --temperature 0.7 --runs 4 --threads 1 [--cycle 3,3,0,0,2,2,1,1]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import replace

import torch

from moespec.bench import WARMUP_TOKENS, heldout_prompts, output_lengths
from moespec.config import load_config
from moespec.llm import LLM
from moespec.models import load_tokenizer
from moespec.sampling import SamplingParams


def build(config, mode: str, batch: int) -> LLM:
    spec = replace(config.speculation, mode="none", tree=None) if mode == "none" else config.speculation
    return LLM(config=replace(config, scheduler=replace(config.scheduler, max_num_seqs=batch),
                              cache=replace(config.cache, prefix_caching=False), speculation=spec))


def watch(policy, parts: dict, steps: list) -> None:
    """Sum each recorded step's seconds, count and loss against plain decoding into `parts`, by
    kind; list each measured step in `steps` as (batch size, choice, seconds, the first at its
    batch size)."""
    record, seen = policy.record, set()

    def recorded(batch_size, k, tokens, seconds, measures=True, caught_up=0):
        if measures:
            steps.append((batch_size, k, seconds, (k, batch_size) not in seen))
            seen.add((k, batch_size))
        kind = "plain" if k == 0 else "speculative" if measures else "speculative, not measured"
        if k and policy.leaders.get(policy.bucket(batch_size), k) != k:
            kind += ", explored"
        loss = 0.0
        if k and policy.costs.count(0):  # its tokens at plain decoding's predicted step
            loss = seconds - tokens * policy.costs.predict(batch_size, 0, peek=True)[0]
        seconds_so_far, count, lost = parts.get(kind, (0.0, 0, 0.0))
        parts[kind] = (seconds_so_far + seconds, count + 1, lost + loss)
        return record(batch_size, k, tokens, seconds, measures, caught_up)

    policy.record = recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny-deepseek-mtp.yaml")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cycle", default="", help="choices to run in turn instead of the policy's, e.g. 3,3,0,0")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
    prompts = [p[:32] for p in heldout_prompts(tokenizer, args.waves * args.batch + 1, 32)]
    llms = {mode: build(config, mode, args.batch) for mode in ("none", config.speculation.mode)}
    policy, parts, steps = llms[config.speculation.mode].engine.policy, {}, []
    watch(policy, parts, steps)
    if args.cycle:
        choices = itertools.cycle(int(k) for k in args.cycle.split(","))
        policy.choose = lambda batch_size, rooms=None, behind=0: next(choices)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, seed=0)
    for llm in llms.values():
        llm.generate([prompts[-1]] * args.batch, replace(params, max_tokens=WARMUP_TOKENS), use_tqdm=False)
    lengths = output_lengths(args.waves * args.batch, 64, 0.5)
    per_request = [replace(params, max_tokens=n) for n in lengths]
    for run in range(args.runs):
        seconds, first = {}, policy.first_steps
        parts.clear()
        for mode, llm in llms.items():
            start = time.perf_counter()
            llm.generate(prompts[:-1], per_request, use_tqdm=False)
            seconds[mode] = time.perf_counter() - start
        spec = seconds[config.speculation.mode]
        print(f"run {run}: none {seconds['none']:.2f} s, speculating {spec:.2f} s "
              f"({spec / seconds['none']:.3f}x); first measurements {policy.first_steps - first}")
        for kind, (s, n, lost) in sorted(parts.items()):
            print(f"   {kind:36s} {n:4d} steps {s:7.3f} s ({100 * s / spec:4.1f}% of the run)"
                  + (f", {lost:+.3f} s against plain decoding" if kind != "plain" else ""))
    if args.cycle:
        report_first_steps(steps, args.batch)


def report_first_steps(steps: list, batch: int) -> None:
    """Per choice, the measured steps in the batch's top half: the first at their batch size
    against the rest."""
    for k in sorted({step[1] for step in steps}):
        for first in (True, False):
            rows = [(b, s) for b, c, s, f in steps if c == k and f == first and b > batch // 2]
            if rows:
                print(f"k={k} {'first at its batch size' if first else 'repeated':24s} {len(rows):4d} steps, "
                      f"mean batch {statistics.mean(b for b, _ in rows):5.1f}, "
                      f"median {statistics.median(1e3 * s for _, s in rows):6.1f} ms a step")


if __name__ == "__main__":
    main()
