"""Block-scaled FP8 GEMMs for DeepSeek's released weights: e4m3 weights [N, K] with one float32
scale per 128x128 block, `weight_scale_inv` [ceil(N/128), ceil(K/128)] (the value is weight x scale).

Two implementations behind one dispatch:
- CPU (reference): activations stay unquantized; each block row of 128 output features is
  dequantized into a [128, K] slab and multiplied, so no full-precision copy of the weight ever
  exists. Correctness is the point, not speed.
- CUDA: activations quantized per token per 128 channels (as DeepSeek's inference does), then
  torch's block-scaled `scaled_mm` (1x128 activation scales, 128x128 weight scales), which needs
  SM90 and cuBLASLt >= 12.9; elsewhere, or for a partial block, the weight is dequantized in
  slabs of 2048 output features. `meta` tensors take the CUDA path, so torch's meta checks (the
  CUDA kernel's, mirrored) check every call's layouts on a CPU (tests/test_fp8.py). Untested on
  GPU in this project so far.

Routed experts use the grouped form: rows sorted by expert, one call for all of them.

Shapes legend: T tokens (rows), K input features, N output features, E experts.
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

BLOCK = 128
DEVICE_SLAB_ROWS = 2048  # the fallback's output features per dequantized slab on a GPU (28 MiB at K = 7168)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_MAX = 448.0


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """weight_scale_inv shape of an [rows, cols] weight."""
    return -(-rows // BLOCK), -(-cols // BLOCK)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 weight [N, K] with 128x128 block scales [ceil(N/128), ceil(K/128)] -> [N, K] in `dtype`."""
    out_dim, in_dim = weight.shape
    scale = scale_inv.float().repeat_interleave(BLOCK, 0)[:out_dim].repeat_interleave(BLOCK, 1)[:, :in_dim]
    return (weight.float() * scale).to(dtype)


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> e4m3 [N, K] and block scales [ceil(N/128), ceil(K/128)], as DeepSeek quantizes its
    weights (each block's largest magnitude maps to 448)."""
    N, K = weight.shape
    rows, cols = scale_shape(N, K)
    padded = weight.float().new_zeros(rows * BLOCK, cols * BLOCK)
    padded[:N, :K] = weight.float()
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX  # [rows, cols]
    quantized = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized.view(rows * BLOCK, cols * BLOCK)[:N, :K].contiguous(), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ dequantized(weight [N, K])ᵀ (+ bias) -> [T, N] in x's dtype. CUDA (and `meta`, whose
    checks are the CUDA ones): torch's block-scaled GEMM where the GPU and the shape allow it,
    else the weight dequantized in slabs; CPU: the reference."""
    if x.is_cuda or x.is_meta:
        if blockwise_gemm_fits(x, weight):
            return cuda_fp8_linear(x, weight, scale_inv, bias)
        return reference_fp8_linear(x, weight, scale_inv, bias, slab_rows=DEVICE_SLAB_ROWS)
    return reference_fp8_linear(x, weight, scale_inv, bias)


def blockwise_gemm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's 1x128 x 128x128 `scaled_mm` takes x [T, K] @ weight [N, K]ᵀ: K and N whole
    blocks (torch's meta checks count K // 128 and N // 128 blocks where its CUDA kernel counts
    them rounded up: a partial block, such as DeepSeek-V3's kv_a_proj_with_mqa N = 576, passes only
    one of them, so it takes the fallback), bfloat16 activations (DeepSeek's recipe; other output
    dtypes are not known to have the kernel), on a GPU whose cuBLASLt has it (meta: always)."""
    whole = x.shape[1] % BLOCK == 0 and weight.shape[0] % BLOCK == 0 and x.dtype == torch.bfloat16
    return whole and (x.is_meta or blockwise_scaled_mm_supported(x.device.index or 0))


@functools.cache
def blockwise_scaled_mm_supported(device_index: int) -> bool:
    """DeepSeek-style block scaling in torch's `scaled_mm` runs on SM90 only, with cuBLAS and
    cuBLASLt >= 12.9 (torch's ScaledBlas.cpp `_check_deepseek_support`, which raises otherwise);
    elsewhere FP8 linears dequantize the weight in slabs (`reference_fp8_linear`)."""
    if not hasattr(F, "scaled_mm") or torch.version.cuda is None:
        return False
    built = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    major, _ = torch.cuda.get_device_capability(device_index)
    return major == 9 and built >= (12, 9) and cublaslt_version() >= 120900


def cublaslt_version() -> int:
    """The loaded cuBLASLt's version (e.g. 120903 for 12.9.3; 0 when it cannot be read)."""
    for name in cublaslt_names(torch.version.cuda):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        return int(lib.cublasLtGetVersion())
    return 0


