"""Building blocks shared by the models: norms, rotary embeddings, linear layers, MLPs.

Shapes legend: T tokens (flattened batch), H heads, D head dim, R rope dim, M hidden size,
I intermediate size, V vocab.
"""
from __future__ import annotations

import contextvars
import functools
import itertools
import logging
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moespec.models.errors import WeightError
from moespec.models.fp8 import BLOCK as FP8_BLOCK
from moespec.models.fp8 import fp8_linear, is_fp8, scale_shape


# set while a step runs captured (moespec.static_step.CapturedStep): its graph is replayed as recorded
CAPTURING = contextvars.ContextVar("moespec_capturing", default=False)
# and meanwhile: a device scalar, the number of leading rows of the padded batch that are real (the
# captured step refills it before each replay), so padded rows are kept out of the expert exchange
REAL_ROWS = contextvars.ContextVar("moespec_real_rows", default=None)


def fixed_shapes() -> bool:
    """Whether this forward runs as a static step, compiled or captured: every shape fixed by the
    padded batch, nothing read on the host."""
    return torch.compiler.is_compiling() or CAPTURING.get()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # normalize in float32, scale in the input dtype (as the reference implementations do)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


SMALL_ROWS = range(2, 33)  # row counts for which CPU float32 linears run as weight @ xᵀ


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           pad_single_row: bool = False) -> torch.Tensor:
    """F.linear, except for 2-32 rows of float32 on the CPU (and one row, with `pad_single_row`).

    There MKL's F.linear over a few rows costs about one matrix-vector product per row, each
    reading the whole weight; weight @ xᵀ runs as one GEMM that reads it once: 2-4.5x faster for a
    weight streamed from memory (`benchmarks/bench_linear.py`). A single row padded to two takes
    that path too: about 3x faster from memory, but 2.4x slower for a weight in cache, so the
    model runner pads only for models larger than the last-level cache.
    x [N, in], weight [out, in] -> [N, out].
    """
    rows = x.shape[0]
    fast = rows in SMALL_ROWS or (rows == 1 and pad_single_row)
    if not fast or x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    columns = (x if rows > 1 else torch.cat([x, x])).t()  # [in, max(N, 2)]
    out = torch.mm(weight, columns).t()[:rows].contiguous()  # [N, out]
    return out if bias is None else out + bias


class OpObjects:
    """Objects an opaque op of a compiled graph finds by the int key the graph holds
    (`moespec::packed_linear`, `moespec::ep_experts`); weakly held, never kept alive."""

    def __init__(self) -> None:
        self.objects: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.keys = itertools.count()

    def add(self, obj) -> int:
        key = next(self.keys)
        self.objects[key] = obj
        return key

    def __getitem__(self, key: int):
        return self.objects[key]


OP_OBJECTS = OpObjects()
PACK_ROWS_HINT = 16  # oneDNN picks its weight layout for about this many rows; any count runs
# float32 copies only (bfloat16's F.linear is oneDNN's too, unpacked: packed wins at every size and row count):
PACKED_MIN_ROWS = 8  # fewer rows run unpacked: there the weights' bytes bound both (measured in the engine)
PACKED_MIN_ELEMENTS = 1 << 16  # smaller weights stay unpacked: oneDNN's ~15 µs a call loses to MKL's
BF16_NEEDS = "AVX-512 BW, VL and DQ, or AVX-NE-CONVERT"  # what oneDNN's bfloat16 linear needs of an x86-64 CPU
logger = logging.getLogger("moespec.models")


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs and runs linear weights of `dtype`, by torch's own checks
    (the single query: everything that packs asks it, and tests replace it). float32 runs on any
    x86-64 CPU; bfloat16 needs BF16_NEEDS (`torch.ops.mkldnn._is_mkldnn_bf16_supported`, the
    check `mkldnn_reorder_linear_weight` makes). ONEDNN_MAX_CPU_ISA=AVX2 in the environment makes
    oneDNN, and so this, answer as on a CPU without AVX-512 (README, "Tests")."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack_dtype(weight: torch.Tensor, device_type: str | None = None) -> torch.dtype | None:
    """The dtype of the copy `weight` gets packed as, None where it gets none: on the CPU (or on
    `device_type`, for a model built on the meta device and sized by moespec.plan), a bfloat16
    weight as itself at every size where oneDNN runs bfloat16, else as float32 (then it follows
    float32's rules); float32 from PACKED_MIN_ELEMENTS elements."""
    if (device_type or weight.device.type) != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if weight.dtype == torch.bfloat16 and onednn_packs(torch.bfloat16):
        return torch.bfloat16
    if weight.numel() < PACKED_MIN_ELEMENTS or not onednn_packs(torch.float32):
        return None
    return torch.float32


