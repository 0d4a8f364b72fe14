"""Expert load balance of EPLB on the tiny DeepSeek checkpoint's real routing.

1. Measured load: the checkpoint's routers over held-out corpus windows (one prefill each),
   routed (token, expert) pairs per MoE layer and expert.
2. DeepSeek-like skew: each layer's router biased (e_score_correction_bias of its busiest
   experts, the top 10%, raised until they take half the pairs; the gate weights are unchanged,
   as the bias only steers the choice).
3. Imbalance (max - mean) / mean of pairs per rank at EP = G: the default placement (expert e on
   rank e // (E/G)) against EPLB with R redundant experts, its placement computed from the first
   half of the windows and measured on the second (rows split over replicas by token position,
   exactly as the runtime's `ReplicaTables.route` does).

    python benchmarks/bench_eplb_balance.py --ep 4 --redundant 4 --windows 64 --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from moespec.model_runner import ModelRunner
from moespec.models import load_model
from moespec.parallel.eplb import ReplicaTables
from moespec.parallel.placement import compute_placement, imbalance, trivial_placement
from moespec.training.evaluate import load_heldout, num_pages_for, target_forward


def routed_ids(model, runner: ModelRunner, windows: torch.Tensor) -> list[torch.Tensor]:
    """One prefill per window -> each MoE layer's top-k ids over all tokens [N*W, A]."""
    routers = [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate")]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda mod, args, out, i=i: seen[i].append(out[0].clone()))
             for i, r in enumerate(routers)]
    try:
        with torch.inference_mode():
            for window in windows:
                target_forward(runner, window[None])
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(ids) for ids in seen]


