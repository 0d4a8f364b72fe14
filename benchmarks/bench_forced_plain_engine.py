"""`moespec bench` with its last mode's engine forced to decode plainly: that engine's policy
gets `schedule: {1: 0}` and no adaptation, so the same speculating engine runs side by side
adaptive and never speculating, against `none` and its A/A control in one run (the engines
build one policy each, in the order of `--modes`, for every batch size).

  .venv/bin/python benchmarks/bench_forced_plain_engine.py bench --config configs/smollm2-135m-mtp.yaml \
      --modes none,none@again,mtp:3,mtp:3@plain --adaptive on --batch-sizes 32 --repeats 3 \
      --temperature 0.7 --max-tokens 64 --max-tokens-spread 0.5 --prefix-caching off --threads 1 \
      --turn-seconds 0.5 --chat-prompts checkpoints/smollm2-135m-mtp-head/data/heldout_prompts.jsonl
"""
from __future__ import annotations

import itertools
import sys

import moespec.speculation.adaptive as adaptive
from moespec.cli import main


def force_last_mode_plain(num_modes: int) -> None:
    built, init = itertools.count(), adaptive.SpeculationPolicy.__init__

    def forced(self, max_tokens, schedule=None, adaptive=True, **kwargs):
        if next(built) % num_modes == num_modes - 1:
            schedule, adaptive = {1: 0}, False
        init(self, max_tokens, schedule, adaptive, **kwargs)

    adaptive.SpeculationPolicy.__init__ = forced


if __name__ == "__main__":
    modes = sys.argv[sys.argv.index("--modes") + 1].split(",")
    force_last_mode_plain(len(modes))
    sys.exit(main(sys.argv[1:]))
