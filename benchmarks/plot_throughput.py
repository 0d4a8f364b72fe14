"""Predicted decode speed of configs/deepseek-v3.yaml on 16 x H200 (moespec.throughput): tokens/s per
user against tokens/s per GPU across batch sizes for k = 0..3 (a PNG), and the prediction tables of
docs/performance-model.md (MTP speedup at batch 1, 32, 128 per GPU; the exchange two halves hide).

  python benchmarks/plot_throughput.py [--out docs/bench/throughput-16xh200.png] [--context 4096]

Predictions, not measurements: no GPU has run this deployment yet. Needs matplotlib for the PNG.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from moespec import throughput as tp
from moespec.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "deepseek-v3.yaml"
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def deployment(**changes) -> tuple[tp.Architecture, tp.Deployment, int]:
    """The architecture, the deployment as configured on H200s, and the config's draft length."""
    config = load_config(CONFIG, {})
    hf = json.loads((ROOT / config.model.path / "config.json").read_text())
    dep = tp.deployment_from_config(config, tp.GPUS["H200"], "fp8")
    return tp.Architecture.from_hf(hf), replace(dep, **changes), config.speculation.num_speculative_tokens


def curves(arch, dep, context: int, accept: float) -> dict[int, list[tp.Speed]]:
    return {k: [tp.speed(arch, dep, b, context, k, tp.accept_length(accept, k)) for b in BATCHES] for k in range(4)}


def speedup_table(context: int, accept: float) -> str:
    """MTP k = 1..3 speedup per user at 1, 32, 128 requests per GPU, and the exchange hidden."""
    lines = ["| deployment | requests/GPU | k=0 tok/s/user | k=1 | k=2 | k=3 | exchange hidden (k=1) |",
             "|---|---|---|---|---|---|---|"]
    for label, changes in [("as configured (microbatch, eager, no host overlap)", {}),
                           ("CUDA graphs + scheduler overlap", {"cuda_graphs": True, "host_overlap": True}),
                           ("... + two-batch overlap", {"cuda_graphs": True, "host_overlap": True,
                                                        "overlap": "two_batch"}),
                           ("... without microbatching", {"cuda_graphs": True, "host_overlap": True,
                                                         "overlap": "none"})]:
        arch, dep, _ = deployment(**changes)
        for batch in (1, 32, 128):
            s = [tp.speed(arch, dep, batch, context, k, tp.accept_length(accept, k)) for k in range(4)]
            hidden = s[1].hidden_exchange_s / s[1].exchange_s if s[1].exchange_s else 0.0
            lines.append(f"| {label} | {batch} | {s[0].tokens_per_s_per_user:.1f} | "
                         + " | ".join(f"{x.tokens_per_s_per_user / s[0].tokens_per_s_per_user:.2f}x" for x in s[1:])
                         + f" | {hidden:.0%} of {s[1].exchange_s * 1e3:.1f} ms |")
    return "\n".join(lines)


def plot(out: Path, context: int, accept: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arch, dep, _ = deployment(cuda_graphs=True, host_overlap=True)
    fig, ax = plt.subplots(figsize=(7, 5))
    colors = ["C0", "C1", "C2", "C3"]
    for style, d in (("-", dep), (":", replace(dep, overlap="none"))):
        for k, speeds in curves(arch, d, context, accept).items():
            xs = [s.tokens_per_s_per_gpu for s in speeds]
            ys = [s.tokens_per_s_per_user for s in speeds]
            label = f"k={k} (accept {tp.accept_length(accept, k):.2f})" if style == "-" else None
            ax.plot(xs, ys, style, marker="o" if style == "-" else None, color=colors[k], label=label)
            for b, x, y in zip(BATCHES, xs, ys):
                if k == 0 and style == "-":
                    ax.annotate(str(b), (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("output tokens/s per GPU")
    ax.set_ylabel("output tokens/s per user")
    ax.set_title(f"DeepSeek-V3 on 16xH200, EP16 DP attention, microbatch, CUDA graphs\n"
                 f"context {context}, per-draft acceptance {accept} (predicted; labels: requests/GPU;\n"
                 f"dotted: without microbatching)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "throughput-16xh200.png")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--accept", type=float, default=tp.DEFAULT_ACCEPT_RATE)
    args = parser.parse_args()
    print(speedup_table(args.context, args.accept))
    plot(args.out, args.context, args.accept)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