def cublaslt_names(cuda: str | None) -> list[str]:
    """The cuBLASLt sonames to read, the one of torch's own CUDA major first (a host may also hold
    another CUDA's, which torch does not load)."""
    majors = ["13", "12"]
    if cuda:
        majors.sort(key=lambda major: major != cuda.split(".")[0])
    return [f"libcublasLt.so.{major}" for major in majors] + ["libcublasLt.so"]


def reference_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None, slab_rows: int = BLOCK) -> torch.Tensor:
    """Slab by slab of `slab_rows` output features (whole blocks): dequantize [slab_rows, K],
    multiply, place; no full-precision copy of the whole weight."""
    N, K = weight.shape
    out = x.new_empty(x.shape[0], N)  # [T, N]
    blocks = slab_rows // BLOCK
    column_scales = scale_inv.float().repeat_interleave(BLOCK, 1)[:, :K]  # [N/128, K]
    for first in range(0, column_scales.shape[0], blocks):
        rows = slice(first * BLOCK, min((first + blocks) * BLOCK, N))
        scales = column_scales[first:first + blocks].repeat_interleave(BLOCK, 0)[:rows.stop - rows.start]
        slab = (weight[rows].float() * scales).to(x.dtype)  # [<=slab_rows, K]
        out[:, rows] = x @ slab.t()
    return out if bias is None else out + bias


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> e4m3 [T, K] and float32 scales [T, K/128] (value = fp8 x scale), K % 128 == 0."""
    T, K = x.shape
    groups = x.float().view(T, K // BLOCK, BLOCK)
    scales = groups.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX  # [T, K/128]
    quantized = (groups / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized.view(T, K), scales


def cuda_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek's recipe on torch's block-scaled GEMM (`blockwise_gemm_fits`): 1x128 activation
    scales, 128x128 weight scales, each in the layout torch 2.13's ScaledBlas.cpp
    (`_scaled_block1x128_block128x128`) and its meta check require; weight read as [K, N]
    column-major."""
    if x.shape[0] == 0:
        out = x.new_empty(0, weight.shape[0])
        return out if bias is None else out + bias
    x_fp8, x_scales = quantize_per_token_group(x)
    recipe = F.ScalingType
    return F.scaled_mm(x_fp8, weight.t(), m_major(x_scales), recipe.BlockWise1x128, padded_block_scales(scale_inv),
                       recipe.BlockWise128x128, bias=bias, output_dtype=x.dtype)


def m_major(x_scales: torch.Tensor) -> torch.Tensor:
    """Activation scales [T, K/128] -> the same values with strides (1, T), as scale_a must be for
    every T. (`.t().contiguous().t()` gives strides (K/128, 1) when T = 1, which torch refuses.)"""
    T, groups = x_scales.shape
    out = torch.empty_strided((T, groups), (1, T), dtype=torch.float32, device=x_scales.device)
    return out.copy_(x_scales)


