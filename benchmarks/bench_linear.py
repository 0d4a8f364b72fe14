"""What one linear layer costs on this machine: rows 1/2/5/16 (decode, verify, batches), float32
against bfloat16, torch's F.linear against moespec's `linear` (weight @ xᵀ for 2-32 float32 rows
on the CPU) and against oneDNN's linear over a packed weight (`Linear.pack`, model.pack_linears),
with the weight in cache (the same weight again and again) and out of it (a ring of weights
larger than the last-level cache, as a model's forward streams its layers).

  .venv/bin/python benchmarks/bench_linear.py --threads 2 --out docs/bench/linear.json

`--fallback`: a Linear layer as the engine runs it (model.pack_linears), packed as this CPU packs
it against the fallback of a CPU whose oneDNN has no bfloat16 linear (models.layers.pack_dtype:
a bfloat16 weight packed as float32, used from 8 rows) and against no packing at all; bfloat16
and float32, 1 and 16 rows, interleaved repeats, medians. Run it again with
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 for what a CPU without AVX-512 pays:

  .venv/bin/python benchmarks/bench_linear.py --fallback --threads 1 --out docs/bench/linear-fallback.json

Shapes legend: N rows (tokens), out x in the weight.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import moespec.models.layers as layers
from moespec.machine import run_info
from moespec.models.layers import PACK_ROWS_HINT, Linear, linear, onednn_packs, run_packed

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


def time_calls(args: argparse.Namespace) -> list[dict]:
    rows = []
    for out_dim, in_dim in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            size = out_dim * in_dim * dtype.itemsize
            ring = [torch.randn(out_dim, in_dim).to(dtype) for _ in range(max(2, args.cold_mb * 2**20 // size))]
            runs = onednn_packs(dtype)  # this CPU's oneDNN runs the dtype
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in ring] if runs else []
            for n in (1, 2, 5, 16):
                for name, fn in (("F.linear", F.linear), ("linear", linear), ("packed", run_packed)):
                    if name == "linear" and (dtype != torch.float32 or n == 1):  # the same call as F.linear
                        continue
                    weights = packed if name == "packed" else ring
                    if not weights:
                        continue
                    warm, cold = time_linear(weights[:1], n, 2000, fn), time_linear(weights, n, 2000, fn)
                    rows.append({"weight": [out_dim, in_dim], "dtype": str(dtype).removeprefix("torch."),
                                 "rows": n, "call": name, "warm_us": round(warm, 1), "cold_us": round(cold, 1),
                                 "cold_gb_s": round(size / cold / 1e3, 1)})
                    print(json.dumps(rows[-1]))
    return rows


@contextlib.contextmanager
def without_bfloat16():
    """Packing as on a CPU whose oneDNN runs float32 linears only (layers.onednn_packs replaced)."""
    query = layers.onednn_packs
    layers.onednn_packs = lambda dtype: dtype == torch.float32
    try:
        yield
    finally:
        layers.onednn_packs = query


def layer_variants(out_dim: int, in_dim: int, dtype: torch.dtype, count: int) -> dict[str, list[Linear]]:
    """`count` layers of one shape (the ring) in up to three versions over the same weights:
    packed as this CPU packs them, as the fallback packs them, and unpacked."""
    unpacked = [Linear(in_dim, out_dim).to(dtype).requires_grad_(False) for _ in range(count)]
    variants = {"unpacked": unpacked}
    for name in ("packed", "fallback"):
        if dtype != torch.bfloat16 and name == "fallback":  # float32 packs the same either way
            continue
        if name == "packed" and not onednn_packs(dtype):  # here the packed layer is the fallback
            continue
        layers_ = []
        with without_bfloat16() if name == "fallback" else contextlib.nullcontext():
            for source in unpacked:
                layer = Linear(in_dim, out_dim).to(dtype).requires_grad_(False)
                layer.weight = source.weight
                layer.pack()
                layers_.append(layer)
        variants[name] = layers_
    return variants


def time_layers(ring: list[Linear], x: torch.Tensor, passes: int) -> float:
    """µs per forward, cycling through the ring."""
    calls = max(passes, len(ring))
    start = time.perf_counter()
    for i in range(calls):
        ring[i % len(ring)](x)
    return 1e6 * (time.perf_counter() - start) / calls


def time_fallback(args: argparse.Namespace) -> list[dict]:
    """Packed, fallback and unpacked layers over the same weights, interleaved, `repeats` times."""
    rows = []
    for out_dim, in_dim in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            count = max(2, args.cold_mb * 2**20 // (out_dim * in_dim * dtype.itemsize))
            variants = layer_variants(out_dim, in_dim, dtype, count)
            for n in (1, 16):
                x = torch.randn(n, in_dim).to(dtype)
                times = {name: [] for name in variants}
                with torch.inference_mode():
                    for ring in variants.values():
                        time_layers(ring, x, len(ring))  # warm-up
                    for _ in range(args.repeats):
                        for name, ring in variants.items():
                            times[name].append(time_layers(ring, x, args.passes))
                median = {name: statistics.median(t) for name, t in times.items()}
                rows.append({"weight": [out_dim, in_dim], "dtype": str(dtype).removeprefix("torch."), "rows": n,
                             **{f"{name}_us": round(t, 1) for name, t in median.items()},
                             **{f"{name}_vs_unpacked": round(median["unpacked"] / t, 2)
                                for name, t in median.items() if name != "unpacked"}})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold-mb", type=int, default=256, help="total size of the weight ring (above the LLC)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--fallback", action="store_true", help="packed against the fallback (see above)")
    parser.add_argument("--repeats", type=int, default=7, help="--fallback: interleaved repeats")
    parser.add_argument("--passes", type=int, default=400, help="--fallback: forwards per repeat and variant")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = time_fallback(args) if args.fallback else time_calls(args)
    report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
              "statistic": "median of interleaved repeats" if args.fallback else "one run", "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
