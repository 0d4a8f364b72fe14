"""Expert-parallel load balancing at run time: the load recorder, the replica tables that route
each (token, expert) pair to one replica, and live rebalancing (docs/expert-parallel.md, "EPLB").

- `ExpertLoad` counts routed rows per MoE layer (MTP layer included) and logical expert on the
  device: each layer adds its step's counts into `current` [Y, E] (a scatter-add, no host read,
  so captured and compiled steps record too); at each step boundary `current` moves into a ring
  of the last `window_steps` steps. Every `window_steps` steps the ranks sum their windows
  (one all-reduce at the step boundary, on every rank: the steps are agreed) into `snapshot`,
  the host copy that metrics and `moespec expert-load` read.
- `ReplicaTables` holds, per layer, each logical expert's physical slots [Y, E, X] and copy
  counts [Y, E] on the device, X = R + 1 (the most copies one expert can have), so their shapes
  never change and a captured step reads the tables a swap wrote in place. A pair (token t,
  expert e) goes to replica t mod copies(e) of e: deterministic, a gather and a remainder.
- `ExpertBalancer` owns both for one model's EP layers. At an agreed rebalance step, every
  rank sums the window, rank 0 computes the placement (parallel/placement.py) and broadcasts
  it, each layer's expert weights (FP8 with their scales) move to their new slots with
  point-to-point transfers over the EP group, one layer at a time (peak: one layer's local
  experts above steady state), and the tables are rewritten: all at one step boundary, on
  every rank, between forwards.

Shapes legend: Y MoE layers, E logical experts, P physical slots (E + R), G ranks, L slots per
rank (P / G), X the most copies of one expert, T tokens, A activated experts per token.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moespec.parallel.placement import (Placement, balancedness, compute_placement, imbalance,
                                        trivial_placement)


class ExpertLoad:
    """Routed rows per (layer, logical expert), accumulated on the device over a window of steps."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int, device: torch.device) -> None:
        self.num_experts, self.window_steps = num_experts, window_steps
        self.current = torch.zeros(num_layers, num_experts + 1, dtype=torch.int64, device=device)  # +1: id -1
        self.ring = torch.zeros(window_steps, num_layers, num_experts, dtype=torch.int64, device=device)
        self.steps = 0  # step boundaries passed
        self.snapshot: torch.Tensor | None = None  # [Y, E] every rank's last full window, summed (host)
        self.snapshot_at = 0.0  # time.time() of the snapshot

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """topk_ids [T, A] logical ids (-1: none) of one forward of `layer`, added on the device."""
        ids = topk_ids.flatten().long()
        ids = ids.where(ids >= 0, self.num_experts)  # [T*A]
        self.current[layer].scatter_add_(0, ids, torch.ones_like(ids))

    def end_step(self) -> None:
        """The step's counts into the ring (device copies, between forwards)."""
        self.ring[self.steps % self.window_steps].copy_(self.current[:, :-1])
        self.current.zero_()
        self.steps += 1

    def window(self) -> torch.Tensor:
        """-> this rank's rows per expert over the last window_steps steps [Y, E] (device)."""
        return self.ring.sum(0)

    def summed_window(self, group) -> torch.Tensor:
        """-> every rank's window summed [Y, E] (a collective: every rank calls it at the same step)."""
        total = self.window()
        if group is not None:
            dist.all_reduce(total, group=group)
        return total


class ReplicaTables:
    """Device tables of one placement: replicas [Y, E, X] (slot ids, -1 past the copies) and
    copies [Y, E]; `route` maps logical ids to physical slots."""

    def __init__(self, placement: Placement, num_experts: int, max_copies: int, device: torch.device) -> None:
        Y = placement.phys_to_log.shape[0]
        self.replicas = torch.full((Y, num_experts, max_copies), -1, dtype=torch.int64, device=device)
        self.copies = torch.ones(Y, num_experts, dtype=torch.int64, device=device)
        self.placement = placement
        self.write(placement)

    def write(self, placement: Placement) -> None:
        """Rewrite the tables in place (shapes unchanged: captured steps read the new values)."""
        E = self.copies.shape[1]
        table = placement.replica_table(E)  # [Y, E, X']
        self.replicas.fill_(-1)
        self.replicas[:, :, :table.shape[2]].copy_(table)
        self.copies.copy_(placement.replica_counts(E))
        self.placement = placement

    def route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [T, A] logical (-1: none) -> physical slots [T, A]: token t's pair with expert e
        goes to replica t mod copies(e)."""
        valid = topk_ids >= 0
        ids = topk_ids.clamp(min=0).long()
        position = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]  # [T, 1]
        pick = position % self.copies[layer][ids]  # [T, A]
        slots = self.replicas[layer][ids, pick]
        return slots.where(valid, -1).to(topk_ids.dtype)


@dataclass(frozen=True)
class Move:
    """One slot's weights to fill on rank `dest` from slot `source` on rank `source_rank`."""

    dest_slot: int
    source_slot: int
    source_rank: int
    dest_rank: int