def padded_block_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """Weight scales [N/128, K/128] (as stored) -> scale_b [L4, N/128] with strides (1, L4),
    L4 = K/128 rounded up to a multiple of 4: torch's layout for 128x128 weight blocks. The padding
    blocks are zeros (no K reaches them)."""
    blocks_n, blocks_k = scale_inv.shape
    L4 = -(-blocks_k // 4) * 4
    padded = scale_inv.new_zeros(blocks_n, L4, dtype=torch.float32)
    padded[:, :blocks_k] = scale_inv
    return padded.t()


def batched_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [E, T, K] @ dequantized(weight [E, N, K])ᵀ -> [E, T, N]: every row of every expert. CPU:
    every expert at once, one block of 128 output features at a time; CUDA (and meta): each
    expert's block-scaled GEMM (`fp8_linear`)."""
    if x.is_cuda or x.is_meta:
        return torch.stack([fp8_linear(x[e], weight[e], scale_inv[e]) for e in range(weight.shape[0])])
    E, N, K = weight.shape
    out = x.new_empty(E, x.shape[1], N)
    column_scales = scale_inv.float().repeat_interleave(BLOCK, 2)[:, :, :K]  # [E, N/128, K]
    for block in range(column_scales.shape[1]):
        rows = slice(block * BLOCK, min((block + 1) * BLOCK, N))
        slab = (weight[:, rows].float() * column_scales[:, block, None]).to(x.dtype)  # [E, <=128, K]
        out[:, :, rows] = torch.bmm(x, slab.transpose(1, 2))
    return out


def grouped_rows_linear(x: torch.Tensor, ends: torch.Tensor, weight: torch.Tensor,
                        scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] with rows grouped by expert, group e ending at row ends[e] (int32 [E], on x's
    device, never read on the host), weight [E, N, K] (FP8 with scale_inv [E, N/128, K/128], or
    plain) -> [R, N]: group e's rows times weight[e]ᵀ, rows past ends[-1] not computed (undefined).
    One `grouped_mm` per projection (FP8: per block of 128 output features, dequantized for every
    expert at once), whose kernel reads the ends: the work follows the rows, the shapes do not."""
    if scale_inv is None:
        return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    E, N, K = weight.shape
    out = x.new_empty(x.shape[0], N)  # [R, N]
    column_scales = scale_inv.float().repeat_interleave(BLOCK, 2)[:, :, :K]  # [E, N/128, K]
    for block in range(column_scales.shape[1]):
        rows = slice(block * BLOCK, min((block + 1) * BLOCK, N))
        slab = (weight[:, rows].float() * column_scales[:, block, None]).to(x.dtype)  # [E, <=128, K]
        out[:, rows] = F.grouped_mm(x, slab.transpose(1, 2), offs=ends)
    return out


def grouped_mm_reads_no_host(x: torch.Tensor) -> bool:
    """Whether torch's grouped_mm runs over x's rows without reading its group ends on the host:
    on the CPU; on CUDA for bfloat16 on SM90 and SM100 alone, where GroupedBlas.cpp has its device
    kernel (elsewhere its fallback copies the ends to the host and loops over the groups, which no
    captured step can hold); `meta` stands for such a GPU."""
    if x.device.type == "cpu":
        return True
    return x.dtype == torch.bfloat16 and cuda_major(x.device) in (None, 9, 10)


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(e4m3 [..., N, M], float32 scales [..., N, M/128]) -> [..., N, M] in dtype."""
    *lead, N, M = values.shape
    blocks = values.float().view(*lead, N, M // BLOCK, BLOCK) * scales[..., None]
    return blocks.view(*lead, N, M).to(dtype)


def deep_gemm_masked(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], counts: torch.Tensor,
                     weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor | None:
    """x [E, C, K] (the fixed-capacity layout, the first counts[e] rows of expert e valid): bf16
    rows, quantized here per 128 channels, or an FP8 dispatch's (e4m3 [E, C, K], float32 scales
    [E, C, K/128]) pair, taken as it arrived (DeepEP's FP8 low-latency dispatch hands over the
    layout DeepGEMM reads) @ dequantized(weight [E, N, K])ᵀ -> [E, C, N] bf16 by DeepGEMM's masked
    grouped FP8 GEMM, which reads the counts on the device and skips the other rows (their outputs
    are undefined); None where it does not run (`deep_gemm_takes`). Untested on GPU."""
    gemm = masked_fp8_gemm()
    values = x[0] if isinstance(x, tuple) else x
    if gemm is None or not deep_gemm_takes(values, weight) or not (isinstance(x, tuple) or x.dtype == torch.bfloat16):
        return None
    E, C, K = values.shape
    if isinstance(x, tuple):
        lhs = x
    else:
        x_fp8, x_scales = quantize_per_token_group(x.reshape(E * C, K))
        lhs = (x_fp8.view(E, C, K), x_scales.view(E, C, K // BLOCK))
    out = values.new_empty(E, C, weight.shape[1], dtype=torch.bfloat16)
    gemm(lhs, (weight, scale_inv.float()), out, counts.to(torch.int32), C)
    return out


DEEP_GEMM_BLOCK_M = 128  # the largest row tile of DeepGEMM's SM90 masked kernels (64 or 128)


def deep_gemm_takes(values: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether DeepGEMM's masked GEMM takes rows values [E, C, K] @ weight [E, N, K]ᵀ:
    - on an SM90 GPU: its float32 scales are SM90's recipe; SM100 reads UE8M0 (power-of-two)
      scales, which DeepSeek's weights and DeepEP's default FP8 cast are not, and other
      architectures have no FP8 recipe at all (DeepGEMM raises "Unknown recipe");
    - C a multiple of its 128-row tile: it stores whole tiles through one map over every
      expert's rows, so a partial last tile would write the next expert's first rows (its
      older API asserted `m % block_m == 0`); EPRuntime rounds DeepEP's capacity so that G*C is;
    - K and N whole 128-blocks."""
    E, C, K = values.shape
    return (cuda_major(values.device) == 9 and C % DEEP_GEMM_BLOCK_M == 0 and K % BLOCK == 0
            and weight.shape[1] % BLOCK == 0)


def cuda_major(device: torch.device) -> int | None:
    """The compute capability's major of a CUDA device (9: Hopper), None off CUDA. Asked by every
    MoE layer of every step: read once per device."""
    return capability_major(device.index) if device.type == "cuda" else None


@functools.cache
def capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.cache
def masked_fp8_gemm():
    """DeepGEMM's masked grouped FP8 GEMM (built from source, github deepseek-ai/DeepGEMM; named
    `m_grouped_gemm_fp8_fp8_bf16_nt_masked` before 2.0), or None where DeepGEMM is absent, cannot
    start (its import asserts a CUDA home and initializes its runtime) or lacks FP8 kernels."""
    try:
        import deep_gemm
    except Exception:
        return None
    return (getattr(deep_gemm, "m_grouped_fp8_gemm_nt_masked", None)
            or getattr(deep_gemm, "m_grouped_gemm_fp8_fp8_bf16_nt_masked", None))
