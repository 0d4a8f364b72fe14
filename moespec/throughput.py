"""Decode speed at real scale, from config.json and the deployment: `moespec plan --gpu NAME`.

One decode (verify) step of a DeepSeek-V3-class model on one GPU, term by term, each a roofline
(bytes over achieved bandwidth against FLOPs over achieved FLOP/s) or a published measurement:

  per decoder layer   MLA projections (weights + activations), absorbed MLA core attention (the
                      compressed KV of every request read once for its 1+k query tokens), the dense
                      MLP (first layers) or the MoE (shared expert, router, this GPU's routed experts
                      with rows = tokens x top-k x imbalance), the small kernels (norms, rope,
                      quantization, routing: a fixed cost per kernel plus elementwise traffic)
  exchange            DeepEP low-latency dispatch (FP8) and combine (BF16) at the bandwidth DeepEP
                      measured for that EP size; tensor parallel: two all-reduces per layer
  overlap             none: compute + exchange; microbatch (the MoE split in halves): each half's
                      exchange behind the other half's experts; two-batch overlap (DeepSeek, SGLang):
                      min(compute, exchange) hidden per layer; either times OVERLAP_EFFICIENCY.
                      Both halves read the weights: microbatching costs weight traffic, which is
                      why it loses at small batches and with many experts per GPU.
  the rest            lm_head over the verified rows, sampling, the MTP layer run k times (one
                      decoder layer + eh_proj + lm_head), the host (kernel launches without CUDA
                      graphs, the scheduler when it does not overlap the device)

Speculation: a step verifies 1+k tokens per request and yields the accept length a(k) tokens
(a chain whose drafts are each accepted with probability p: a = (1 - p^(k+1)) / (1 - p)).

Every efficiency factor below is a named constant with its source or its calibration; the
validation against published deployments is in docs/performance-model.md. Pure arithmetic: no
torch, no device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GB = 1e9
TFLOPS = 1e12
US = 1e-6

# ---------------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class GPU:
    """Peak figures of one GPU (dense, no sparsity), from NVIDIA's datasheets."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float
    nvlink_bytes_per_s: float  # one direction (the datasheet's bidirectional figure / 2)
    ib_bytes_per_s: float  # one NIC per GPU, one direction
    source: str


H100_URL = "https://www.nvidia.com/en-us/data-center/h100/"
H200_URL = "https://www.nvidia.com/en-us/data-center/h200/"
H800_URL = "https://www.nvidia.com/en-us/data-center/h800/ (datasheet); DeepEP README: '~160 GB/s NVLink'"
B200_URL = "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU = 1/8 of the board)"
CX7 = 50 * GB  # ConnectX-7 400 Gb/s per GPU (DGX H100/H200/B200 and DeepEP's H800 testbed)

GPUS = {
    # 3.35 TB/s; FP8 3,958 and BF16 1,979 TFLOPS with sparsity (half dense); NVLink 900 GB/s bidirectional
    "H100": GPU("H100", 80 * GB, 3.35e12, 989 * TFLOPS, 1979 * TFLOPS, 450 * GB, CX7, H100_URL),
    # the H100's die with 141 GB of HBM3e at 4.8 TB/s
    "H200": GPU("H200", 141 * GB, 4.8e12, 989 * TFLOPS, 1979 * TFLOPS, 450 * GB, CX7, H200_URL),
    # the H100's compute and HBM with NVLink cut to 400 GB/s bidirectional
    "H800": GPU("H800", 80 * GB, 3.35e12, 989 * TFLOPS, 1979 * TFLOPS, 200 * GB, CX7, H800_URL),
    # HGX B200: 180 GB, 8 TB/s, FP8 72 / BF16 36 PFLOPS sparse per 8 GPUs; NVLink 5 1.8 TB/s bidirectional
    "B200": GPU("B200", 180 * GB, 8.0e12, 2250 * TFLOPS, 4500 * TFLOPS, 900 * GB, CX7, B200_URL),
}

# ---------------------------------------------------------------------------------- efficiencies
# Achieved share of peak. Sources: kernel benchmarks published by their authors (not end-to-end
# figures, so none of the validation figures was used to set them), except where marked calibrated.