def packable(weight: torch.Tensor, device_type: str | None = None) -> bool:
    """Whether `weight` gets a packed copy (pack_dtype)."""
    return pack_dtype(weight, device_type) is not None


@functools.cache
def log_float32_fallback() -> None:
    logger.info("bfloat16 linears run as float32 over float32 packed copies (from %d rows; fewer: F.linear): this "
                "CPU's oneDNN has no bfloat16 linear, which needs %s (torch: %s)", PACKED_MIN_ROWS, BF16_NEEDS,
                torch.backends.cpu.get_cpu_capability())


def tensor_version(t: torch.Tensor) -> int:
    """The in-place update count of `t` (inference tensors keep none: 0)."""
    return 0 if t.is_inference() else t._version


class PackedWeight:
    """A weight [out, in], `arrange(source)`, reordered once into oneDNN's blocked layout; calling
    it runs oneDNN's linear over that copy: for 5-16 rows 1.3-3.4x faster than float32 F.linear
    (MKL) on weights of 768 x 256 and up in `benchmarks/bench_linear.py` (docs/benchmarks.md,
    "Packed linears"), at the cost of a second copy of the weight. The copy is in `dtype`
    (pack_dtype): a bfloat16 weight packed as float32, on a CPU whose oneDNN has no bfloat16,
    runs its inputs and outputs through float32. A source changed in place is packed again
    before the next eager call; compiled steps read the copy as it is."""

    def __init__(self, source: torch.Tensor, arrange=lambda w: w) -> None:
        self.dtype = pack_dtype(source)
        if self.dtype is None:
            raise ValueError(f"a {source.dtype} weight of {source.numel()} elements on {source.device} is not packed "
                             "(models.layers.pack_dtype)")
        if self.dtype != source.dtype:
            log_float32_fallback()
        self.source, self.arrange = source, arrange
        self.key = OP_OBJECTS.add(self)
        self.repack()

    @property
    def nbytes(self) -> int:
        """The bytes of the packed copy (its layout's padding aside)."""
        return self.source.numel() * self.dtype.itemsize

    def repack(self) -> None:
        with torch.no_grad():
            weight = self.arrange(self.source.detach()).to(self.dtype).contiguous()  # [out, in]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        self.out_features = weight.shape[0]
        self.version = tensor_version(self.source)

    def applies(self, x: torch.Tensor) -> bool:
        """Whether x [..., in] runs packed: no autograd, the weight's dtype, enough rows for a float32 copy."""
        if torch.is_grad_enabled() or x.dtype != self.source.dtype:
            return False
        return self.dtype != torch.float32 or x.numel() >= PACKED_MIN_ROWS * x.shape[-1]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if x.dtype != self.dtype:  # a bfloat16 weight packed as float32
            bias = None if bias is None else bias.to(self.dtype)
            return self(x.to(self.dtype), bias).to(x.dtype)
        if torch.compiler.is_compiling():
            return torch.ops.moespec.packed_linear(x, bias, self.key, self.out_features)
        if self.version != tensor_version(self.source):  # changed in place since packing
            self.repack()
        return run_packed(x, self.packed, bias)


def run_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# `moespec::packed_linear(x, bias, key, out_features)`: PackedWeight `key` over x, as one opaque op
# in a compiled graph (inductor lowers oneDNN's linear only for weights frozen into the graph, and
# an opaque-layout weight cannot be traced). Defined through torch.library.Library rather than
# custom_op: a call costs ~3 µs less.
PACKED_LINEAR_LIB = torch.library.Library("moespec", "FRAGMENT")
PACKED_LINEAR_LIB.define("packed_linear(Tensor x, Tensor? bias, int key, int out_features) -> Tensor")


