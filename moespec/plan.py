"""Memory per rank, from config.json alone: `moespec plan`, and how the engine sizes its KV cache.

  moespec plan --config configs/deepseek-v3.yaml --set parallel.ep_size=16 --gpu-memory 141GB [--json]
  moespec plan --config configs/deepseek-v3.yaml --gpu H200 --batch-per-gpu 32 --context 4096 [--accept 0.85]

With --gpu, a `throughput` section follows: the predicted decode step and speed of this
deployment on that GPU at each draft length (moespec.throughput; docs/performance-model.md).

The model of one rank is built on the meta device (shapes and dtypes, nothing allocated), so
its weight bytes are those of the parameters that rank will really hold: its share of the
routed experts (MTP layer included), FP8 weights with their float32 block scales, the rest in
the model dtype. Added to them: the draft model or MTP head, the MTP state, DeepEP's buffers,
the activations of a forward over `max_num_batched_tokens` tokens and a reserve. What is left
of `cache.memory_fraction` of the device is KV cache (`cache.num_kv_pages: auto`), or the
configured pages must fit in it. A deployment that does not fit is refused before any weight is
read, naming the component that tips it over.

Formulas that are estimates (activations, DeepEP's normal-mode buffers, the reserve) say so in
their component's note; they have not been checked against a GPU's allocator yet.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moespec import throughput
from moespec.attention.flashinfer_backend import INT_WORKSPACE_BYTES, WORKSPACE_BYTES
from moespec.config import ConfigError, EngineConfig

GiB = 2**30
ACTIVATION_WORKSPACE = 256 * 2**20  # attention planning and sampling scratch
PENALTY_COUNT_BYTES = 5  # per vocabulary entry of a penalized request: a bool and a float32 (sampling.TokenCounts)
RESERVE = {"cuda": 4 * GiB, "cpu": 1 * GiB}  # CUDA context, NCCL buffers, allocator slack / the Python process


@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory: everything but the KV cache, then the KV cache that fits (or is asked for)."""

    device: str
    device_bytes: int
    memory_fraction: float
    components: list[Component]  # weights by dtype, draft, MTP state, DeepEP, activations, reserve
    weights_by_dtype: dict[str, int]
    kv_bytes_per_token: int
    page_size: int
    num_kv_pages: int  # the configured pages, or the most that fit
    max_model_len: int
    fits: bool
    problem: str | None = None
    details: dict = field(default_factory=dict)

    @property
    def budget(self) -> int:
        return int(self.memory_fraction * self.device_bytes)

    @property
    def fixed_bytes(self) -> int:
        return sum(c.bytes for c in self.components)

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_pages * self.page_size * self.kv_bytes_per_token

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_pages * self.page_size

    @property
    def ranks_holding_requests(self) -> int:
        """Ranks whose KV caches hold different requests: every rank with data-parallel attention."""
        return self.details.get("ep_size", 1) if self.details.get("attention") == "dp" else 1

    def as_dict(self) -> dict:
        return {"device": self.device, "device_bytes": self.device_bytes, "memory_fraction": self.memory_fraction,
                "budget_bytes": self.budget, "weights_by_dtype": self.weights_by_dtype,
                "components": [dataclasses.asdict(c) for c in self.components],
                "kv_cache": {"bytes": self.kv_bytes, "bytes_per_token": self.kv_bytes_per_token,
                             "pages": self.num_kv_pages, "page_size": self.page_size, "tokens": self.kv_tokens,
                             "requests_at_max_model_len": self.kv_tokens // max(self.max_model_len, 1),
                             "group_tokens": self.kv_tokens * self.ranks_holding_requests},
                "total_bytes": self.fixed_bytes + self.kv_bytes, "fits": self.fits, "problem": self.problem,
                **self.details}


# ---------------------------------------------------------------------------------- sizes