# FlashMLA README (H800 SXM5): dense MLA decoding "up to 3000 GB/s in memory-bound configuration
# and 660 TFLOPS in computation-bound configuration": 3000/3350 and 660/989.
ATTENTION_BANDWIDTH = 0.90
ATTENTION_FLOPS = 0.67
# DeepGEMM README (H800, v1 table): FP8 GEMMs at decode shapes (M = 64..128, DeepSeek-V3's N, K)
# reach 1509-2668 GB/s, median about 2300 GB/s = 0.69 of 3350; masked grouped GEMMs (the MoE
# decode layout) 2047-2064 GB/s at 256 rows per group.
GEMM_BANDWIDTH = 0.65
# DeepGEMM README: large FP8 GEMMs and grouped GEMMs 1,058-1,358 TFLOPS (up to 1550 after its
# 2025-04 update) of 1979: 0.6.
GEMM_FLOPS = 0.60
# Elementwise kernels (norms, rope, SiLU, quantization): streaming copies reach about 0.8 of HBM.
ELEMENTWISE_BANDWIDTH = 0.80
ELEMENTWISE_PASSES = 12  # reads+writes of a [T, M] bf16 tensor per layer by the small kernels

# Kernels per decoder layer besides its GEMMs and attention (2 norms + 2 latent norms, rope, the
# q/kv splits, 2 residual adds, router GEMV + top-k, 3 quantizations, SiLU-mul x2, the gather of
# routed outputs; dispatch/combine are the exchange's) and GEMM-like kernels (q_a+kv_a, q_b,
# w_kc, attention, w_vc, o_proj, shared up/down, routed up/down).
SMALL_KERNELS_PER_LAYER = 16
GEMM_KERNELS_PER_LAYER = 10
MOE_KERNELS_PER_LAYER = 10  # of those, the MoE's (router, top-k, quantization, shared and routed GEMMs, SiLU)
# A fixed cost per kernel on the device (launch, ramp, tail, the gap to the next), added to its
# roofline time. CALIBRATED on one figure: TensorRT-LLM's DeepSeek-R1 at batch 1 without MTP on
# 8xB200 (111 tokens/s per user, 9.0 ms per step; tech blog 1). That figure is calibration, not
# validation.
KERNEL_OVERHEAD_S = 4.2 * US
# Host launch of one kernel in eager PyTorch (no CUDA graph): an estimate, not validated (every
# published deployment below runs CUDA graphs).
HOST_LAUNCH_S = 8.0 * US
# Host work of one step (scheduling, building the batch, reading the accepted tokens) when the
# scheduler does not overlap it with the device: an estimate (set before any comparison; it enters
# the SGLang MTP validation, whose speculative runs had SGLang's overlap scheduler switched off).
HOST_STEP_S = 1.5e-3

# DeepEP low-latency kernels (legacy V1 table, docs/legacy.md; H800, CX7 400 Gb/s, 128 tokens per
# rank, hidden 7168, top-8, FP8 dispatch, BF16 combine): EP size -> (dispatch GB/s, combine GB/s).
# The latencies there are the bytes at these bandwidths: 128 x 8 x 7168 FP8 bytes in 77 us = 98 GB/s.
DEEPEP_LOW_LATENCY = {8: (98, 127), 16: (63, 74), 32: (48, 53), 64: (43, 46), 128: (39, 39), 256: (39, 40)}
DEEPEP_URL = "https://github.com/deepseek-ai/DeepEP/blob/main/docs/legacy.md#low-latency-kernels-with-pure-rdma"
# The latency floor of one dispatch or combine with almost nothing to send: DeepEP publishes no
# figure; SGLang's large-scale EP blog measured 0.06 ms for a dispatch in a unit test at 128 tokens.
EXCHANGE_FLOOR_S = 20 * US
# The share of the ideal overlap of two microbatches that is realized (stage imbalance, the
# exchange's busy-waiting, pipeline fill). CALIBRATED on one figure: DeepSeek's profile-data
# decode run (EP128, 128 requests per H800 at 4K context, two microbatches), 18,598 tokens/s per
# node as LMSYS derived it (LMSYS blog 2025-05-05), with MTP k=1 at LMSYS's assumed 60%
# acceptance. Calibration, not validation.
OVERLAP_EFFICIENCY = 0.83
# One small all-reduce over NVLink (TensorRT-LLM/SGLang one-shot custom all-reduce): an estimate.
ALLREDUCE_FLOOR_S = 8 * US