@torch.library.impl(PACKED_LINEAR_LIB, "packed_linear", "CPU")
def packed_linear_cpu(x: torch.Tensor, bias: torch.Tensor | None, key: int, out_features: int) -> torch.Tensor:
    return run_packed(x, OP_OBJECTS[key].packed, bias)


@torch.library.register_fake("moespec::packed_linear", lib=PACKED_LINEAR_LIB)
def _(x: torch.Tensor, bias: torch.Tensor | None, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class Linear(nn.Linear):
    """nn.Linear with one dispatch point for FP8-resident and packed weights.

    `to_fp8()` (on a model built on the meta device, before its weights are materialized) makes
    `weight` e4m3 [out, in] with its 128x128 block scales `weight_scale_inv` [ceil(out/128),
    ceil(in/128)], as DeepSeek's checkpoints store them; forward then runs the block-scaled FP8
    GEMM (models.fp8). Otherwise weights are in the model dtype.

    `pack()` (CPU: bfloat16, or float32 of 64Ki elements or more; pack_dtype) keeps the weight
    also as a PackedWeight, which forwards without autograd run through (a float32 copy: of 8 rows
    or more).
    """

    pad_single_row = False  # see `linear`; set by the model runner for models that stream weights
    packed: PackedWeight | None = None  # made by pack()

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale_inv", None)

    def packed_sources(self, device_type: str | None = None) -> list[torch.Tensor]:
        """The weights `pack()` packs (none where packing does not apply)."""
        return [self.weight] if packable(self.weight, device_type) else []

    def pack(self) -> bool:
        """Keep the weight also packed for oneDNN (see the class); False where that does not apply
        (pack_dtype)."""
        if not self.packed_sources():
            return False
        self.packed = PackedWeight(self.weight)
        return True

    def to_fp8(self) -> None:
        out_dim, in_dim = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape(out_dim, in_dim), device=device),
                                             requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_fp8(self.weight):
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)
        if self.packed is not None and self.packed.applies(x):
            return self.packed(x, self.bias)
        return linear(x, self.weight, self.bias, self.pad_single_row)