def plan_moves(old: list[int], new: list[int], slots_per_rank: int) -> list[Move]:
    """old, new [P] logical expert of each slot -> where each new slot's weights come from: the
    same rank's old slot holding that expert when there is one, else its first old slot."""
    first_on: dict[tuple[int, int], int] = {}
    first_anywhere: dict[int, int] = {}
    for slot, expert in enumerate(old):
        first_on.setdefault((slot // slots_per_rank, expert), slot)
        first_anywhere.setdefault(expert, slot)
    moves = []
    for slot, expert in enumerate(new):
        rank = slot // slots_per_rank
        source = first_on.get((rank, expert), first_anywhere[expert])
        moves.append(Move(slot, source, source // slots_per_rank, rank))
    return moves


class ExpertBalancer:
    """EPLB for one model's EP layers (target first, then the MTP layer's), on one rank."""

    def __init__(self, eplb, layers: list, ctx, num_nodes: int = 1, num_groups: int = 1) -> None:
        self.eplb, self.layers, self.ctx = eplb, layers, ctx
        self.num_nodes, self.num_groups = num_nodes, num_groups
        first = layers[0]
        self.num_experts = first.num_logical
        device = first.w2.device
        for index, layer in enumerate(layers):
            layer.bind_balancer(self, index)
            layer.fill_replicas()
        self.load = ExpertLoad(len(layers), self.num_experts, eplb.window_steps, device)
        R = first.num_experts - self.num_experts
        initial = trivial_placement(len(layers), self.num_experts, R, ctx.ep_size)
        self.tables = ReplicaTables(initial, self.num_experts, R + 1, device)
        self.steps_since = 0  # rank 0: steps since the last rebalance
        self.rebalances = 0
        self.moved_slots = 0  # slots whose weights came from another rank, over every rebalance
        self.last_pause_s = 0.0  # the last rebalance's wall time (the step boundary it held)

    @property
    def enabled(self) -> bool:
        return self.eplb.enabled

    # -- the forward's side

    def record_and_route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [T, A] logical -> physical [T, A], counting the logical ids on the way."""
        self.load.record(layer, topk_ids)
        return self.tables.route(layer, topk_ids) if self.enabled else topk_ids

    # -- the step boundary

    def due(self) -> bool:
        """Rank 0: whether to ask for a rebalance in the next agreement."""
        interval = self.eplb.rebalance_interval_steps
        return self.enabled and interval > 0 and self.steps_since >= interval

    def step_boundary(self, ran: bool, rebalance: bool) -> None:
        """Between two agreed steps, on every rank: the finished step's counts into the window,
        the window summed every window_steps steps, and the agreed rebalance."""
        if ran:
            self.load.end_step()
            self.steps_since += 1
            if self.load.steps % self.load.window_steps == 0:
                self.take_snapshot()
        if rebalance:
            self.rebalance()

    def take_snapshot(self) -> None:
        self.load.snapshot = self.load.summed_window(self.ctx.ep_group).cpu()
        self.load.snapshot_at = time.time()

    def rebalance(self, load: torch.Tensor | None = None) -> Placement:
        """Every rank: the summed window -> rank 0's placement, broadcast -> weights moved -> tables."""
        start = time.perf_counter()
        if load is None:
            load = self.load.summed_window(self.ctx.ep_group).cpu()
        placement = self.agree_placement(load)
        self.apply(placement)
        self.steps_since, self.rebalances = 0, self.rebalances + 1
        self.last_pause_s = time.perf_counter() - start
        return placement

    def agree_placement(self, load: torch.Tensor) -> Placement:
        R = self.layers[0].num_experts - self.num_experts
        rows = torch.zeros(len(self.layers), self.num_experts + R, dtype=torch.int64)
        if self.ctx.ep_rank == 0:
            rows = compute_placement(load.double(), R, self.ctx.ep_size, self.num_groups, self.num_nodes,
                                     self.eplb.algorithm).phys_to_log
        if self.ctx.ep_group is not None:
            dist.broadcast(rows, group_src_rank(self.ctx, 0), group=self.ctx.ep_group)
        return Placement(rows, self.ctx.ep_size)

    def apply(self, placement: Placement) -> None:
        """Move every layer's weights to `placement`, then swap the tables."""
        old = self.tables.placement
        for index, layer in enumerate(self.layers):
            moves = plan_moves(old.phys_to_log[index].tolist(), placement.phys_to_log[index].tolist(),
                               placement.slots_per_rank)
            self.moved_slots += sum(m.source_rank != m.dest_rank for m in moves)
            move_layer(layer, moves, self.ctx)
        self.tables.write(placement)

    def start_from(self, path: str | None) -> None:
        """The initial placement: from a load file (`moespec expert-load` JSON), else trivial."""
        if path is None or not self.enabled:
            return
        self.rebalance(read_load_file(path, len(self.layers), self.num_experts))

    # -- what is exported

    def stats(self) -> dict:
        """Per layer: rows per expert of the last summed window, balancedness (mean / max rows per
        rank) and imbalance ratio ((max - mean) / mean) under the current placement."""
        snapshot = self.load.snapshot
        if snapshot is None:
            return {"window_steps": self.load.window_steps, "steps": self.load.steps, "layers": []}
        per_rank = self.tables.placement.rank_loads(snapshot.double())  # [Y, G]
        return {"window_steps": self.load.window_steps, "steps": self.load.steps, "time": self.load.snapshot_at,
                "num_redundant_experts": self.layers[0].num_experts - self.num_experts,
                "rebalances": self.rebalances, "last_rebalance_s": self.last_pause_s,
                "layers": [{"layer": y, "counts": snapshot[y].tolist(), "rows_per_rank": per_rank[y].tolist(),
                            "balancedness": float(balancedness(per_rank[y])),
                            "imbalance": float(imbalance(per_rank[y]))} for y in range(snapshot.shape[0])]}


def group_src_rank(ctx, ep_rank: int) -> int:
    """The global rank of EP rank `ep_rank` (torch.distributed's collectives take global ranks)."""
    return dist.get_global_rank(ctx.ep_group, ep_rank)


def expert_tensors(layer) -> list[torch.Tensor]:
    """A layer's per-slot tensors [L, ...]: both projections, and their FP8 scales if any."""
    return [t for t in (layer.w13, layer.w2, layer.w13_scale_inv, layer.w2_scale_inv) if t is not None]


def move_layer(layer, moves: list[Move], ctx) -> None:
    """Fill this rank's slots of one layer per `moves`: local copies, and point-to-point
    transfers over the EP group for slots whose expert was on another rank (as bytes: gloo has
    no FP8). The new slots are built beside the old ones (one layer's local experts of extra
    memory), then copied over."""
    rank, L = ctx.ep_rank, layer.num_local
    tensors = expert_tensors(layer)
    fresh = [torch.empty_like(t) for t in tensors]
    pending = []
    for move in moves:
        dest, source = move.dest_slot - rank * L, move.source_slot - rank * L
        if move.source_rank == rank and move.dest_rank == rank:
            for new, old in zip(fresh, tensors):
                new[dest].copy_(old[source])
        elif move.dest_rank == rank:
            pending += [dist.irecv(new[dest].view(torch.uint8), group_src_rank(ctx, move.source_rank),
                                   group=ctx.ep_group, tag=move.dest_slot * 4 + i) for i, new in enumerate(fresh)]
        elif move.source_rank == rank:
            pending += [dist.isend(old[source].view(torch.uint8), group_src_rank(ctx, move.dest_rank),
                                   group=ctx.ep_group, tag=move.dest_slot * 4 + i) for i, old in enumerate(tensors)]
    for work in pending:
        work.wait()
    for new, old in zip(fresh, tensors):
        old.copy_(new)
    if getattr(layer, "packed", None) is not None:
        for packed in layer.packed:
            packed.repack()


def read_load_file(path: str, num_layers: int, num_experts: int) -> torch.Tensor:
    """A `moespec expert-load` JSON -> rows per expert [Y, E]."""
    data = json.loads(Path(path).read_text())
    counts = torch.tensor([layer["counts"] for layer in data["layers"]], dtype=torch.float64)
    if counts.shape != (num_layers, num_experts):
        raise ValueError(f"parallel.eplb.init {path}: counts of shape {tuple(counts.shape)}, the model has "
                         f"{num_layers} MoE layers x {num_experts} experts")
    return counts
