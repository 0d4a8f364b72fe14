"""The leader's batch reaches every rank as one packed int64 buffer (`Batch.pack()`): a length,
then the buffer, two broadcasts per step. Call between steps (no EP collective in flight)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moespec.batch import Batch
from moespec.parallel.groups import ParallelContext, ParallelError


def broadcast_batch(ctx: ParallelContext, batch: Batch | None) -> Batch:
    """Leader passes its batch, the others pass None; every rank returns the same Batch."""
    if not ctx.distributed:
        return check_leader_batch(ctx, batch)
    if ctx.leader:
        buffer = check_leader_batch(ctx, batch).pack().to(ctx.device)  # [n] int64
        size = torch.tensor([buffer.numel()], dtype=torch.int64, device=ctx.device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    dist.broadcast(size, src=0)
    if not ctx.leader:
        buffer = torch.empty(int(size), dtype=torch.int64, device=ctx.device)
    dist.broadcast(buffer, src=0)
    return Batch.unpack(buffer)


def check_leader_batch(ctx: ParallelContext, batch: Batch | None) -> Batch:
    if ctx.leader and batch is None:
        raise ParallelError("broadcast_batch: the leader (rank 0) must pass the batch it scheduled")
    return batch
