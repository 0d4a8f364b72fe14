"""One MoE layer's routed experts in the fixed-capacity layout (`LocalExperts.forward_masked`: x
[L, N, M], the first counts[e] rows of each expert valid) at 5%, 25% and 100% fill, three ways:
  eager     moespec's CPU path outside static steps: the counts read on the host, each expert
            over its valid rows alone (`forward_counted_rows`);
  captured  as inside a captured or compiled step, nothing read on the host: the valid rows
            gathered in front by a device-side order, grouped GEMMs that stop at the counts
            (`forward_valid_rows`);
  every_row the batched matmuls over all L*N rows that both replaced.
Calls take turns (fills and paths interleaved, the order alternating each repeat); each cost is
the median over repeats, and each ratio to 100% fill the median of the per-repeat ratios. The
cost is the process's CPU time (`time.process_time`), which other processes on a shared machine
do not inflate; wall time is recorded beside it. N defaults to configs/deepseek-v3.yaml's rows
per expert (G x C = 16 ranks x 384 tokens); L = 2 of its 16 local experts.

  .venv/bin/python benchmarks/bench_masked_experts.py [--experts 2 --rows 6144 --hidden 7168 \
      --intermediate 2048 --threads 1 --repeats 5] [--out docs/bench/masked-experts-deepseek.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date

import torch

from moespec.models.fp8 import quantize_fp8_block
from moespec.models.layers import CAPTURING
from moespec.models.moe import LocalExperts

FILLS = (0.05, 0.25, 1.0)
KINDS = ("float32", "bfloat16", "fp8")  # weights and activations; fp8: e4m3 weights, float32 activations


def build_experts(kind: str, L: int, M: int, I: int) -> tuple[LocalExperts, torch.dtype]:
    torch.manual_seed(0)
    experts = LocalExperts(L, M, I)
    if kind != "fp8":
        dtype = getattr(torch, kind)
        return experts.to(dtype), dtype
    pairs = {name: [quantize_fp8_block(w) for w in getattr(experts, name).data] for name in ("w13", "w2")}
    experts.to_fp8()
    for name, qs in pairs.items():
        getattr(experts, name).data.copy_(torch.stack([q for q, _ in qs]))
        getattr(experts, f"{name}_scale_inv").data.copy_(torch.stack([s for _, s in qs]))
    return experts, torch.float32


def spread_counts(fill: float, L: int, N: int) -> torch.Tensor:
    """round(fill * L * N) valid rows spread over the experts unevenly (a skewed routing), each <= N."""
    total = round(fill * L * N)
    weights = torch.linspace(2.0, 0.5, L)
    counts = (weights / weights.sum() * total).floor().long().clamp(max=N)
    for e in range(L):  # the remainder, where there is room
        extra = min(N - int(counts[e]), total - int(counts.sum()))
        counts[e] += max(extra, 0)
    return counts


def captured(experts: LocalExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """forward_masked as inside a captured or compiled step (models.layers.fixed_shapes)."""
    token = CAPTURING.set(True)
    try:
        return experts.forward_masked(x, counts)
    finally:
        CAPTURING.reset(token)


def measure(kind: str, L: int, N: int, M: int, I: int, repeats: int) -> dict:
    experts, dtype = build_experts(kind, L, M, I)
    x = torch.randn(L, N, M, dtype=dtype)
    counts = {fill: spread_counts(fill, L, N) for fill in FILLS}
    paths = {"eager": lambda c: experts.forward_masked(x, c), "captured": lambda c: captured(experts, x, c),
             "every_row": lambda c: experts.forward_every_row(x)}
    calls = [(path, fill) for path in paths for fill in FILLS]
    with torch.inference_mode():
        for path, fill in calls:  # warm-up, and the paths agree on the valid rows
            got, want = paths[path](counts[fill]), experts.forward_every_row(x)
            for e, c in enumerate(counts[fill].tolist()):
                torch.testing.assert_close(got[e, :c], want[e, :c], rtol=2e-2, atol=2e-2)
        seconds = {call: [] for call in calls}
        wall = {call: [] for call in calls}
        for r in range(repeats):
            for call in (calls if r % 2 else calls[::-1]):
                start, start_wall = time.process_time(), time.perf_counter()
                paths[call[0]](counts[call[1]])
                seconds[call].append(time.process_time() - start)
                wall[call].append(time.perf_counter() - start_wall)
    result = {"kind": kind}
    for path in paths:
        full = seconds[(path, 1.0)]
        for fill in FILLS:
            ratios = [a / b for a, b in zip(seconds[(path, fill)], full)]
            result[f"{path}_{fill:g}_cpu_ms"] = round(1e3 * statistics.median(seconds[(path, fill)]), 2)
            result[f"{path}_{fill:g}_wall_ms"] = round(1e3 * statistics.median(wall[(path, fill)]), 2)
            result[f"{path}_{fill:g}_over_full"] = round(statistics.median(ratios), 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=2, help="L, local experts")
    parser.add_argument("--rows", type=int, default=6144, help="N = G x C rows per expert")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: per-call costs not blurred by "
                        "thread start-up on a shared machine)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [measure(kind, args.experts, args.rows, args.hidden, args.intermediate, args.repeats)
               for kind in args.kinds]
    report = {"date": date.today().isoformat(), "machine": platform.machine(), "processor": platform.processor(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
              "load_average": [round(x, 2) for x in os.getloadavg()],
              "torch": torch.__version__, "shape": {"L": args.experts, "N": args.rows, "M": args.hidden,
                                                    "I": args.intermediate},
              "repeats": args.repeats, "results": results}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
