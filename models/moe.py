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

from moespec.models.layers import linear
from moespec.models.weights import WeightError

EXPERT_NAME = re.compile(r".*\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class MoEExperts(Protocol):
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, M], topk_ids [T, A] global expert ids, topk_weights [T, A] -> weighted sum [T, M]."""
        ...


class LocalExperts(nn.Module):
    """Experts [first, first + num_local) stacked as w13 [E, 2I, M] (gate; up) and w2 [E, M, I]."""

    pad_single_row = False  # as in models.layers.Linear
    # Batches of at most this many (token, expert) pairs per local expert run every expert
    # (`forward_dense`): so many pairs hit most experts anyway, and one batched call beats a
    # loop of per-expert calls. On tiny-deepseek-v3 (8 experts, top-2, float32, 2 threads) the
    # dense path made a 1-token forward 1.07x, a 2-token verify 1.19x and 4 requests x 2 tokens
    # 1.09x faster, tied at 8 and 12 tokens and lost 2-3% from 16 (7% at 32, 21% at 64).
    dense_pairs_per_expert = 2

    def __init__(self, num_experts: int, hidden: int, intermediate: int, first: int = 0,
                 num_local: int | None = None) -> None:
        super().__init__()
        self.num_experts, self.first = num_experts, first
        self.num_local = num_experts if num_local is None else num_local
        self.intermediate = intermediate
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, intermediate))
        for param, parts in ((self.w13, 2), (self.w2, 1)):
            param.weight_loader = self.load_expert
            param.num_loads = self.num_local * parts
        nn.init.normal_(self.w13, std=0.02)
        nn.init.normal_(self.w2, std=0.02)

    @classmethod
    def for_config(cls, config) -> "LocalExperts":
        return cls(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)

    def load_expert(self, param: torch.Tensor, tensor: torch.Tensor, name: str) -> bool:
        """Copy one checkpoint expert matrix into its slot; experts of other ranks are skipped."""
        match = EXPERT_NAME.match(name)
        if match is None:
            raise WeightError(f"tensor {name!r} does not name an expert matrix (experts.<id>.<proj>.weight)")
        expert, proj = int(match.group(1)), match.group(2)
        if not self.first <= expert < self.first + self.num_local:
            return False
        I = self.intermediate
        target = {"gate_proj": self.w13[expert - self.first, :I], "up_proj": self.w13[expert - self.first, I:],
                  "down_proj": self.w2[expert - self.first]}[proj]
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        return True

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] * topk_ids.shape[1] <= self.dense_pairs_per_expert * self.num_local:
            return self.forward_dense(x, topk_ids, topk_weights)
        return self.forward_grouped(x, topk_ids, topk_weights)

    def forward_dense(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Every local expert over every token in two batched matmuls that read the stacked
        weights in place, then each token's chosen outputs picked and weighted: a fixed number of
        calls, however many experts are hit."""
        T, M = x.shape
        E, I = self.num_local, self.intermediate
        gate_up = linear(x, self.w13.view(E * 2 * I, M), pad_single_row=self.pad_single_row)  # [T, E*2I]
        gate, up = gate_up.view(T, E, 2, I).unbind(2)  # [T, E, I] each
        act = (F.silu(gate) * up).transpose(0, 1)  # [E, T, I]
        outs = torch.bmm(act, self.w2.transpose(1, 2))  # [E, T, M]
        picks = (topk_ids - self.first).t()[:, :, None].expand(-1, -1, M)  # [A, T, M]
        chosen = outs.gather(0, picks)  # [A, T, M]
        return (chosen * topk_weights.t()[:, :, None]).sum(0)  # [T, M]

    def forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Group (token, slot) pairs by expert and run each hit expert once on its own weights.

        All ids must be local: the EP layer sends each rank only its experts' tokens. (Gathering
        the chosen experts' weights into one batched matmul looked cheaper for decode-size
        batches, but copying the weights doubles memory traffic and was 1.6x slower on the
        trained tiny-deepseek-v3.)
        """
        out = torch.zeros_like(x)  # [T, M]
        A = topk_ids.shape[1]
        flat_ids = topk_ids.flatten() - self.first  # [T*A]
        flat_weights = topk_weights.flatten()
        order = torch.argsort(flat_ids, stable=True)
        start = 0
        for local, count in enumerate(torch.bincount(flat_ids, minlength=self.num_local).tolist()):
            if count == 0:
                continue
            picks = order[start: start + count]  # [n] (token, slot) entries routed to this expert
            start += count
            tokens = picks // A
            out.index_add_(0, tokens, self.run_expert(local, x[tokens]) * flat_weights[picks, None])
        return out

    def run_expert(self, local: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.w13[local], pad_single_row=self.pad_single_row).chunk(2, dim=-1)  # [n, I] each
        return linear(F.silu(gate) * up, self.w2[local], pad_single_row=self.pad_single_row)  # [n, M]