def parse_bytes(text: str) -> int:
    """'141GB', '141 GiB', '80e9', '1024' -> bytes (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?i?B)?\s*", text)
    if match is None:
        raise ValueError(f"--gpu-memory {text!r}: expected a size such as 141GB or 80GiB")
    units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return int(float(match.group(1)) * units[match.group(2)])


def device_memory(device: str) -> int:
    """Total memory of `device` (the host's RAM for the CPU)."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"model.device is {device!r} but this machine has no CUDA device to measure: "
                              "give one device's memory with --gpu-memory (e.g. 141GB)")
        return torch.cuda.mem_get_info(torch.device(device))[1]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ConfigError("cannot tell the host's memory size (no /proc/meminfo); set cache.num_kv_pages")


def param_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of a model's parameters and buffers by dtype, each tensor counted once."""
    seen, by_dtype = set(), {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        key = str(tensor.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + tensor.numel() * tensor.element_size()
    return by_dtype


def packed_weight_bytes(model: torch.nn.Module, device: str) -> int:
    """The second copy of the weights that model.pack_linears packs on `device` (layers.pack_linears),
    each in the dtype this CPU packs it as (layers.pack_dtype: float32 for bfloat16 where oneDNN
    has no bfloat16)."""
    from moespec.models.layers import pack_dtype, packing_modules

    device_type = torch.device(device).type
    return sum(t.numel() * pack_dtype(t, device_type).itemsize for module in packing_modules(model)
               for t in module.packed_sources(device_type))


def deepep_low_latency_bytes(tokens: int, hidden: int, num_experts: int) -> int:
    """DeepEP's low-latency RDMA buffer (`get_low_latency_rdma_size_hint`, its LowLatencyLayout):
    two halves (odd/even), each a send buffer, a receive buffer for every expert's slots, and
    signaling words; messages are a bf16 row or an FP8 row with per-128 scales."""
    scales = hidden // 128
    dispatch_msg = 16 + max(2 * hidden, hidden + 4 * scales)
    combine_msg = 4 * scales + 2 * hidden
    send = max(tokens * dispatch_msg, num_experts * tokens * combine_msg)
    recv = num_experts * tokens * max(dispatch_msg, combine_msg)
    signaling = -(-num_experts * 4 // 128) * 128
    total = 2 * (send + recv + signaling)
    return (total + 128) // 128 * 128  # as DeepEP rounds it: 128 more where already aligned


# DeepEP v1.2.1's default normal-mode configs per EP size (Buffer.get_dispatch_config and
# get_combine_config): (NVLink receive tokens, RDMA send tokens, RDMA receive tokens) per channel
DEEPEP_DISPATCH = {2: (256, 6, 128), 4: (256, 6, 128), 8: (256, 6, 128), 16: (288, 20, 128), 24: (288, 32, 128),
                   32: (288, 32, 128), 64: (288, 28, 128), 128: (560, 32, 128), 144: (720, 12, 128),
                   160: (720, 12, 128)}
DEEPEP_COMBINE = {2: (256, 6, 128), 4: (256, 6, 128), 8: (256, 6, 128), 16: (288, 12, 128), 24: (288, 8, 128),
                  32: (288, 8, 128), 64: (288, 20, 128), 128: (560, 12, 128), 144: (720, 8, 128), 160: (720, 8, 128)}


def deepep_normal_bytes(hidden: int, ep_size: int) -> tuple[int, int]:
    """DeepEP's normal-mode (NVLink, RDMA) buffer bytes for bf16 rows: its size hints
    (csrc/legacy/config.hpp `get_nvl_buffer_size_hint`, `get_rdma_buffer_size_hint`: per channel
    and peer, receive slots of a row, its source meta (8 bytes) and room for 128 top-k ids (int64),
    128 weights and 128 scales) at its default configs (20 SMs: 10 channels), the larger of the
    dispatch's and the combine's, as `build_deepep_buffer` asks for them."""
    channels, nvl_ranks, rdma_ranks = 10, min(ep_size, 8), max(ep_size // 8, 1)
    per_slot = 2 * hidden + 8 + 128 * (8 + 4 + 4)
    nvl = rdma = 0
    for nvl_recv, rdma_send, rdma_recv in (DEEPEP_DISPATCH[ep_size], DEEPEP_COMBINE[ep_size]):
        nvl = max(nvl, channels * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + nvl_recv * per_slot))
        if ep_size > 8:
            rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
            rdma = max(rdma, channels * rdma_ranks * 2 * ((8 * 2 + 2) * 4 + rdma_recv * (per_slot + 16)))
    return -(-nvl // 128) * 128, -(-rdma // 128) * 128


def activation_bytes(model_config, tokens: int, sampled_rows: int, dtype: torch.dtype, ep_size: int,
                     dp: bool = False) -> int:
    """A forward over `tokens` tokens at its peak (an estimate): residual, normed and projected
    hidden states, MLA's latent queries and outputs, the routed experts' rows on this rank (the
    average routing, doubled), float32 logits and sampling copies for the sampled rows. With
    data-parallel attention every rank has its own `tokens`, so a rank's experts receive about
    tokens x top-k rows (from all ranks); replicated, the ranks share one batch's."""
    c = model_config
    M, size = c.hidden_size, dtype.itemsize
    per_token = 6 * M
    if c.model_type == "deepseek_v3":
        H = c.num_attention_heads
        per_token += H * (c.qk_head_dim + 2 * (c.kv_lora_rank + c.qk_rope_head_dim) + c.v_head_dim)
        routed_rows = 2 * tokens * c.num_experts_per_tok // (1 if dp else max(ep_size, 1))
        moe = routed_rows * (M + 3 * c.moe_intermediate_size) + tokens * 3 * c.intermediate_size
    else:
        per_token += 3 * c.num_attention_heads * c.head_dim
        moe = tokens * 3 * c.intermediate_size
    logits = 4 * sampled_rows * c.vocab_size * 4  # float32 logits, probs, penalties, noise
    return tokens * per_token * size + moe * size + logits + ACTIVATION_WORKSPACE


# ---------------------------------------------------------------------------------- the plan


def rank_model(config: EngineConfig):
    """One rank's model on the meta device (its share of the routed experts, in the planned dtypes),
    its architecture config and the quantization it got."""
    from moespec.models import build_on_meta, load_config, resolve_dtype
    from moespec.models.moe import LocalExperts
    from moespec.models.weights import read_hf_config

    model_dir = config.model.path
    model_config = load_config(model_dir)
    kwargs = {}
    if model_config.model_type == "deepseek_v3":
        from moespec.parallel.ep_moe import check_divisible

        check_divisible(model_config.n_routed_experts, config.parallel.ep_size)
        kwargs["experts_factory"] = LocalExperts.shard_factory(config.parallel.ep_size, 0)
    model, quantization = build_on_meta(model_config, resolve_dtype(config.model.dtype), config.model.quantization,
                                        read_hf_config(model_dir), **kwargs)
    return model, model_config, quantization


def plan_memory(config: EngineConfig, device_bytes: int | None = None) -> MemoryPlan:
    """The memory of one rank of `config`; device_bytes defaults to the configured device's total."""
    from moespec.kv_cache import kv_bytes_per_token
    from moespec.models import resolve_dtype

    device = config.model.device
    device_bytes = device_bytes if device_bytes is not None else device_memory(device)
    dtype = resolve_dtype(config.model.dtype)
    model, model_config, quantization = rank_model(config)
    weights = param_bytes(model)
    components = [Component(f"weights ({name})", size, "this rank's parameters, built on the meta device")
                  for name, size in sorted(weights.items(), key=lambda kv: -kv[1])]
    components += replica_components(config, model)
    spec, sched = config.speculation, config.scheduler
    k = spec.num_speculative_tokens if spec.mode != "none" else 0
    per_token = kv_bytes_per_token(model.kv_cache_spec(), dtype)
    drafter = build_drafter(config, dtype)
    if drafter is not None:  # its own weights, and its KV on the target's page ids
        name, path, module = drafter
        components.append(Component(name, sum(param_bytes(module).values()), path))
        per_token += kv_bytes_per_token(module.kv_cache_spec(), dtype)
    if config.model.pack_linears:
        packed = packed_weight_bytes(model, device) + (packed_weight_bytes(drafter[2], device) if drafter else 0)
        if packed:
            components.append(Component("packed weights", packed, "model.pack_linears: a second copy of the linears "
                                        "packed for oneDNN"))
    if spec.mode == "mtp":
        from moespec.speculation.mtp import hold_limit, mtp_state_bytes

        # the built-in layer's forwards run in lockstep across ranks where its experts are sharded
        held = hold_limit(k, spec.mtp_hold_tokens, spec.mtp_head is None and config.parallel.ep_size > 1)
        components.append(Component("MTP state", mtp_state_bytes(sched.max_num_seqs, held, model_config.hidden_size,
                                                                 dtype),
                                    f"target hidden states awaiting the MTP layer: max_num_seqs x {held} x hidden "
                                    "(speculation.mtp_hold_tokens; 1 + k across ranks)"))
    max_model_len = config.model.max_model_len or model_config.max_position_embeddings
    components += deepep_components(config, model_config) + flashinfer_components(config, max_model_len)
    components.append(Component("penalty counts", sched.max_num_seqs * PENALTY_COUNT_BYTES * model_config.vocab_size,
                                "kept for running requests with penalties (sampling.TokenCounts): "
                                "max_num_seqs x 5 bytes x vocab"))
    sampled = sched.max_num_seqs * (1 + k)
    dp = config.parallel.attention == "dp" and config.parallel.ep_size > 1
    components.append(Component("activations", activation_bytes(model_config, sched.max_num_batched_tokens,
                                                                 sampled, dtype, config.parallel.ep_size, dp),
                                f"a forward over max_num_batched_tokens={sched.max_num_batched_tokens} (estimate)"))
    components.append(Component("reserve", RESERVE["cuda" if device.startswith("cuda") else "cpu"],
                                "CUDA context, NCCL, allocator slack (estimate)" if device.startswith("cuda")
                                else "the Python process (estimate)"))
    return size_kv(config, device, device_bytes, components, weights, per_token, max_model_len,
                   {"quantization": quantization, "ep_size": config.parallel.ep_size,
                    "attention": "dp" if dp else "replicated", "model": config.model.path})


def replica_components(config: EngineConfig, model: torch.nn.Module) -> list[Component]:
    """parallel.eplb's redundant experts: R / G more expert slots on each rank, in every MoE layer
    (the MTP layer's too), each as large as one of the layer's experts with its FP8 scales."""
    from moespec.models.moe import LocalExperts

    R, G = config.parallel.eplb.num_redundant_experts, config.parallel.ep_size
    if not R:
        return []
    per_slot = sum(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) // m.num_local
                   for m in model.modules() if isinstance(m, LocalExperts))
    return [Component(f"redundant experts (parallel.eplb.num_redundant_experts={R})", per_slot * (R // G),
                      f"{R // G} more expert slots per rank in every MoE layer")]


def build_drafter(config: EngineConfig, dtype: torch.dtype) -> tuple[str, str, torch.nn.Module] | None:
    """The draft model or external MTP head of `config` on the meta device, with a label and its path."""
    from moespec.models import build_model, load_config

    spec = config.speculation
    if spec.mode == "draft":
        return "draft model weights", config.draft.model, build_model(load_config(config.draft.model), dtype, "meta")
    if spec.mode == "mtp" and spec.mtp_head:
        from moespec.models.mtp_head import MTPHead, MTPHeadConfig
        from moespec.models.weights import read_hf_config

        with torch.device("meta"):
            head = MTPHead(MTPHeadConfig.from_hf(read_hf_config(spec.mtp_head))).to(dtype)
        return "MTP head weights", spec.mtp_head, head
    return None


def flashinfer_components(config: EngineConfig, max_model_len: int) -> list[Component]:
    """One FlashInfer float workspace per attention backend, which every plan and captured step of
    it shares: the target's runner and the speculator's, and each one's static steps. And each
    wrapper's own int workspace (8 MiB on the device, as much pinned on the host): one per runner,
    and one per captured step (model.cuda_graph: a graph's wrappers are its own), counted for every
    shape that may be captured: batch buckets x the step kinds (decode; verify when speculating;
    the speculator's draft steps). FlashInfer's graphs serve every KV length (one capture each)."""
    from moespec.static_step import static_spec

    m = config.model
    if m.attention_backend != "flashinfer":
        return []
    speculating = config.speculation.mode != "none"
    runners = 1 + speculating
    backends = runners * (1 + bool(m.compile or m.cuda_graph))
    wrappers = runners
    if m.cuda_graph:
        wrappers += len(static_spec(config, max_model_len).buckets) * (1 + 2 * speculating)
    return [Component("FlashInfer workspaces", backends * WORKSPACE_BYTES,
                      f"{backends} x {WORKSPACE_BYTES // 2**20} MiB: one per attention backend (runners and their "
                      "static steps), shared by all of its plans"),
            Component("FlashInfer int workspaces", wrappers * INT_WORKSPACE_BYTES,
                      f"{wrappers} wrappers x {INT_WORKSPACE_BYTES // 2**20} MiB: one per runner and per step shape "
                      "that may be captured, at most (as much again pinned on the host)")]


def deepep_components(config: EngineConfig, model_config) -> list[Component]:
    p = config.parallel
    if p.moe_backend != "deepep" or p.ep_size == 1 or model_config.model_type != "deepseek_v3":
        return []
    from moespec.distributed import dispatch_capacity
    from moespec.parallel.exchange import aligned_capacity, capacity_rows

    tokens = aligned_capacity(dispatch_capacity(config), p.ep_size, capacity_rows(p.moe_backend))  # EPRuntime's
    # with parallel.eplb the buffer serves every physical slot (E + R): the exchange routes to slots
    M, E = model_config.hidden_size, model_config.n_routed_experts + p.eplb.num_redundant_experts
    low_latency = deepep_low_latency_bytes(tokens, M, E)
    nvl, rdma = deepep_normal_bytes(M, p.ep_size)  # normal mode shares the RDMA area, sized to the larger
    return [Component("DeepEP low-latency buffer", low_latency,
                      f"LowLatencyLayout for {tokens} tokens per rank x {E} expert slots x hidden {M}"),
            Component("DeepEP normal buffers", nvl + max(0, rdma - low_latency),
                      "NVLink buffer and any RDMA beyond the low-latency area, DeepEP's size hints at its default "
                      "configs")]


def size_kv(config: EngineConfig, device: str, device_bytes: int, components: list[Component],
            weights: dict[str, int], per_token: int, max_model_len: int, details: dict) -> MemoryPlan:
    cache = config.cache
    budget = int(cache.memory_fraction * device_bytes)
    fixed = sum(c.bytes for c in components)
    page_bytes = cache.page_size * per_token
    most = max((budget - fixed) // page_bytes, 0)
    pages = most if cache.num_kv_pages == "auto" else cache.num_kv_pages
    plan = MemoryPlan(device, device_bytes, cache.memory_fraction, components, weights, per_token, cache.page_size,
                      pages, max_model_len, fits=True, details=details)
    problem = find_shortfall(plan, page_bytes)
    return dataclasses.replace(plan, fits=problem is None, problem=problem)


def find_shortfall(plan: MemoryPlan, page_bytes: int) -> str | None:
    """Why the plan does not fit, naming the component that crosses the budget, or None."""
    used, budget = 0, plan.budget
    for component in plan.components:
        used += component.bytes
        if used > budget:
            return (f"{component.name} ({component.bytes / GiB:.1f} GiB) crosses the budget of {budget / GiB:.1f} GiB "
                    f"(cache.memory_fraction {plan.memory_fraction} of {plan.device_bytes / GiB:.1f} GiB) by "
                    f"{(used - budget) / GiB:.1f} GiB before any KV cache")
    if plan.num_kv_pages < 1:
        return (f"the KV cache: {max(budget - used, 0) / GiB:.3f} GiB left after the rest, less than one page "
                f"({page_bytes} bytes)")
    if used + plan.kv_bytes > budget:
        return (f"the KV cache: cache.num_kv_pages {plan.num_kv_pages} needs {plan.kv_bytes / GiB:.1f} GiB, "
                f"{(used + plan.kv_bytes - budget) / GiB:.1f} GiB more than the {(budget - used) / GiB:.1f} GiB left")
    return None


def resolve_kv_pages(config: EngineConfig, device_bytes: int | None = None) -> EngineConfig:
    """The config with a concrete cache.num_kv_pages, checked against the device's memory before
    anything is loaded: ConfigError naming the component and the shortfall when it does not fit."""
    plan = plan_memory(config, device_bytes)
    if not plan.fits:
        raise ConfigError(f"the deployment does not fit on {plan.device}: {plan.problem} (see `moespec plan`)")
    if config.cache.num_kv_pages == plan.num_kv_pages:
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_kv_pages=plan.num_kv_pages))


# ---------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moespec.arguments import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--gpu-memory", default=None, help="memory of one device, e.g. 141GB (default: the "
                        "configured device's, the host's RAM for the CPU)")
    parser.add_argument("--context-len", "--context", type=int, default=None,
                        help="context length for the concurrency figure and the throughput (default: max_model_len)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--gpu", default=None, help="predict decode speed on this GPU (H100, H200, H800, B200; "
                        "moespec.throughput); its memory is the default --gpu-memory")
    parser.add_argument("--batch-per-gpu", type=float, default=None,
                        help="requests per GPU for the throughput (default: scheduler.max_num_seqs)")
    parser.add_argument("--accept", type=float, default=None, help="acceptance rate of each draft token "
                        "(default 0.85: DeepSeek-V3's second-token acceptance)")
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help="busiest GPU's routed rows over the mean (1: perfectly balanced experts)")


def run(args: argparse.Namespace) -> int:
    from moespec.arguments import load_engine_config

    config = load_engine_config(args)
    gpu = throughput.gpu_named(args.gpu) if args.gpu else None
    device_bytes = parse_bytes(args.gpu_memory) if args.gpu_memory else int(gpu.memory_bytes) if gpu else None
    plan = plan_memory(config, device_bytes)
    context = args.context_len or plan.max_model_len
    speed = plan_speed(config, plan, gpu, args, context) if gpu else None
    if args.json:
        report = plan.as_dict()
        report["kv_cache"]["requests_at_context_len"] = {"context_len": context,
                                                         "requests": plan.kv_tokens // context}
        if speed is not None:
            report["throughput"] = speed
        print(json.dumps(report, indent=2))
    else:
        print(describe(plan, context) + ("\n" + throughput.describe(speed) if speed else ""))
    return 0 if plan.fits else 3


def plan_speed(config: EngineConfig, plan: MemoryPlan, gpu: throughput.GPU, args: argparse.Namespace,
               context: int) -> dict:
    """The throughput section: moespec.throughput's step model for this deployment on `gpu`."""
    from moespec.models.weights import read_hf_config

    batch = args.batch_per_gpu or config.scheduler.max_num_seqs
    accept = throughput.DEFAULT_ACCEPT_RATE if args.accept is None else args.accept
    try:
        return throughput.plan_throughput(config, read_hf_config(config.model.path), gpu, batch, context, accept,
                                          plan.details["quantization"], args.imbalance)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def describe(plan: MemoryPlan, context: int) -> str:
    lines = [f"{plan.details['model']}: one rank of EP {plan.details['ep_size']}, {plan.details['quantization']} "
             f"weights, on {plan.device} ({plan.device_bytes / GiB:.1f} GiB; budget {plan.memory_fraction:g} = "
             f"{plan.budget / GiB:.1f} GiB)"]
    for c in plan.components:
        lines.append(f"  {c.name:<28} {c.bytes / GiB:9.2f} GiB  {c.note}")
    lines.append(f"  {'KV cache':<28} {plan.kv_bytes / GiB:9.2f} GiB  {plan.num_kv_pages} pages x {plan.page_size} = "
                 f"{plan.kv_tokens} tokens ({plan.kv_bytes_per_token} bytes each)")
    lines.append(f"  {'total':<28} {(plan.fixed_bytes + plan.kv_bytes) / GiB:9.2f} GiB")
    lines.append(f"  concurrent requests at {context} tokens of context: {plan.kv_tokens // context}")
    G = plan.details["ep_size"]
    if plan.details["attention"] == "dp" and G > 1:
        lines.append(f"group of {G} ranks, data-parallel attention (each rank its own requests and KV cache): "
                     f"{G * plan.kv_tokens} tokens, {G * (plan.kv_tokens // context)} requests at {context}")
    lines.append("fits" if plan.fits else f"does not fit: {plan.problem}")
    return "\n".join(lines)