# ---------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Architecture:
    """What the step's cost depends on, from a DeepSeek-V3 config.json."""

    hidden: int  # M
    heads: int  # H
    q_lora_rank: int
    kv_lora_rank: int  # C
    rope_dim: int  # R
    nope_dim: int
    v_dim: int
    intermediate: int  # dense MLP
    moe_intermediate: int
    routed_experts: int  # E
    shared_experts: int
    top_k: int  # A
    layers: int
    dense_layers: int
    mtp_layers: int
    vocab: int  # V

    @classmethod
    def from_hf(cls, hf: dict) -> "Architecture":
        keys = ["hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                "n_shared_experts", "num_experts_per_tok", "num_hidden_layers", "first_k_dense_replace",
                "vocab_size"]
        missing = [k for k in keys if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks {missing}: the throughput model needs a DeepSeek-V3 (MLA + MoE) "
                             f"architecture")
        values = [hf[k] for k in keys]
        return cls(*values[:14], mtp_layers=hf.get("num_nextn_predict_layers", 0), vocab=values[14])

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate  # gate, up, down


@dataclass(frozen=True)
class Deployment:
    """How the model is laid out and run. tp_size > 1 splits attention heads and every MLP's
    columns over a node (TensorRT-LLM's and SGLang's TP8); dp_attention gives each GPU its own
    requests (DeepSeek's DP attention + EP)."""

    gpu: GPU
    ep_size: int = 1
    tp_size: int = 1
    dp_attention: bool = True
    overlap: str = "none"  # none | microbatch | two_batch
    cuda_graphs: bool = True
    host_overlap: bool = True  # the scheduler prepares step n+1 while step n runs
    redundant_experts: int = 0
    imbalance: float = 1.0  # the busiest GPU's routed rows over the mean (EPLB's effect)
    attention_weight_bytes: float = 1.0  # FP8 projections; 2.0 for BF16
    mlp_weight_bytes: float = 1.0  # FP8 experts and dense MLP; 0.5625 for NVFP4 with its scales
    kv_bytes: float = 2.0  # BF16 latent cache
    mtp_weight_bytes: float | None = None  # the MTP layer's weights when they differ (TensorRT-LLM: BF16)

    def __post_init__(self):
        if self.overlap not in ("none", "microbatch", "two_batch"):
            raise ValueError(f"overlap {self.overlap!r}: expected none, microbatch or two_batch")
        if self.ep_size < 1 or self.tp_size < 1 or self.imbalance < 1:
            raise ValueError("ep_size and tp_size must be >= 1 and imbalance >= 1 (the busiest GPU over the mean)")

    @property
    def group_gpus(self) -> int:
        """GPUs that share one attention batch: 1 with DP attention, tp_size with TP."""
        return self.tp_size


# ---------------------------------------------------------------------------------- terms


def roofline(weight_bytes: float, act_bytes: float, flops: float, gpu: GPU, fp8: bool,
             bandwidth: float = GEMM_BANDWIDTH, efficiency: float = GEMM_FLOPS) -> float:
    """Seconds of one GEMM-like kernel: the slower of its memory traffic and its math."""
    peak = gpu.fp8_flops if fp8 else gpu.bf16_flops
    return max((weight_bytes + act_bytes) / (gpu.hbm_bytes_per_s * bandwidth), flops / (peak * efficiency))


def gemm(params: float, rows: float, bytes_per_param: float, dep: Deployment, k_dim: int, n_dim: int) -> float:
    """A [rows, k_dim] x [k_dim, n_dim] product over `params` weights (a sum of such GEMMs)."""
    act = rows * (k_dim + n_dim) * 2
    return roofline(params * bytes_per_param, act, 2 * rows * params, dep.gpu, bytes_per_param <= 1)


