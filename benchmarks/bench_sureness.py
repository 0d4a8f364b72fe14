"""`moespec bench` where a mode tagged `@zN` runs with speculation.adaptive_sureness = N (`@dN`:
adaptive_decide_every = N; `@kN`: adaptive_keep_margin = N; `@sN`: adaptive_shift_sigmas = N),
so that the adaptive policy with and without its sureness rule (a decision every step, a keep
margin, a restart on a shift) runs side by side in one bench, on the same prompts and turns
(docs/benchmarks.md, "Drafts start only where known to win", "Decisions held between steps",
"A leading draft keeps a margin", "A shift in workload, and acceptance that restarts"):

  .venv/bin/python benchmarks/bench_sureness.py --config configs/smollm2-135m-mtp.yaml \
      --modes none,mtp:3@z0,mtp:3@z1 --adaptive on --batch-sizes 16,32 --repeats 5 \
      --temperature 0.7 --max-tokens 64 --max-tokens-spread 0.5 --prefix-caching off --threads 1 \
      --turn-seconds 0.5 --chat-prompts checkpoints/smollm2-135m-mtp-head/data/heldout_prompts.jsonl
"""
from __future__ import annotations

import argparse
import logging
import sys

from moespec import bench

parse_mode = bench.parse_mode


def parse_tagged_mode(text: str) -> tuple[str, dict]:
    label, spec = parse_mode(text)
    tag = text.partition("@")[2]
    if tag.startswith("z"):
        spec["adaptive_sureness"] = float(tag[1:])
    elif tag.startswith("d"):
        spec["adaptive_decide_every"] = int(tag[1:])
    elif tag.startswith("k"):
        spec["adaptive_keep_margin"] = float(tag[1:])
    elif tag.startswith("s"):
        spec["adaptive_shift_sigmas"] = float(tag[1:])
    return label, spec


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bench.parse_mode = parse_tagged_mode
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_arguments(parser)
    bench.run(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