class MergedLinear(Linear):
    """Linears over the same input kept as one weight [sum of outs, in] (q/k/v, gate/up): one GEMM
    and one call where the checkpoint has several.

    Checkpoints keep the separate tensors (`<parent>.q_proj.weight`, ...): the loader maps them here
    through `merged_aliases` and `load_part` copies each into its rows; `unmerge_tensors` splits
    them again for saving. `split` cuts an output into the parts, in the order of `parts`.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)  # checkpoint module name -> output features, in row order
        self.sizes = list(parts.values())
        self.mark_parts()

    def mark_parts(self) -> None:
        for param in (self.weight, self.bias, self.weight_scale_inv):
            if param is not None:
                param.weight_loader = self.locate_part
                param.num_loads = len(self.parts)

    def to_fp8(self) -> None:
        """Each part's rows must fill whole 128-row scale blocks."""
        if any(size % FP8_BLOCK for size in self.sizes):
            raise ValueError(f"parts {self.parts} are not multiples of {FP8_BLOCK} rows: they cannot share FP8 "
                             "block scales")
        super().to_fp8()
        self.mark_parts()

    def locate_part(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The rows of `param` that checkpoint tensor `name` (one part's weight, bias or scales) fills."""
        part = name.rsplit(".", 2)[-2]
        if part not in self.parts:
            raise WeightError(f"tensor {name!r} is none of {list(self.parts)}")
        start = sum(self.sizes[: list(self.parts).index(part)])
        rows = self.parts[part]
        if param is self.weight_scale_inv:
            start, rows = start // FP8_BLOCK, rows // FP8_BLOCK
        return param[start: start + rows]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[N, sum of outs] -> one [N, out] view per part."""
        return y.split(self.sizes, dim=-1)


def merged_parts(model: nn.Module):
    """(merged parameter name, checkpoint names of its parts, their sizes) for every weight and
    bias of the MergedLinear modules of `model`."""
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = name.rpartition(".")[0]
            for kind in ("weight", "bias", "weight_scale_inv"):
                if kind == "weight_scale_inv" and module.weight_scale_inv is None:
                    continue
                parts = [f"{parent}.{part}.{kind}".lstrip(".") for part in module.parts]
                sizes = [s // FP8_BLOCK for s in module.sizes] if kind == "weight_scale_inv" else module.sizes
                yield f"{name}.{kind}", parts, sizes


def merged_aliases(model: nn.Module) -> dict[str, str]:
    """Checkpoint tensor name of each part of a MergedLinear -> the merged parameter's name."""
    return {part: merged for merged, parts, _ in merged_parts(model) for part in parts}


def packing_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that pack weights (Linear, LocalExperts: `packed_sources`, `pack`)."""
    return [module for module in model.modules() if hasattr(module, "packed_sources")]


def pack_linears(model: nn.Module) -> int:
    """Pack the weights of every module of `model` that can, for oneDNN on the CPU (pack_dtype:
    what this CPU runs); returns how many modules did."""
    return sum(module.pack() for module in packing_modules(model))


def unmerge_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of `model` with each merged parameter split back into the checkpoint's parts."""
    out = dict(tensors)
    for merged, parts, sizes in merged_parts(model):
        if merged in out:
            out.update(zip(parts, out.pop(merged).split(sizes)))
    return out


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up as one merged projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size},
                                         bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


# ---------------------------------------------------------------- rotary embeddings


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters as HF configs write them (`rope_scaling` or `rope_parameters`)."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | yarn | llama3
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    ALLOWED_TYPES = ("default", "linear", "yarn", "llama3")

    @classmethod
    def from_hf(cls, hf: dict) -> "RopeConfig":
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in cls.ALLOWED_TYPES:
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported; allowed: {cls.ALLOWED_TYPES}")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim", "attention_factor", "truncate", "low_freq_factor", "high_freq_factor")
        given = {k: params[k] for k in keys if params.get(k) is not None}
        return cls(theta=float(theta), type=rope_type, **given)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def compute_inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale ("attention factor") for a rope type."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.type == "default":
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return llama3_inv_freq(inv_freq, rope), 1.0
    return yarn_inv_freq(rope, dim, max_position_embeddings)


def llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or 8192
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin for token positions, looked up in a float32 table built once; `interleave` rotates
    pairs (x0,x1),(x2,x3) as DeepSeek does.

    The table and the inverse frequencies are plain attributes, not buffers, so that casting the
    model to bfloat16 leaves them float32 (rounded frequencies would turn distant positions by
    wrong angles); the table follows the positions' device on first use.
    """

    def __init__(self, dim: int, rope: RopeConfig, max_position_embeddings: int, interleave: bool = False) -> None:
        super().__init__()
        with torch.device("cpu"):  # real tables even when the model is built on the meta device
            self.inv_freq, self.scale = compute_inv_freq(rope, dim, max_position_embeddings)  # [R/2] float32
            self.cos_sin = self.compute_cos_sin(max_position_embeddings)  # [P, R]: cos | sin
        self.interleave = interleave

    def compute_cos_sin(self, num_positions: int) -> torch.Tensor:
        freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * self.inv_freq[None, :]  # [P, R/2]
        return torch.cat([freqs.cos() * self.scale, freqs.sin() * self.scale], dim=-1)

    def reserve(self, num_positions: int) -> None:
        """Extend the table to positions 0..num_positions-1 (a cache may outgrow the model's max)."""
        if num_positions > self.cos_sin.shape[0]:
            with torch.device("cpu"):
                self.cos_sin = self.compute_cos_sin(num_positions).to(self.cos_sin.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, R/2] each."""
        if self.cos_sin.device != positions.device:
            self.cos_sin = self.cos_sin.to(positions.device)
        cos, sin = self.cos_sin[positions].to(dtype).chunk(2, dim=-1)
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, R] -> rotated [T, H, R]; interleaved input comes out de-interleaved (same for q and k)."""
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reserve_rope_positions(model: nn.Module, num_positions: int) -> None:
    """Let every rotary table of `model` cover positions 0..num_positions-1."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reserve(num_positions)
