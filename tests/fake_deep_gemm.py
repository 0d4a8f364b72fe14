"""A stand-in for DeepGEMM's masked grouped FP8 GEMM (`m_grouped_fp8_gemm_nt_masked`) that checks
the host contract of its SM90 path before computing on the CPU, as read from DeepGEMM 2.6
(csrc/apis/gemm.hpp, csrc/utils/layout.hpp, csrc/apis/layout.hpp) and its kernels' tiling:
- A (e4m3 [G, m, k]) and B (e4m3 [G, n, k]) K-major, D bf16 [G, m, n] N-major, every 3-D operand
  with whole [rows, cols] matrices one after another;
- masked_m int32, contiguous, one count per group; expected_m a positive host int;
- SM90 scales float32: A's [G, m, k/128] (any of the layouts DeepEP or a quantizer hands over),
  B's [G, n/128, k/128] with whole matrices per group;
- m whole 128-row tiles when there is more than one group: the kernel stores whole tiles
  through one map over all groups' rows, so a partial tile writes into the next group's rows.
Rows past masked_m[g] are left as they were (DeepGEMM leaves them undefined)."""
from __future__ import annotations

import torch

BLOCK_M = 128
calls: list[tuple] = []


def check_matrices(name: str, t: torch.Tensor) -> None:
    assert t.dim() == 3, f"{name} must be 3-D"
    assert t.stride(0) == t.shape[1] * t.shape[2], f"{name}'s groups must be whole matrices one after another"
    assert t.stride(-1) == 1 or t.stride(-2) == 1, f"{name} must be row- or column-major"


def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, *_, **__) -> None:
    (a, sfa), (b, sfb) = a, b
    for name, t in (("A", a), ("B", b), ("D", d)):
        check_matrices(name, t)
    assert a.stride(-1) == 1 and b.stride(-1) == 1, "A and B must be K-major"
    assert d.stride(-1) == 1 and d.dtype == torch.bfloat16, "D must be N-major bf16"
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert masked_m.dtype == torch.int32 and masked_m.is_contiguous()
    G, m, k = a.shape
    n = b.shape[1]
    assert b.shape == (G, n, k) and d.shape == (G, m, n) and masked_m.shape == (G,)
    assert isinstance(expected_m, int) and expected_m > 0
    assert sfa.dtype == sfb.dtype == torch.float32, "SM90 reads float32 scales"
    assert sfa.shape == (G, m, -(-k // 128)), f"A's scales {tuple(sfa.shape)}"
    assert sfb.shape == (G, -(-n // 128), -(-k // 128)) and sfb.stride(0) == sfb.shape[1] * sfb.shape[2]
    assert G == 1 or m % BLOCK_M == 0, (f"m = {m} rows per group is not whole {BLOCK_M}-row tiles: the last tile "
                                        "of each group would be stored over the next group's first rows")
    calls.append((a, sfa))
    rows = (a.float().view(G, m, k // 128, 128) * sfa[..., None]).view(G, m, k)
    for g in range(G):
        weight = b[g].float() * sfb[g].repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        count = int(masked_m[g])
        d[g, :count] = (rows[g, :count] @ weight.t()).to(d.dtype)
