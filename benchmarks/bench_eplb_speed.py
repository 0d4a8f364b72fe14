"""The MTP verify step at EP = G over the modelled link with skewed routing: EPLB off against on.

  .venv/bin/python benchmarks/bench_eplb_speed.py --ep-size 4 --redundant 4 --requests 64 \
      --row-us 40 --latency-ms 2 --bandwidth-gbs 0.2 [--out bench-eplb-speed.json]

Each rank is a local process (gloo) holding two copies of the same random mid-size DeepSeek-V3
model (bench_ep_overlap.py's): one with the default placement (E / G experts per rank), one with
R redundant experts placed by EPLB. Every router's bias is raised for the top 10% of experts, so
they are chosen by nearly every token (half the pairs at top-4 routing); they are experts 0 and
1, both on rank 0 (the worst case), or random ones with --spread. The EPLB model records
its load over --window steps with the trivial placement, then rebalances (its pause is
reported), then both models take turns step by step.

The experts' compute is modelled as well as run: after a rank's local experts run, its thread
sleeps --row-us per (row, expert) pair it computed, so the rank with the most pairs sets the pace
of every MoE layer as on GPUs. (On this 2-core machine 4 ranks share the cores: real compute
alone would not show who waits for whom.) The link is bench_ep_overlap.py's model. Reported:
the paired medians of step time (off / on, step by step), and the measured imbalance of pairs
per rank for each model.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.distributed as dist

from bench_ep_overlap import bench_config, verify_batch
from moespec.attention import AttentionMetadata, TorchPagedAttention, plan_forward
from moespec.config import EPLBSection, ParallelSection
from moespec.kv_cache import KVCache
from moespec.machine import run_info
from moespec.models import build_model
from moespec.parallel import EPRuntime, LinkModel, ThrottledCollectives, destroy, ep_experts_factory, init_parallel
from moespec.parallel.eplb import ExpertBalancer
from moespec.parallel.local_launch import run_ranks

PAGE_SIZE = 16


def build(config, runtime: EPRuntime, redundant: int, hot_bias: float, spread: bool) -> tuple[torch.nn.Module, list]:
    """The bench model with R redundant slots; every router biased toward its top 10% experts:
    experts 0, 1, ... (all on rank 0 by default: the worst case), or random ones (`spread`)."""
    torch.manual_seed(0)
    model = build_model(config, experts_factory=ep_experts_factory(runtime, redundant)).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    layers = list(model.model.layers)[config.first_k_dense_replace:]
    hot = max(1, round(0.1 * config.n_routed_experts))
    for layer in layers:
        layer.mlp.gate.weight.normal_(0, 0.5, generator=gen)
        order = torch.randperm(config.n_routed_experts, generator=gen) if spread else torch.arange(hot)
        layer.mlp.gate.e_score_correction_bias[order[:hot]] = hot_bias
    return model, [layer.mlp.experts for layer in layers]


def model_compute(experts: list, row_s: float, pairs: list) -> None:
    """After each layer's local experts, sleep row_s per (row, expert) pair computed."""
    for layer in experts:
        compute = layer.compute

        def timed(received, compute=compute):
            out = compute(received)
            n = int((received.local_ids >= 0).sum())
            pairs[0] += n
            time.sleep(n * row_s)
            return out
        layer.compute = timed


def time_step(model, cache, runtime: EPRuntime, batch: tuple, ids: torch.Tensor) -> float:
    qo, kv, indices, last, positions = batch
    meta = AttentionMetadata(qo, kv, indices, last, positions, PAGE_SIZE)
    runtime.stream.run("barrier", dist.barrier, runtime.ctx.ep_group)
    start = time.perf_counter()
    ctx = plan_forward(TorchPagedAttention(), meta, cache.layers, None)
    with torch.no_grad(), runtime.step(qo.tolist(), None):  # the uneven exchange: per-row expert work
        model.compute_logits(model(ids, positions, ctx))
    return time.perf_counter() - start


def bench_rank(rank: int, args: argparse.Namespace) -> dict:
    ctx = init_parallel(ParallelSection(ep_size=args.ep_size, timeout_s=300))
    link = ThrottledCollectives(ctx, LinkModel(args.latency_ms / 1e3, args.bandwidth_gbs * 1e9))
    runtime = EPRuntime(ctx, link, max_tokens_per_rank=2 * args.requests)
    config = bench_config(args)
    off, off_experts = build(config, runtime, 0, args.hot_bias, args.spread)
    on, on_experts = build(config, runtime, args.redundant, args.hot_bias, args.spread)
    eplb = EPLBSection(num_redundant_experts=args.redundant, window_steps=args.window)
    balancer = ExpertBalancer(eplb, on_experts, ctx, num_groups=config.n_group)
    pairs = {"off": [0], "on": [0]}
    model_compute(off_experts, args.row_us / 1e6, pairs["off"])
    model_compute(on_experts, args.row_us / 1e6, pairs["on"])
    batch = verify_batch(args.requests, args.context, 2)
    cache = KVCache(off.kv_cache_spec(), int(batch[2].numel()), PAGE_SIZE, torch.float32)
    ids = torch.randint(0, config.vocab_size, batch[4].shape, generator=torch.Generator().manual_seed(2))
    for _ in range(args.window):  # the window the placement is computed from (trivial placement)
        time_step(on, cache, runtime, batch, ids)
        balancer.step_boundary(ran=True, rebalance=False)
    balancer.rebalance()
    pause_s, moved = balancer.last_pause_s, balancer.moved_slots
    times = {"off": [], "on": []}
    for step in range(args.steps + 1):  # the first round warms up
        for name, model in (("off", off), ("on", on)):
            if step == 1:
                pairs[name][0] = 0
            elapsed = time_step(model, cache, runtime, batch, ids)
            if step:
                times[name].append(elapsed)
    runtime.close()
    destroy(ctx)
    return {"times": times, "pairs": {k: v[0] / args.steps for k, v in pairs.items()}, "pause_s": pause_s,
            "moved_slots": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep-size", type=int, default=4)
    parser.add_argument("--redundant", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64, help="D: verify has 2 * D tokens per rank")
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hot-bias", type=float, default=1.0, help="router bias of the top 10%% of experts")
    parser.add_argument("--spread", action="store_true", help="hot experts chosen at random, not all on rank 0")
    parser.add_argument("--row-us", type=float, default=40.0, help="modelled expert compute per (row, expert) pair")
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--bandwidth-gbs", type=float, default=0.2)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    outcomes = run_ranks(bench_rank, args.ep_size, args, timeout_s=900)
    for outcome in outcomes:
        if outcome.error:
            raise SystemExit(f"rank {outcome.rank} failed: {outcome.error}")
    values = [o.value for o in outcomes]
    off, on = values[0]["times"]["off"], values[0]["times"]["on"]
    report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"), "args": vars(args),
              "median_off_ms": statistics.median(off) * 1e3, "median_on_ms": statistics.median(on) * 1e3,
              "paired_median_ratio_off_over_on": statistics.median(a / b for a, b in zip(off, on))}
    for name in ("off", "on"):
        per_rank = [v["pairs"][name] for v in values]
        mean = sum(per_rank) / len(per_rank)
        report[f"pairs_per_rank_{name}"] = per_rank
        report[f"imbalance_{name}"] = (max(per_rank) - mean) / mean
    report["rebalance_pause_ms"] = [v["pause_s"] * 1e3 for v in values]
    report["moved_slots"] = values[0]["moved_slots"]
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
