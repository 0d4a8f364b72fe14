"""Block-scaled FP8 GEMMs for DeepSeek's released weights: e4m3 weights [N, K] with one float32
scale per 128x128 block, `weight_scale_inv` [ceil(N/128), ceil(K/128)] (the value is weight x scale).

Two implementations behind one dispatch:
- CPU (reference): activations stay unquantized; each block row of 128 output features is
  dequantized into a [128, K] slab and multiplied, so no full-precision copy of the weight ever
  exists. Correctness is the point, not speed.
- CUDA: activations quantized per token per 128 channels (as DeepSeek's inference does), then
  torch's block-scaled `scaled_mm` (1x128 activation scales, 128x128 weight scales; SM90+).
  Untested on GPU in this project so far.

Routed experts use the grouped form: rows sorted by expert, one call for all of them.

Shapes legend: T tokens (rows), K input features, N output features, E experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
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
    """x [T, K] @ dequantized(weight [N, K])ᵀ (+ bias) -> [T, N] in x's dtype."""
    if x.is_cuda and hasattr(F, "scaled_mm"):
        return cuda_fp8_linear(x, weight, scale_inv, bias)
    return reference_fp8_linear(x, weight, scale_inv, bias)


def reference_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Block row by block row: dequantize 128 output features [128, K], multiply, place."""
    N, K = weight.shape
    out = x.new_empty(x.shape[0], N)  # [T, N]
    column_scales = scale_inv.float().repeat_interleave(BLOCK, 1)[:, :K]  # [N/128, K]
    for block in range(column_scales.shape[0]):
        rows = slice(block * BLOCK, min((block + 1) * BLOCK, N))
        slab = (weight[rows].float() * column_scales[block]).to(x.dtype)  # [<=128, K]
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
    """DeepSeek's recipe on torch's block-scaled GEMM: 1x128 activation scales (M-major, as the SM90
    kernel takes them), 128x128 weight scales; weight read as [K, N] column-major."""
    if x.shape[1] % BLOCK:
        return reference_fp8_linear(x, weight, scale_inv, bias)
    x_fp8, x_scales = quantize_per_token_group(x)
    recipe = F.ScalingType
    out = F.scaled_mm(x_fp8, weight.t(), x_scales.t().contiguous().t(), recipe.BlockWise1x128, scale_inv,
                      recipe.BlockWise128x128, bias=bias, output_dtype=x.dtype)
    return out


def batched_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [E, T, K] @ dequantized(weight [E, N, K])ᵀ -> [E, T, N]: every expert at once, one block
    of 128 output features at a time (the fixed-capacity layout's masked grouped GEMM on CPU)."""
    E, N, K = weight.shape
    out = x.new_empty(E, x.shape[1], N)
    column_scales = scale_inv.float().repeat_interleave(BLOCK, 2)[:, :, :K]  # [E, N/128, K]
    for block in range(column_scales.shape[1]):
        rows = slice(block * BLOCK, min((block + 1) * BLOCK, N))
        slab = (weight[:, rows].float() * column_scales[:, block, None]).to(x.dtype)  # [E, <=128, K]
        out[:, :, rows] = torch.bmm(x, slab.transpose(1, 2))
    return out


def grouped_linear(x: torch.Tensor, counts: list[int], weight: torch.Tensor, scale_inv: torch.Tensor | None = None,
                   pad_single_row: bool = False) -> torch.Tensor:
    """Rows of x [T, K] sorted by group, counts[e] rows for group e; weight [E, N, K] (FP8 with
    scale_inv [E, N/128, K/128], or plain) -> [T, N]: group e's rows times weight[e]ᵀ."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for group, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            out[rows] = expert_linear(x[rows], weight, scale_inv, group, pad_single_row)
            start += count
    return out


def expert_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None, expert: int,
                  pad_single_row: bool = False) -> torch.Tensor:
    """x [T, K] @ weight[expert]ᵀ for stacked expert weights [E, N, K]."""
    if scale_inv is not None:
        return fp8_linear(x, weight[expert], scale_inv[expert])
    from moespec.models.layers import linear  # layers imports this module

    return linear(x, weight[expert], pad_single_row=pad_single_row)
