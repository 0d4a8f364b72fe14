"""Two microbatches in turns: each runs as a generator that yields while one of its transfers
(an MoE dispatch or combine) is in flight, and the other runs meanwhile. Within one MoE layer
(`EPExperts.forward_eager`) or across a whole forward (two-batch overlap: the attention of one
half runs while the other half's tokens are exchanged), the turns are the same mechanism.
A turn ends right after a transfer is issued; DeepEP's low-latency exchange takes one transfer
in flight, so the next issue first receives the one before (parallel/exchange.py): each
transfer's window holds the other half's compute, as in DeepEP's figures/low-latency.png.
"""
from __future__ import annotations

from typing import Any, Callable, Generator, Sequence

import torch

Stages = Generator[None, None, Any]


def drive(stages: Stages) -> Any:
    """Run one generator to its end, alone (nothing else to do while its transfers fly)."""
    return interleave([stages])[0]


def interleave(runs: Sequence[Stages]) -> list[Any]:
    """Step each generator in turn (first, second, first, ...) until all end -> their results.
    Every rank steps its generators in the same order, so their collectives pair up."""
    results: list[Any] = [None] * len(runs)
    pending = list(enumerate(runs))
    while pending:
        still = []
        for i, run in pending:
            try:
                next(run)
                still.append((i, run))
            except StopIteration as done:
                results[i] = done.value
        pending = still
    return results


def take(value: Any, rows: slice) -> Any:
    """Rows of a tensor, or of each tensor of a tuple."""
    if isinstance(value, tuple):
        return tuple(take(v, rows) for v in value)
    return value[rows]


def run_halves(ctx, stages: Callable[..., Stages], *inputs: Any) -> torch.Tensor:
    """stages(*inputs of a half, ctx of the half, first) for both halves of `ctx.halves`, in turns
    -> their outputs concatenated [T, ...] (the halves are consecutive rows)."""
    runs = [stages(*(take(x, half.rows) for x in inputs), ctx.half(i), i == 0) for i, half in enumerate(ctx.halves)]
    return torch.cat(interleave(runs))
