"""What one linear layer costs on this machine: rows 1/2/5/16 (decode, verify, batches), float32
against bfloat16, torch's F.linear against moespec's `linear` (weight @ xᵀ for 2-32 float32 rows
on the CPU) and against oneDNN's linear over a packed weight (`Linear.pack`, model.pack_linears),
with the weight in cache (the same weight again and again) and out of it (a ring of weights
larger than the last-level cache, as a model's forward streams its layers).

  .venv/bin/python benchmarks/bench_linear.py --threads 2 --out docs/bench/linear.json

Shapes legend: N rows (tokens), out x in the weight.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from moespec.models.layers import PACK_ROWS_HINT, linear, run_packed

SHAPES = [(256, 256), (768, 256), (4096, 256), (4096, 128)]  # attention/MLP projections, lm_heads


def time_linear(weights: list[torch.Tensor], rows: int, passes: int, fn=F.linear) -> float:
    """µs per call of fn(x, weight), cycling through `weights` (one weight: always in cache)."""
    x = torch.randn(rows, weights[0].shape[1]).to(weights[0].dtype)
    for w in weights:
        fn(x, w)
    calls = max(passes, len(weights))
    start = time.perf_counter()
    for i in range(calls):
        fn(x, weights[i % len(weights)])
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold-mb", type=int, default=256, help="total size of the weight ring (above the LLC)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for out_dim, in_dim in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            size = out_dim * in_dim * dtype.itemsize
            ring = [torch.randn(out_dim, in_dim).to(dtype) for _ in range(max(2, args.cold_mb * 2**20 // size))]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in ring]
            for n in (1, 2, 5, 16):
                for name, fn in (("F.linear", F.linear), ("linear", linear), ("packed", run_packed)):
                    if name == "linear" and (dtype != torch.float32 or n == 1):  # the same call as F.linear
                        continue
                    weights = packed if name == "packed" else ring
                    warm, cold = time_linear(weights[:1], n, 2000, fn), time_linear(weights, n, 2000, fn)
                    rows.append({"weight": [out_dim, in_dim], "dtype": str(dtype).removeprefix("torch."),
                                 "rows": n, "call": name, "warm_us": round(warm, 1), "cold_us": round(cold, 1),
                                 "cold_gb_s": round(size / cold / 1e3, 1)})
                    print(json.dumps(rows[-1]))
    report = {"date": str(date.today()), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
