"""`moespec bench`, printing what adaptive speculation did in each repeat: at every exploration
run's start, the leader's and the explored choice's predictions (rate, its relative error, the
step cost and its error, tokens per request and theirs, steps fitted at that bucket), the run's
worth and switch price; after each repeat, the speculating engine's steps by bucket, choice and
kind (measured, a catch-up that is not, explored), with their loss against plain decoding (their
seconds less the policy's predicted plain step at their batch size times the tokens they kept
per request). Takes `moespec bench`'s flags; the modes must include `none` and one adaptive one.

  .venv/bin/python benchmarks/trace_exploration.py --config configs/smollm2-135m-mtp.yaml \
      --modes none,mtp:3 --adaptive on --batch-sizes 64 --repeats 3 --temperature 0.7 \
      --max-tokens 64 --max-tokens-spread 0.5 --prefix-caching off --threads 1 --turn-seconds 0.5 \
      --chat-prompts checkpoints/smollm2-135m-mtp-head/data/heldout_prompts.jsonl
"""
from __future__ import annotations

import argparse
import collections
import sys

from moespec import bench
from moespec.speculation.adaptive import SpeculationPolicy

PARTS: dict = collections.defaultdict(lambda: [0.0, 0, 0.0])  # (bucket, choice, kind) -> seconds, steps, loss


def trace_records(record):
    def recorded(self, batch_size, k, tokens, seconds, measures=True, caught_up=0):
        if self.adaptive and k:
            bucket = self.bucket(batch_size)
            kind = ("measured" if measures else "catch-up") + (", explored" if self.leaders.get(bucket, k) != k else "")
            loss = seconds - tokens * self.costs.predict(batch_size, 0, peek=True)[0] if self.costs.count(0) else 0.0
            part = PARTS[bucket, str(k), kind]
            part[0], part[1], part[2] = part[0] + seconds, part[1] + 1, part[2] + loss
        return record(self, batch_size, k, tokens, seconds, measures, caught_up)
    return recorded


def trace_probes(probe):
    def probed(self, bucket, leader, predictions, switch_s=0.0, unsure=None):
        under_way = bucket in self.runs
        choice = probe(self, bucket, leader, predictions, switch_s, unsure)
        if choice is not None and not under_way:
            batch = self.predicted_batch[bucket]
            for c in (leader, choice):
                p, (s, s_error) = predictions[c], self.costs.predict(batch, c, peek=True)
                tokens, t_error = self.acceptance.tokens(c) or (1.0, 1.0)
                print(f"  batch {batch} choice {c}: {p.rate:.1f} tok/s +-{p.error:.0%}; step {1e3 * s:.1f} ms "
                      f"+-{s_error / s:.0%}; {tokens:.2f} tokens +-{t_error / tokens:.0%}; "
                      f"{self.costs.count_at(c, batch)} steps at the bucket")
            print(f"explore bucket {bucket}: {choice} against {leader}, worth "
                  f"{self.worth(predictions[leader], predictions[choice], switch_s):.3f} s, switch {switch_s:.3f} s, "
                  f"after {self.steps[bucket]} steps", flush=True)
        return choice
    return probed


def trace_repeats(run_modes):
    def ran(*args, **kwargs):
        PARTS.clear()
        rows = run_modes(*args, **kwargs)
        spec = next(label for label in rows if label != "none" and rows[label]["policy_steps"])
        print(f"repeat: {spec} / none {rows[spec]['tok_s'] / rows['none']['tok_s']:.3f}")
        for (bucket, k, kind), (seconds, steps, loss) in sorted(PARTS.items()):
            print(f"   bucket {bucket:3d} k={k} {kind:20s} {steps:4d} steps {seconds:7.3f} s, {loss:+.3f} s against plain")
        return rows
    return ran


def main() -> None:
    SpeculationPolicy.record = trace_records(SpeculationPolicy.record)
    SpeculationPolicy.probe = trace_probes(SpeculationPolicy.probe)
    bench.run_modes = trace_repeats(bench.run_modes)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_arguments(parser)
    bench.run(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