def counts_of(ids: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """-> pairs per layer and expert [Y, E]."""
    return torch.stack([torch.bincount(i.flatten(), minlength=num_experts) for i in ids])


def bias_hot_experts(model, load: torch.Tensor, share: float, runner, windows: torch.Tensor) -> list[list[int]]:
    """Raise the bias of each layer's top 10% experts until they take `share` of its pairs
    (bisection on one bias for all layers at once, per layer) -> the hot experts per layer."""
    routers = [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate")]
    E = load.shape[1]
    hot = [load[y].argsort(descending=True)[:max(1, math.ceil(0.1 * E))].tolist() for y in range(len(routers))]
    lo, hi = [0.0] * len(routers), [2.0] * len(routers)
    for _ in range(12):
        for y, router in enumerate(routers):
            router.e_score_correction_bias.zero_()
            router.e_score_correction_bias[hot[y]] = (lo[y] + hi[y]) / 2
        counts = counts_of(routed_ids(model, runner, windows), E).double()
        for y in range(len(routers)):
            taken = float(counts[y, hot[y]].sum() / counts[y].sum())
            if taken < share:
                lo[y] = (lo[y] + hi[y]) / 2
            else:
                hi[y] = (lo[y] + hi[y]) / 2
    return hot


def pairs_per_rank(ids: list[torch.Tensor], placement, num_experts: int, max_copies: int) -> torch.Tensor:
    """Pairs each rank's slots receive [Y, G], replicas chosen by token position."""
    tables = ReplicaTables(placement, num_experts, max_copies, torch.device("cpu"))
    rank_of = placement.rank_of_slot()
    rows = []
    for y, layer_ids in enumerate(ids):
        slots = tables.route(y, layer_ids)
        rows.append(torch.bincount(rank_of[slots.flatten()], minlength=placement.num_ranks))
    return torch.stack(rows)


def best_bins(weights: list[float], num_bins: int, best: float) -> float:
    """The least possible heaviest bin of weights split into num_bins bins of equal counts
    (exhaustive, branch and bound: for the small E + R of the tiny model only)."""
    size = len(weights) // num_bins
    order = sorted(weights, reverse=True)

    def search(items: list[float], peak: float, bound: float) -> float:
        if not items:
            return peak
        first, rest = items[0], items[1:]
        for others in itertools.combinations(range(len(rest)), size - 1):
            load = first + sum(rest[i] for i in others)
            if max(peak, load) >= bound:
                continue
            left = [w for i, w in enumerate(rest) if i not in others]
            bound = min(bound, search(left, max(peak, load), bound))
        return bound
    return search(order, 0.0, best)


def optimum_imbalance(load: torch.Tensor, redundant: int, num_ranks: int) -> list[float]:
    """Per layer of load [Y, E]: the least imbalance any placement of E + R slots could reach if
    each expert's rows split evenly over its copies (every way of giving the R extra copies to
    the busiest experts, each packed exhaustively)."""
    out = []
    for row in load.double().tolist():
        busiest = sorted(range(len(row)), key=lambda e: -row[e])[:num_ranks]
        best = float("inf")
        for extra in itertools.combinations_with_replacement(busiest, redundant):
            copies = [1 + extra.count(e) for e in range(len(row))]
            best = min(best, best_bins([row[e] / copies[e] for e in range(len(row)) for _ in range(copies[e])],
                                       num_ranks, best))
        mean = sum(row) / num_ranks
        out.append((best - mean) / mean)
    return out


def measure(path: str, ep: int, redundant: int, windows: int, window_len: int, share: float) -> dict:
    model = load_model(path)
    E = model.config.n_routed_experts
    runner = ModelRunner(model, num_pages_for(1, window_len), 16)
    text = load_heldout(windows, window_len)
    fit, held = text[: len(text) // 2], text[len(text) // 2:]
    natural_ids = routed_ids(model, runner, text)
    natural = counts_of(natural_ids, E)
    hot = bias_hot_experts(model, natural, share, runner, fit)
    fit_ids, held_ids = routed_ids(model, runner, fit), routed_ids(model, runner, held)
    skewed = counts_of(held_ids, E)
    Y = skewed.shape[0]
    default = trivial_placement(Y, E, 0, ep)
    balanced = compute_placement(counts_of(fit_ids, E).double(), redundant, ep,
                                 num_groups=model.config.n_group)
    before = pairs_per_rank(held_ids, default, E, 1)
    after = pairs_per_rank(held_ids, balanced, E, redundant + 1)
    return {"model": path, "ep": ep, "redundant": redundant, "windows": windows, "window_len": window_len,
            "natural_counts": natural.tolist(),
            "natural_imbalance": imbalance(pairs_per_rank(natural_ids, default, E, 1)).tolist(),
            "hot_experts": hot, "hot_share": (skewed.gather(1, torch.tensor(hot)).sum(1) / skewed.sum(1)).tolist(),
            "skewed_counts": skewed.tolist(), "imbalance_before": imbalance(before).tolist(),
            "imbalance_after": imbalance(after).tolist(),
            "ideal_after": imbalance(balanced.rank_loads(skewed.double())).tolist(),
            "best_possible": optimum_imbalance(skewed, redundant, ep) if E + redundant <= 12 else None,
            "placement": balanced.phys_to_log.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/tiny-deepseek-v3")
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--redundant", type=int, default=4)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--window-len", type=int, default=128)
    parser.add_argument("--share", type=float, default=0.5, help="pairs the top 10%% of experts take")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    result = measure(args.model, args.ep, args.redundant, args.windows, args.window_len, args.share)
    natural = torch.tensor(result["natural_counts"], dtype=torch.float64)
    print("measured load (share of each layer's pairs per expert):")
    for y, row in enumerate(natural / natural.sum(1, keepdim=True)):
        print(f"  layer {y}: " + " ".join(f"{v:.3f}" for v in row.tolist()))
    print("skewed: hot share per layer", " ".join(f"{v:.2f}" for v in result["hot_share"]))
    for name in ("natural_imbalance", "imbalance_before", "imbalance_after", "ideal_after", "best_possible"):
        values = result[name]
        if values is None:
            continue
        print(f"{name}: mean {sum(values) / len(values):.3f} max {max(values):.3f} per layer "
              + " ".join(f"{v:.3f}" for v in values))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