def attention_projections(arch: Architecture, dep: Deployment, tokens: float) -> float:
    """q_a + kv_a (replicated under TP), q_b, the absorbed w_kc and w_vc, o_proj, for `tokens` tokens."""
    a, H = arch, arch.heads / dep.tp_size
    w = dep.attention_weight_bytes
    down = gemm(a.hidden * (a.q_lora_rank + a.kv_lora_rank + a.rope_dim), tokens, w, dep, a.hidden,
                a.q_lora_rank + a.kv_lora_rank + a.rope_dim)
    q_b = gemm(a.q_lora_rank * H * (a.nope_dim + a.rope_dim), tokens, w, dep, a.q_lora_rank,
               H * (a.nope_dim + a.rope_dim))
    absorb = 2 * gemm(H * a.nope_dim * a.kv_lora_rank, tokens, w, dep, H * a.nope_dim, H * a.kv_lora_rank)
    o_proj = gemm(H * a.v_dim * a.hidden, tokens, w, dep, H * a.v_dim, a.hidden)
    return down + q_b + absorb + o_proj


def core_attention(arch: Architecture, dep: Deployment, requests: float, queries: int, context: int) -> float:
    """Absorbed MLA decode: each request's compressed KV (C + R per token) read once for its
    `queries` query tokens; QK over C + R and PV over C for each of this GPU's heads."""
    a = arch
    kv = requests * context * (a.kv_lora_rank + a.rope_dim) * dep.kv_bytes
    flops = 2 * requests * queries * context * (a.heads / dep.tp_size) * (2 * a.kv_lora_rank + a.rope_dim)
    return roofline(kv, 0, flops, dep.gpu, False, ATTENTION_BANDWIDTH, ATTENTION_FLOPS)


