"""What a seeded row's keyed Gumbel-max draw costs, per call, against the int64 formulation it
replaced (the same bits: checked here on every shape before timing).

  python benchmarks/bench_keyed_noise.py --threads 1

A seeded request draws each token as argmax_v p_v / -log(u_v) with u keyed by (seed, position,
v): V uniforms per row, so the work grows with rows x vocabulary. A verify step of k drafts over
B seeded requests draws B * (1 + k) rows; for SmolLM2 (V = 49,152) at batch 16 and k = 3 that is
64 rows, about 3.1 million keyed uniforms a step.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from moespec.sampling import GUMBEL_STREAM, MASK32, keyed_gumbel_max, mix32_tensor


def int64_uniforms(seed_keys: torch.Tensor, positions: torch.Tensor, count: int, stream: int) -> torch.Tensor:
    """The int64 formulation: each 32-bit product split in two 16-bit halves, every step a new tensor."""
    row = mix32_tensor(seed_keys ^ mix32_tensor((positions & MASK32) ^ stream))
    salt = mix32_tensor(row ^ 0x68E31DA4)
    column = torch.arange(count, dtype=torch.int64)
    bits = mix32_tensor((mix32_tensor(row[:, None] ^ column) + salt[:, None]) & MASK32)
    return (bits.double() + 0.5) * 2.0 ** -32


def int64_gumbel_max(probs: torch.Tensor, seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (probs.double() / -int64_uniforms(seed_keys, positions, probs.shape[-1], GUMBEL_STREAM).log()).argmax(-1)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", default="1x49152,16x49152,64x49152,16x4096,64x4096,256x4096",
                        help="rows x vocabulary, comma-separated")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for shape in args.shapes.split(","):
        n, vocab = (int(x) for x in shape.split("x"))
        generator = torch.Generator().manual_seed(n * vocab)
        probs = torch.softmax(3 * torch.randn(n, vocab, generator=generator), -1)
        keys = torch.randint(0, 2 ** 32, (n,), generator=generator)
        positions = torch.randint(0, 2 ** 32, (n,), generator=generator)
        if not torch.equal(keyed_gumbel_max(probs, keys, positions), int64_gumbel_max(probs, keys, positions)):
            raise SystemExit(f"{shape}: the draws differ from the int64 formulation")
        before = median_ms(lambda: int64_gumbel_max(probs, keys, positions), args.repeats)
        after = median_ms(lambda: keyed_gumbel_max(probs, keys, positions), args.repeats)
        rows.append({"rows": n, "vocab": vocab, "int64_ms": round(before, 2), "ms": round(after, 2),
                     "speedup": round(before / after, 2)})
        print(f"{n:4d} rows x {vocab:6d}: int64 {before:8.2f} ms   now {after:7.2f} ms   {before / after:5.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "repeats": args.repeats, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
