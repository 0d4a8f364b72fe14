"""`benchmarks/bench_shift.py`, printing every sixth decision adaptive speculation takes at one
batch-size bucket (--trace-bucket, default 4), once every chain length has been measured: the
leader and the choice made, the positions a draft would catch up on, each choice's predicted
tokens/s with its step cost (and error), the steps fitted at that batch size and the tokens per
request, the acceptance means per position with their weight, the shifts followed, the bucket's
exploration (steps of steps, loss of seconds) and the measured rates. Takes bench_shift's flags.

  .venv/bin/python benchmarks/trace_shift.py --config configs/smollm2-135m-mtp.yaml \
      --chat-prompts checkpoints/smollm2-135m-mtp-head/data/heldout_prompts.jsonl \
      --modes none,mtp:3,mtp:3@static --phases chat@0,random@1,chat@0 --batch 4 --waves 8 \
      --repeats 3 --threads 1
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_shift  # noqa: E402

from moespec.speculation.adaptive import SpeculationPolicy  # noqa: E402


def describe(policy: SpeculationPolicy, bucket: int, batch_size: int, choice, behind: int) -> str:
    costs = {c: policy.costs.predict(batch_size, c, peek=True) for c in policy.predicted[bucket]}
    rates = " ".join(f"[{c}: {rate:.0f} step {1e3 * costs[c][0]:.1f}±{1e3 * costs[c][1]:.1f} "
                     f"n{policy.costs.count_at(c, batch_size)} tok {(policy.acceptance.tokens(c) or (0, 0))[0]:.2f}]"
                     for c, rate in policy.predicted[bucket].items())
    positions = [f"{p.mean:.2f}/{p.weight:.0f}" for p in policy.acceptance.positions]
    measured = {c: round(m.rate) for (b, c), m in policy.measures.items() if b == bucket}
    return (f"E{id(policy) % 1000} B{batch_size} leader {policy.leaders.get(bucket)} chose {choice} behind {behind} "
            f"{rates} pos {positions} shifts {policy.acceptance.shifts} "
            f"ex {policy.explored.get(bucket, 0)}/{policy.steps.get(bucket, 0)} "
            f"cost {policy.explored_cost.get(bucket, 0.0):.2f}/{policy.seconds.get(bucket, 0.0):.1f} meas {measured}")


def trace_decisions(at_bucket: int) -> None:
    calls, decide = collections.Counter(), SpeculationPolicy.decide

    def traced(self, bucket, batch_size, k, rooms=None, behind=0):
        choice = decide(self, bucket, batch_size, k, rooms, behind)
        if self.adaptive and bucket == at_bucket:
            calls[id(self)] += 1
            measured = all(self.costs.count(c) >= self.min_samples for c in self.candidates(k))
            if calls[id(self)] % 6 == 0 and measured and self.predicted.get(bucket):
                print(describe(self, bucket, batch_size, choice, behind), flush=True)
        return choice

    SpeculationPolicy.decide = traced


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--trace-bucket", type=int, default=4)
    args, rest = parser.parse_known_args()
    trace_decisions(args.trace_bucket)
    sys.argv = ["bench_shift", *rest]
    bench_shift.main()


if __name__ == "__main__":
    main()