def dense_mlp(arch: Architecture, dep: Deployment, tokens: float) -> float:
    params = arch.hidden * arch.intermediate * 3 / dep.tp_size
    return gemm(params, tokens, dep.mlp_weight_bytes, dep, arch.hidden, arch.intermediate * 2 // dep.tp_size)


def group_tokens(dep: Deployment, tokens: float) -> float:
    """Tokens routed by all the GPUs that share this GPU's experts in one step."""
    return tokens * dep.ep_size if dep.dp_attention else tokens


def routed_rows(arch: Architecture, dep: Deployment, tokens: float) -> float:
    """Rows the busiest GPU's routed experts compute: its share of the group's tokens x top-k."""
    return group_tokens(dep, tokens) * arch.top_k / dep.ep_size * dep.imbalance


def active_local_experts(arch: Architecture, dep: Deployment, tokens: float) -> float:
    """This GPU's experts that receive at least one row (uniform routing): the weights it reads."""
    slots = arch.routed_experts + dep.redundant_experts
    local = slots / dep.ep_size
    return local * (1 - (1 - arch.top_k / slots) ** group_tokens(dep, tokens))


def moe_experts(arch: Architecture, dep: Deployment, tokens: float) -> float:
    """Shared expert + router + this GPU's routed experts (a grouped GEMM over its active experts)."""
    a, w = arch, dep.mlp_weight_bytes
    shared = gemm(a.expert_params * a.shared_experts / dep.tp_size, tokens, w, dep, a.hidden, 2 * a.moe_intermediate)
    router = gemm(a.hidden * a.routed_experts, tokens, 2.0, dep, a.hidden, a.routed_experts)
    rows = routed_rows(a, dep, tokens)
    weights = active_local_experts(a, dep, tokens) * a.expert_params / dep.tp_size * w
    act = rows * (a.hidden + 2 * a.moe_intermediate) * 2
    routed = roofline(weights, act, 2 * rows * a.expert_params / dep.tp_size, dep.gpu, w <= 1)
    return shared + router + routed


def small_kernels(arch: Architecture, dep: Deployment, tokens: float) -> float:
    """Norms, rope, quantization, routing, residual adds: a fixed cost each plus their traffic,
    and the fixed cost of each GEMM-like kernel."""
    traffic = ELEMENTWISE_PASSES * tokens * arch.hidden * 2 / (dep.gpu.hbm_bytes_per_s * ELEMENTWISE_BANDWIDTH)
    return (SMALL_KERNELS_PER_LAYER + GEMM_KERNELS_PER_LAYER) * KERNEL_OVERHEAD_S + traffic


def deepep_bandwidth(ep_size: int, gpu: GPU) -> tuple[float, float]:
    """DeepEP low-latency (dispatch, combine) bytes/s at `ep_size`, interpolated in log2(EP)
    between the published sizes, scaled by the NIC against the 50 GB/s CX7 it was measured on."""
    sizes = sorted(DEEPEP_LOW_LATENCY)
    ep = min(max(ep_size, sizes[0]), sizes[-1])
    lo = max(s for s in sizes if s <= ep)
    hi = min(s for s in sizes if s >= ep)
    t = 0 if lo == hi else (math.log2(ep) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    scale = gpu.ib_bytes_per_s / CX7 * GB
    return tuple(scale * (x + t * (y - x)) for x, y in zip(DEEPEP_LOW_LATENCY[lo], DEEPEP_LOW_LATENCY[hi]))


def expert_exchange(arch: Architecture, dep: Deployment, tokens: float) -> tuple[float, float]:
    """(dispatch, combine) seconds for `tokens` tokens of this GPU: one message per (token, expert)
    pair, FP8 with per-128 scales out, BF16 back; the busiest receiver sets the pace."""
    if dep.ep_size == 1:
        return 0.0, 0.0
    dispatch_bw, combine_bw = deepep_bandwidth(dep.ep_size, dep.gpu)
    pairs = tokens * arch.top_k * dep.imbalance
    dispatch = pairs * (arch.hidden + arch.hidden // 128 * 4 + 16) / dispatch_bw
    combine = pairs * arch.hidden * 2 / combine_bw
    return EXCHANGE_FLOOR_S + dispatch, EXCHANGE_FLOOR_S + combine


def allreduces(arch: Architecture, dep: Deployment, tokens: float) -> float:
    """Two all-reduces of [tokens, M] bf16 per layer under TP (after attention, after the MLP)."""
    if dep.tp_size == 1:
        return 0.0
    size = tokens * arch.hidden * 2
    return 2 * (ALLREDUCE_FLOOR_S + 2 * (dep.tp_size - 1) / dep.tp_size * size / dep.gpu.nvlink_bytes_per_s)


# ---------------------------------------------------------------------------------- one layer


@dataclass(frozen=True)
class LayerCost:
    attention: float  # projections + core attention
    mlp: float  # dense MLP or shared + routed experts
    kernels: float  # the small kernels and every kernel's fixed cost
    exchange: float  # dispatch + combine or all-reduces
    time: float  # with the deployment's overlap
    hidden_exchange: float  # the exchange seconds overlap hid

    @property
    def compute(self) -> float:
        return self.attention + self.mlp + self.kernels


def layer_compute(arch: Architecture, dep: Deployment, requests: float, queries: int, context: int,
                  moe: bool) -> tuple[float, float, float]:
    """(attention, MLP, small kernels) seconds of one layer for `requests` requests of `queries` tokens."""
    tokens = requests * queries
    attention = attention_projections(arch, dep, tokens) + core_attention(arch, dep, requests, queries, context)
    mlp = moe_experts(arch, dep, tokens) if moe else dense_mlp(arch, dep, tokens)
    return attention, mlp, small_kernels(arch, dep, tokens)


def layer_exchange(arch: Architecture, dep: Deployment, tokens: float, moe: bool) -> tuple[float, float]:
    """(send, back) seconds: dispatch and combine, each with one of the two TP all-reduces."""
    dispatch, combine = expert_exchange(arch, dep, tokens) if moe else (0.0, 0.0)
    allreduce = allreduces(arch, dep, tokens)
    return dispatch + allreduce / 2, combine + allreduce / 2


def ideal_overlap(overlap: str, compute: float, mlp: float, send: float, back: float) -> float:
    """Exchange seconds that two halves would hide perfectly (each argument is for both halves).
    two_batch: the halves alternate through the whole layer, so min(compute, exchange) hides;
    microbatch: dispatch A; dispatch B under A's experts; combine A under B's experts; combine B."""
    if overlap == "two_batch":
        return min(compute, send + back)
    return min(mlp / 2, send / 2) + min(mlp / 2, back / 2)


def layer_cost(arch: Architecture, dep: Deployment, requests: float, queries: int, context: int,
               moe: bool) -> LayerCost:
    """One decoder layer under the deployment's overlap (see the module docstring). Split in two
    halves (the whole layer for two_batch, the MoE for microbatch), the split kernels run twice and
    both halves read the weights."""
    if dep.overlap == "none" or requests < 2 or not moe:
        attention, mlp, kernels = layer_compute(arch, dep, requests, queries, context, moe)
        send, back = layer_exchange(arch, dep, requests * queries, moe)
        return LayerCost(attention, mlp, kernels, send + back, attention + mlp + kernels + send + back, 0.0)
    half = layer_compute(arch, dep, requests / 2, queries, context, moe)
    if dep.overlap == "two_batch":
        attention, mlp, kernels = (2 * x for x in half)
    else:
        attention, _, kernels = layer_compute(arch, dep, requests, queries, context, moe)
        mlp, kernels = 2 * half[1], kernels + MOE_KERNELS_PER_LAYER * KERNEL_OVERHEAD_S
    send, back = (2 * x for x in layer_exchange(arch, dep, requests / 2 * queries, moe))
    compute = attention + mlp + kernels
    hidden = OVERLAP_EFFICIENCY * ideal_overlap(dep.overlap, compute, mlp, send, back)
    return LayerCost(attention, mlp, kernels, send + back, compute + send + back - hidden, hidden)


# ---------------------------------------------------------------------------------- one step


@dataclass(frozen=True)
class StepCost:
    """One decode/verify step of one GPU, in seconds, and its parts."""

    breakdown: dict[str, float]
    exchange: float  # all the expert exchange and all-reduce seconds
    hidden_exchange: float  # of which overlap hid this much

    @property
    def seconds(self) -> float:
        return sum(self.breakdown.values())


def lm_head(arch: Architecture, dep: Deployment, rows: float) -> float:
    return gemm(arch.hidden * arch.vocab / dep.tp_size, rows, 2.0, dep, arch.hidden, arch.vocab // dep.tp_size)


def sampling(arch: Architecture, dep: Deployment, rows: float) -> float:
    """Softmax, top-k/p and the verify test over float32 logits: 4 passes, 6 kernels."""
    return 6 * KERNEL_OVERHEAD_S + 4 * rows * arch.vocab * 4 / (dep.gpu.hbm_bytes_per_s * ELEMENTWISE_BANDWIDTH)


def mtp_drafts(arch: Architecture, dep: Deployment, requests: float, context: int, k: int) -> float:
    """k chained passes of the MTP layer (eh_proj + one MoE decoder layer + lm_head + sampling),
    the first over the 1+k verified tokens of each request, the rest over one."""
    if dep.mtp_weight_bytes is not None:
        dep = replace(dep, attention_weight_bytes=dep.mtp_weight_bytes, mlp_weight_bytes=dep.mtp_weight_bytes)
    total = 0.0
    for i in range(k):
        queries = 1 + k if i == 0 else 1
        tokens = requests * queries
        eh_proj = gemm(2 * arch.hidden * arch.hidden, tokens, 2.0, dep, 2 * arch.hidden, arch.hidden)
        layer = layer_cost(arch, dep, requests, queries, context, moe=True).time
        total += eh_proj + layer + lm_head(arch, dep, requests) + sampling(arch, dep, requests)
    return total


def host_time(arch: Architecture, dep: Deployment, k: int) -> tuple[float, float]:
    """(kernel launches, serial host work) in seconds: eager launches run alongside the device (the
    step takes the longer of the two); the step's host work adds when the scheduler does not
    overlap it with the device."""
    kernels = (arch.layers + k) * (SMALL_KERNELS_PER_LAYER + GEMM_KERNELS_PER_LAYER + 2) + 10
    launches = 0.0 if dep.cuda_graphs else kernels * HOST_LAUNCH_S
    return launches, 0.0 if dep.host_overlap else HOST_STEP_S


def step_cost(arch: Architecture, dep: Deployment, requests: float, context: int, k: int) -> StepCost:
    """One step of one GPU: `requests` requests per attention group (one GPU with DP attention,
    tp_size GPUs with TP), each verifying 1+k tokens at `context` tokens of KV."""
    queries = 1 + k
    dense = layer_cost(arch, dep, requests, queries, context, moe=False)
    moe = layer_cost(arch, dep, requests, queries, context, moe=True)
    n_moe = arch.layers - arch.dense_layers
    layers = [(arch.dense_layers, dense), (n_moe, moe)]
    device = {
        "attention": sum(n * c.attention for n, c in layers),
        "kernels": sum(n * c.kernels for n, c in layers),
        "dense_mlp": arch.dense_layers * dense.mlp,
        "moe": n_moe * moe.mlp,
        "exchange_unhidden": sum(n * (c.exchange - c.hidden_exchange) for n, c in layers),
        "lm_head": lm_head(arch, dep, requests * queries),
        "sampling": sampling(arch, dep, requests * queries),
        "mtp": mtp_drafts(arch, dep, requests, context, k),
    }
    launches, host_step = host_time(arch, dep, k)
    device["host"] = max(launches - sum(device.values()), 0.0) + host_step
    exchange = sum(n * c.exchange for n, c in layers)
    hidden = sum(n * c.hidden_exchange for n, c in layers)
    return StepCost(device, exchange, hidden)


# ---------------------------------------------------------------------------------- speed


def accept_length(p: float, k: int) -> float:
    """Tokens per step of a k-token chain whose drafts are each accepted with probability p."""
    if not 0 <= p <= 1:
        raise ValueError(f"accept rate {p}: expected a probability in [0, 1]")
    return float(k + 1) if p == 1 else (1 - p ** (k + 1)) / (1 - p)


# DeepSeek-V3 technical report §5.4.3: "the acceptance rate of the second token prediction ranges
# between 85% and 90%" (https://arxiv.org/abs/2412.19437).
DEFAULT_ACCEPT_RATE = 0.85


@dataclass(frozen=True)
class Speed:
    k: int
    tokens_per_step: float
    step_s: float
    tokens_per_s_per_user: float
    tokens_per_s_per_gpu: float
    breakdown: dict[str, float] = field(default_factory=dict)
    exchange_s: float = 0.0
    hidden_exchange_s: float = 0.0


def speed(arch: Architecture, dep: Deployment, requests: float, context: int, k: int,
          tokens_per_step: float) -> Speed:
    """Speed of one step with k drafts yielding `tokens_per_step` tokens per request."""
    cost = step_cost(arch, dep, requests, context, k)
    per_user = tokens_per_step / cost.seconds
    return Speed(k, tokens_per_step, cost.seconds, per_user, per_user * requests / dep.group_gpus,
                 cost.breakdown, cost.exchange, cost.hidden_exchange)


def predict(arch: Architecture, dep: Deployment, requests: float, context: int, accept_rate: float,
            config_k: int, ks: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    """The `throughput` section of `moespec plan`: the step at the config's k, the speed at each k
    of `ks` from the accept rate, and the k with the most tokens/s per user."""
    if requests <= 0 or context <= 0:
        raise ValueError(f"batch {requests} and context {context} must be positive")
    by_k = {k: speed(arch, dep, requests, context, k, accept_length(accept_rate, k)) for k in sorted({*ks, config_k})}
    base, chosen = by_k[0], by_k[config_k]
    best = max(by_k.values(), key=lambda s: s.tokens_per_s_per_user)
    return {
        "gpu": dep.gpu.name, "batch_per_gpu": requests / dep.group_gpus, "context": context,
        "accept_rate": accept_rate, "k": config_k,
        "step_ms": chosen.step_s * 1e3,
        "tokens_per_s_per_gpu": chosen.tokens_per_s_per_gpu,
        "tokens_per_s_per_user": chosen.tokens_per_s_per_user,
        "breakdown": {name: s * 1e3 for name, s in chosen.breakdown.items()},
        "exchange_ms": chosen.exchange_s * 1e3, "exchange_hidden_ms": chosen.hidden_exchange_s * 1e3,
        "by_k": {str(k): {"accept_length": s.tokens_per_step, "step_ms": s.step_s * 1e3,
                          "tokens_per_s_per_user": s.tokens_per_s_per_user,
                          "tokens_per_s_per_gpu": s.tokens_per_s_per_gpu,
                          "speedup": s.tokens_per_s_per_user / base.tokens_per_s_per_user} for k, s in by_k.items()},
        "best_k": best.k,
    }


def deployment_from_config(config, gpu: GPU, quantization: str, imbalance: float = 1.0) -> Deployment:
    """The Deployment of a moespec EngineConfig: its EP size, DP attention, overlap, FP8, graphs."""
    p = config.parallel
    overlap = "two_batch" if p.two_batch_overlap else "microbatch" if p.microbatch else "none"
    fp8 = 1.0 if quantization == "fp8" else 2.0
    return Deployment(gpu, ep_size=p.ep_size, dp_attention=p.attention == "dp", overlap=overlap,
                      cuda_graphs=config.model.cuda_graph, host_overlap=config.scheduler.overlap,
                      imbalance=imbalance, attention_weight_bytes=fp8, mlp_weight_bytes=fp8)



def gpu_named(name: str) -> GPU:
    try:
        return GPUS[name.upper()]
    except KeyError:
        raise ValueError(f"--gpu {name!r}: expected one of {', '.join(GPUS)}") from None


def plan_throughput(config, hf: dict, gpu: GPU, batch_per_gpu: float, context: int, accept_rate: float,
                    quantization: str, imbalance: float = 1.0) -> dict:
    """`moespec plan`'s throughput section for an EngineConfig and its config.json."""
    arch = Architecture.from_hf(hf)
    dep = deployment_from_config(config, gpu, quantization, imbalance)
    spec = config.speculation
    k = spec.num_speculative_tokens if spec.mode == "mtp" else 0
    section = predict(arch, dep, batch_per_gpu * dep.group_gpus, context, accept_rate, k)
    section["deployment"] = {"ep_size": dep.ep_size, "dp_attention": dep.dp_attention, "overlap": dep.overlap,
                             "fp8": quantization == "fp8", "cuda_graphs": dep.cuda_graphs,
                             "host_overlap": dep.host_overlap, "imbalance": dep.imbalance}
    return section


def describe(section: dict) -> str:
    """The throughput section as text."""
    d = section["deployment"]
    lines = [f"throughput (predicted, not measured; docs/performance-model.md): {section['gpu']}, "
             f"{section['batch_per_gpu']:g} requests per GPU at {section['context']} tokens of context, "
             f"EP {d['ep_size']}, overlap {d['overlap']}, CUDA graphs {'on' if d['cuda_graphs'] else 'off'}",
             f"  step at k={section['k']}: {section['step_ms']:.2f} ms = "
             + ", ".join(f"{name} {ms:.2f}" for name, ms in section["breakdown"].items() if ms > 0.005),
             f"  expert exchange {section['exchange_ms']:.2f} ms, of which two halves hide "
             f"{section['exchange_hidden_ms']:.2f} ms",
             f"  {section['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {section['tokens_per_s_per_user']:.1f} "
             f"tokens/s per user"]
    lines.append(f"  by draft length k (accept rate {section['accept_rate']:g} per draft token):")
    for k, s in section["by_k"].items():
        lines.append(f"    k={k}: {s['accept_length']:.2f} tokens/step, step {s['step_ms']:.2f} ms, "
                     f"{s['tokens_per_s_per_user']:.1f} tok/s/user, {s['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, "
                     f"{s['speedup']:.2f}x")
    lines.append(f"  best k: {section['best_k']}")
    return "\n".join(lines)
