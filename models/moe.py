"""Routed-expert computation behind one interface, so expert parallelism can replace where
experts live without touching the model.

Shapes legend: T tokens, A activated experts per token, E experts (local), M hidden, I intermediate.
"""
from __future__ import annotations

import re
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moespec.models.fp8 import (BLOCK, batched_fp8_linear, deep_gemm_masked, dequantize_rows, fp8_linear,
                                grouped_mm_reads_no_host, grouped_rows_linear, scale_shape)
from moespec.models.layers import PackedWeight, fixed_shapes, linear, packable
from moespec.models.weights import WeightError

EXPERT_NAME = re.compile(r".*\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")


class MoEExperts(Protocol):
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, M], topk_ids [T, A] global expert ids, topk_weights [T, A] -> weighted sum [T, M]."""
        ...


class LocalExperts(nn.Module):
    """Experts [first, first + num_local) stacked as w13 [E, 2I, M] (gate; up) and w2 [E, M, I];
    after `to_fp8()`, e4m3 with block scales w13_scale_inv [E, 2I/128, M/128], w2_scale_inv
    [E, M/128, I/128]. Only this rank's experts are allocated and read from the checkpoint."""

    pad_single_row = False  # as in models.layers.Linear
    # Batches of at most this many (token, expert) pairs per local expert run every expert
    # (`forward_dense`): so many pairs hit most experts anyway, and one batched call beats a
    # loop of per-expert calls. On tiny-deepseek-v3 (8 experts, top-2, float32, 2 threads) the
    # dense path made a 1-token forward 1.07x, a 2-token verify 1.19x and 4 requests x 2 tokens
    # 1.09x faster, tied at 8 and 12 tokens and lost 2-3% from 16 (7% at 32, 21% at 64).
    dense_pairs_per_expert = 2
    # With packed weights (pack()) the dense path is two oneDNN GEMMs; against the grouped path it
    # ran 2.2x / 2.0x / 1.65x / 1.13x faster at 8 / 16 / 32 / 128 tokens on that model (8 experts,
    # top-2, 2 threads) and 1.3x slower at 256: up to 16 pairs per expert (64 tokens there).
    dense_packed_pairs_per_expert = 16
    packed: tuple[PackedWeight, PackedWeight] | None = None  # pack(): w13 [E*2I, M], w2 as [M, E*I]

    def __init__(self, num_experts: int, hidden: int, intermediate: int, first: int = 0,
                 num_local: int | None = None) -> None:
        super().__init__()
        self.num_experts, self.first = num_experts, first
        self.num_local = num_experts if num_local is None else num_local
        self.intermediate = intermediate
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, intermediate))
        self.register_parameter("w13_scale_inv", None)
        self.register_parameter("w2_scale_inv", None)
        self.mark_loaders()
        nn.init.normal_(self.w13, std=0.02)
        nn.init.normal_(self.w2, std=0.02)

    def mark_loaders(self) -> None:
        for param, parts in ((self.w13, 2), (self.w2, 1), (self.w13_scale_inv, 2), (self.w2_scale_inv, 1)):
            if param is not None:
                param.weight_loader = self.locate_expert
                param.num_loads = self.num_local * parts

    def to_fp8(self) -> None:
        """e4m3 expert weights with their block scales (on a meta-built model, before loading)."""
        if self.intermediate % BLOCK:
            raise ValueError(f"moe_intermediate_size {self.intermediate} is not a multiple of {BLOCK}: the gate and "
                             "up projections cannot share FP8 block scales")
        E, device = self.num_local, self.w13.device
        for name in ("w13", "w2"):
            _, rows, cols = getattr(self, name).shape
            setattr(self, name, nn.Parameter(torch.empty(E, rows, cols, dtype=torch.float8_e4m3fn, device=device),
                                             requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(torch.empty(E, *scale_shape(rows, cols), device=device),
                                                            requires_grad=False))
        self.mark_loaders()

    @classmethod
    def for_config(cls, config) -> "LocalExperts":
        return cls(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)

    @classmethod
    def shard_factory(cls, ep_size: int, ep_rank: int):
        """An experts factory holding rank `ep_rank`'s share of the experts (for sizing a rank's model)."""
        def build(config) -> "LocalExperts":
            num_local = config.n_routed_experts // ep_size
            return cls(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                       first=ep_rank * num_local, num_local=num_local)
        return build

    def locate_expert(self, param: torch.Tensor, name: str) -> torch.Tensor | None:
        """The slot of `param` that checkpoint tensor `name` (one expert's matrix or its scales) fills;
        None for another rank's expert, which is then never read."""
        match = EXPERT_NAME.match(name)
        if match is None:
            raise WeightError(f"tensor {name!r} does not name an expert matrix (experts.<id>.<proj>.weight)")
        expert, proj, scales = int(match.group(1)), match.group(2), bool(match.group(3))
        if not self.first <= expert < self.first + self.num_local:
            return None
        local = expert - self.first
        I = self.intermediate // BLOCK if scales else self.intermediate
        w13 = self.w13_scale_inv if scales else self.w13
        w2 = self.w2_scale_inv if scales else self.w2
        return {"gate_proj": w13[local, :I], "up_proj": w13[local, I:], "down_proj": w2[local]}[proj]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        packed = self.packed is not None and self.packed[0].applies(x)
        limit = self.dense_packed_pairs_per_expert if packed else self.dense_pairs_per_expert
        few = x.shape[0] * topk_ids.shape[1] <= limit * self.num_local
        # a compiled or captured step (moespec.static_step) must not read counts on the host
        if fixed_shapes() or (few and self.w13_scale_inv is None):
            dense = self.forward_packed if packed else self.forward_dense
            return dense(x, topk_ids, topk_weights)
        return self.forward_grouped(x, topk_ids, topk_weights)

    def packed_sources(self, device_type: str | None = None) -> list[torch.Tensor]:
        """The weights `pack()` packs: both projections, or none (FP8, or not packable)."""
        sources = [self.w13, self.w2]
        if self.w13_scale_inv is not None or not all(packable(w, device_type) for w in sources):
            return []
        return sources

    def pack(self) -> bool:
        """Keep both projections also packed for oneDNN (layers.PackedWeight), as two linears over
        every local expert: w13 [E*2I, M] and w2 side by side [M, E*I]. The dense path runs them."""
        if not self.packed_sources():
            return False
        E, I, M = self.num_local, self.intermediate, self.w13.shape[2]
        self.packed = (PackedWeight(self.w13, lambda w: w.reshape(E * 2 * I, M)),
                       PackedWeight(self.w2, lambda w: w.permute(1, 0, 2).reshape(M, E * I)))
        return True

    def forward_dense(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Every local expert over every token in two batched matmuls that read the stacked
        weights in place, then each token's chosen outputs picked and weighted: a fixed number of
        calls, however many experts are hit."""
        T, M = x.shape
        E, I = self.num_local, self.intermediate
        if self.w13_scale_inv is not None:  # FP8: the block-scaled batched GEMMs of the fixed-capacity layout
            outs = self.forward_masked(x.expand(E, T, M))  # [E, T, M]
        else:
            gate_up = linear(x, self.w13.view(E * 2 * I, M), pad_single_row=self.pad_single_row)  # [T, E*2I]
            gate, up = gate_up.view(T, E, 2, I).unbind(2)  # [T, E, I] each
            act = (F.silu(gate) * up).transpose(0, 1)  # [E, T, I]
            outs = torch.bmm(act, self.w2.transpose(1, 2))  # [E, T, M]
        picks = (topk_ids - self.first).t()[:, :, None].expand(-1, -1, M)  # [A, T, M]
        chosen = outs.gather(0, picks)  # [A, T, M]
        return (chosen * topk_weights.t()[:, :, None]).sum(0)  # [T, M]

    def forward_packed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The dense path as two linears over the packed weights (pack()): each token's gate weights
        scale its experts' activations before the down projection sums over the experts."""
        T, E, I = x.shape[0], self.num_local, self.intermediate
        gate, up = self.packed[0](x).view(T, E, 2, I).unbind(2)  # [T, E, I] each
        gates = x.new_zeros(T, E).scatter_add_(1, topk_ids - self.first, topk_weights.to(x.dtype))  # [T, E]
        act = F.silu(gate) * up * gates[:, :, None]  # [T, E, I]
        return self.packed[1](act.reshape(T, E * I))  # [T, M]

    def forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Sort the (token, slot) pairs by expert and run the two projections as grouped GEMMs,
        each hit expert on its own weights (read in place, never gathered).

        All ids must be local: the EP layer sends each rank only its experts' tokens. (Gathering
        the chosen experts' weights into one batched matmul looked cheaper for decode-size
        batches, but copying the weights doubles memory traffic and was 1.6x slower on the
        trained tiny-deepseek-v3.)
        """
        A = topk_ids.shape[1]
        flat_ids = topk_ids.flatten() - self.first  # [T*A]
        order = torch.argsort(flat_ids, stable=True)  # [P] pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_local).tolist()
        tokens = order // A  # [P]
        pad = self.pad_single_row
        gate, up = grouped_linear(x[tokens], counts, self.w13, self.w13_scale_inv, pad).chunk(2, dim=-1)  # [P, I] each
        y = grouped_linear(F.silu(gate) * up, counts, self.w2, self.w2_scale_inv, pad)  # [P, M]
        weighted = y * topk_weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, weighted)  # [T, M]

    def forward_masked(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], counts: torch.Tensor | None = None,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """The fixed-capacity layout: x [L, N, M] holds each local expert's rows, the first
        counts[e] (a device tensor, never read on the host) valid, or all of them when counts is
        None -> unweighted outputs [L, N, M], rows past a count zero (DeepGEMM: undefined; nobody
        reads them). The shapes never depend on the counts, so a captured step holds the call.
        x may be an FP8 dispatch's (e4m3 rows, per-128 scales) pair, dispatched from dtype rows.
        With counts the work follows them: DeepGEMM's masked grouped FP8 GEMM where it is installed
        (CUDA), which takes an FP8 pair as it arrived; eager on the CPU, where reading the counts
        waits for no device, each expert over its valid rows alone (`forward_counted_rows`); else
        the rows (dequantized) gathered valid ones first and one grouped GEMM per projection
        (`forward_valid_rows`, no host read: captured and compiled steps; on CUDA where grouped_mm
        has its device kernel, `grouped_mm_reads_no_host`); else every row. DeepGEMM's output is
        bf16: it runs only where that is the dtype asked for."""
        if counts is not None and self.w13_scale_inv is not None and dtype in (None, torch.bfloat16):
            out = self.forward_deep_gemm(x, counts)  # bf16 out
            if out is not None:
                return out
        if isinstance(x, tuple):
            x = dequantize_rows(*x, dtype or torch.bfloat16)  # [L, N, M]
        if counts is None:
            return self.forward_every_row(x)
        if x.device.type == "cpu" and not fixed_shapes():
            return self.forward_counted_rows(x, counts)
        if grouped_mm_reads_no_host(x):
            return self.forward_valid_rows(x, counts)
        return self.forward_every_row(x)

    def forward_every_row(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert over all N rows of x [L, N, M], one batched matmul per projection -> [L, N, M]."""
        if self.w13_scale_inv is not None:  # FP8 weights, block-scaled
            gate, up = batched_fp8_linear(x, self.w13, self.w13_scale_inv).chunk(2, dim=-1)  # [L, N, I] each
            return batched_fp8_linear(F.silu(gate) * up, self.w2, self.w2_scale_inv)  # [L, N, M]
        gate, up = torch.bmm(x, self.w13.transpose(1, 2)).chunk(2, dim=-1)  # [L, N, I] each
        return torch.bmm(F.silu(gate) * up, self.w2.transpose(1, 2))  # [L, N, M]

    def forward_counted_rows(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [L, N, M], counts [L] on the CPU, read here: each expert over its first counts[e] rows,
        the rest of the output zero -> [L, N, M]. Nothing else touches the invalid rows, so the cost
        follows the valid ones (`forward_valid_rows` gathers and scatters all L*N rows)."""
        L, N, M = x.shape
        out = x.new_zeros(L, N, M)
        for e, count in enumerate(counts.clamp(max=N).tolist()):
            if count:
                out[e, :count] = self.run_expert(e, x[e, :count])
        return out

    def forward_valid_rows(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [L, N, M], counts [L]: the valid rows gathered in front, expert by expert (an order
        found on the device), both projections over them as grouped GEMMs that stop at the last
        valid row, and the outputs put back in place -> [L, N, M], invalid rows zero. The gathered
        rows' buffer takes the outputs (one fewer buffer of L*N rows to allocate and fault in)."""
        L, N, M = x.shape
        order, ends, valid = valid_rows_first(counts, N)  # [L*N] each, [L]
        rows = x.reshape(L * N, M).index_select(0, order)  # [L*N, M]
        gate_up = grouped_rows_linear(rows, ends, self.w13, self.w13_scale_inv)  # [L*N, 2I]
        I = gate_up.shape[1] // 2
        act = F.silu(gate_up[:, :I], inplace=True).mul_(gate_up[:, I:])  # [L*N, I], in place: fewer passes
        y = grouped_rows_linear(act, ends, self.w2, self.w2_scale_inv)  # [L*N, M]
        out = rows.index_copy_(0, order, y)  # [L*N, M]; rows past the last valid one were not computed
        return out.masked_fill_(~valid[:, None], 0).view(L, N, M)

    def forward_deep_gemm(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                          counts: torch.Tensor) -> torch.Tensor | None:
        """Both projections by DeepGEMM's masked grouped FP8 GEMM -> [L, N, M], or None where it
        does not run (`deep_gemm_masked`). Untested on GPU."""
        gate_up = deep_gemm_masked(x, counts, self.w13, self.w13_scale_inv)  # [L, N, 2I]
        if gate_up is None:
            return None
        gate, up = gate_up.chunk(2, dim=-1)
        return deep_gemm_masked(F.silu(gate) * up, counts, self.w2, self.w2_scale_inv)

    def run_expert(self, local: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = expert_linear(x, self.w13, self.w13_scale_inv, local, self.pad_single_row).chunk(2, dim=-1)
        return expert_linear(F.silu(gate) * up, self.w2, self.w2_scale_inv, local, self.pad_single_row)  # [n, M]


def valid_rows_first(counts: torch.Tensor, rows_per_expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """counts [L] valid rows at the front of each expert's block of rows_per_expert (N) -> (order
    [L*N]: the flat rows, valid ones first in expert order, then the rest; ends [L] int32: the
    row after each expert's last in that order; valid [L*N]: whether each row of the layout is
    one), all on the counts' device, computed without reading them on the host."""
    counts = counts.clamp(max=rows_per_expert)
    slot = torch.arange(rows_per_expert, device=counts.device)  # [N]
    valid = (slot[None, :] < counts[:, None]).flatten()  # [L*N]
    order = torch.argsort((~valid).to(torch.uint8), stable=True)  # [L*N]
    return order, counts.cumsum(0).to(torch.int32), valid


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
    return linear(x, weight[expert], pad_single_row=pad_single_row)
