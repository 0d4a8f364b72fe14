"""How much of the expert-parallel communication two-way microbatching hides, on the MTP verify
step (2 * D tokens: D requests x (1 + k) with k = 1), over a modelled slow inter-node link:
microbatched within each MoE layer (the other half's experts and the shared experts run while a
half's tokens fly), and two-batch overlap (the halves take turns through every layer, so the
other half's attention runs meanwhile too).

  .venv/bin/python benchmarks/bench_ep_overlap.py --ep-size 2 --requests 64 --hidden 1024 \
      --latency-ms 2 --bandwidth-gbs 0.2 [--out bench-ep-overlap.json]

Each rank is a local process (gloo). The link model sleeps latency + bytes / bandwidth on the comm
thread after every collective (see parallel/comm.py), so the sleep overlaps compute as a transfer
on a NIC would. For each exchange (--exchange uneven,fixed: counts + uneven all_to_all, or the
fixed-capacity DeepEP low-latency layout, charged for the rows DeepEP would move), six settings,
{no link cost, link cost} x {sequential, microbatched, two_batch}, take turns step by step; each
reports the best step (least disturbed by other load on the machine) and the median, on rank 0.
For each overlapped mode (microbatched, two_batch):
  hidden        = 1 - (mode with link - mode without) / link time slept (mode with link)
  vs sequential = 1 - (mode with link - sequential without)
                      / (sequential with link - sequential without): the end-to-end gain.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.distributed as dist

from moespec.attention import AttentionMetadata, TorchPagedAttention, plan_forward
from moespec.config import ParallelSection
from moespec.kv_cache import KVCache, PageAllocator
from moespec.machine import run_info
from moespec.models import build_model
from moespec.models.deepseek_v3 import DeepseekV3Config
from moespec.parallel import EPRuntime, LinkModel, ThrottledCollectives, destroy, ep_experts_factory, init_parallel
from moespec.parallel.local_launch import run_ranks

PAGE_SIZE = 16
# mode -> (EPRuntime.microbatch, EPRuntime.two_batch)
MODES = {"sequential": (False, False), "microbatched": (True, False), "two_batch": (True, True)}


def bench_config(args: argparse.Namespace) -> DeepseekV3Config:
    """A mid-size random DeepSeek-V3-architecture model: big enough that compute is measurable."""
    return DeepseekV3Config(vocab_size=2048, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                            q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                            v_head_dim=32, n_routed_experts=args.experts, n_shared_experts=1, num_experts_per_tok=4,
                            n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=4096)


def build_bench_model(config: DeepseekV3Config, runtime: EPRuntime) -> torch.nn.Module:
    torch.manual_seed(0)  # replicated weights identical on every rank
    model = build_model(config, experts_factory=ep_experts_factory(runtime)).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    for layer in list(model.model.layers)[config.first_k_dense_replace:]:
        layer.mlp.gate.weight.normal_(0, 0.5, generator=gen)  # spread tokens over experts
    return model


def verify_batch(requests: int, context: int, tokens_per_request: int) -> tuple[torch.Tensor, ...]:
    """Request b holds `context` tokens in KV and verifies `tokens_per_request` more."""
    pages_each = -(-(context + tokens_per_request) // PAGE_SIZE)
    qo = torch.arange(requests + 1) * tokens_per_request
    kv = torch.arange(requests + 1) * pages_each
    indices = torch.arange(requests * pages_each)
    last = torch.full((requests,), context + tokens_per_request - (pages_each - 1) * PAGE_SIZE)
    positions = (context + torch.arange(tokens_per_request)).repeat(requests)
    return qo, kv, indices, last, positions


def time_step(model, cache: KVCache, runtime: EPRuntime, batch: tuple, ids: torch.Tensor,
              low_latency: bool | None) -> float:
    qo, kv, indices, last, positions = batch
    meta = AttentionMetadata(qo, kv, indices, last, positions, PAGE_SIZE)
    runtime.stream.run("barrier", dist.barrier, runtime.ctx.ep_group)
    start = time.perf_counter()  # planning included: two-batch overlap plans each half too
    ctx = plan_forward(TorchPagedAttention(), meta, cache.layers, runtime.two_batch_split(qo.tolist()))
    with torch.no_grad(), runtime.step(qo.tolist(), low_latency):
        model.compute_logits(model(ids, positions, ctx))
    return time.perf_counter() - start


def bench_rank(rank: int, args: argparse.Namespace) -> dict:
    """The settings take turns step by step, so background load hits them alike."""
    ctx = init_parallel(ParallelSection(ep_size=args.ep_size, timeout_s=120))
    link = ThrottledCollectives(ctx, LinkModel())
    capacity = -(-2 * args.requests // args.ep_size)  # this rank's share of the 2*D verify tokens
    runtime = EPRuntime(ctx, link, max_tokens_per_rank=capacity)
    model = build_bench_model(bench_config(args), runtime)
    batch = verify_batch(args.requests, args.context, 2)
    cache = KVCache(model.kv_cache_spec(), int(batch[2].numel()), PAGE_SIZE, torch.float32)
    ids = torch.randint(0, model.config.vocab_size, batch[4].shape, generator=torch.Generator().manual_seed(2))
    slow = LinkModel(args.latency_ms / 1e3, args.bandwidth_gbs * 1e9)
    settings = {}
    for exchange in args.exchange.split(","):
        low_latency = {"uneven": None, "fixed": True}[exchange]
        for mode, split in MODES.items():
            settings[f"{exchange}/{mode}"] = (LinkModel(), split, low_latency)
            settings[f"{exchange}/{mode}+link"] = (slow, split, low_latency)
    times = {name: [] for name in settings}
    injected = {name: 0.0 for name in settings}
    for step in range(args.steps + 2):  # the first two rounds warm up
        for name, (link.link, (runtime.microbatch, runtime.two_batch), low_latency) in settings.items():
            before = link.injected_s
            elapsed = time_step(model, cache, runtime, batch, ids, low_latency)
            if step >= 2:
                times[name].append(elapsed)
                injected[name] += link.injected_s - before
    runtime.close()
    destroy(ctx)
    return {name: {"step_ms": min(times[name]) * 1e3, "median_ms": statistics.median(times[name]) * 1e3,
                   "link_ms_per_step": injected[name] / args.steps * 1e3} for name in settings}


def summarize(r: dict, exchanges: list[str]) -> dict:
    out = {}
    for x in exchanges:
        seq, seq_link = r[f"{x}/sequential"]["step_ms"], r[f"{x}/sequential+link"]["step_ms"]
        out[x] = {}
        for mode in ("microbatched", "two_batch"):
            alone, linked = r[f"{x}/{mode}"], r[f"{x}/{mode}+link"]
            slept = linked["link_ms_per_step"]
            out[x][mode] = {"hidden_of_link_time": 1 - (linked["step_ms"] - alone["step_ms"]) / slept,
                            "hidden_of_link_time_medians": 1 - (linked["median_ms"] - alone["median_ms"]) / slept,
                            "hidden_vs_sequential": 1 - (linked["step_ms"] - seq) / (seq_link - seq)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep-size", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="D: decode batch size (verify has 2 * D tokens)")
    parser.add_argument("--context", type=int, default=16, help="tokens already in each request's KV")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--latency-ms", type=float, default=2.0, help="modelled link latency per collective")
    parser.add_argument("--bandwidth-gbs", type=float, default=0.2, help="modelled link bandwidth, GB/s per rank")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--exchange", default="uneven,fixed",
                        help="uneven (counts + all_to_all_single with splits) and/or fixed (DeepEP low-latency layout)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    outcomes = run_ranks(bench_rank, args.ep_size, args, timeout_s=600)
    for outcome in outcomes:
        if outcome.error:
            raise SystemExit(f"rank {outcome.rank} failed: {outcome.error}")
    report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
              "args": vars(args), "rank0": outcomes[0].value,
              **summarize(outcomes[0].value, args.exchange.split(","))}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
