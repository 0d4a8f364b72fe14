"""Where routed experts live under expert-parallel load balancing (EPLB): E logical experts
on P = E + R physical slots, P / G slots on each of G ranks, per MoE layer.

The algorithm is the one DeepSeek published (deepseek-ai/EPLB), written here from its
description:

1. replicate: every logical expert gets one slot; each of the R extra slots goes, one at a
   time, to the expert whose load per copy (load / copies) is then the highest; then (our
   addition, `improve_copies`) extra copies move between experts while that lowers the
   heaviest bin step 2 makes;
2. pack: the slots, each weighing its expert's load per copy, go into bins of equal slot
   counts, heaviest first, each into the lightest bin that still has room.

Hierarchical (expert groups divide evenly over nodes): the groups of a layer are first packed
onto nodes (bins of whole groups, so a token's group-limited routing stays within few nodes),
then replicated within each node and packed onto that node's ranks. Global: one node, one
group, the same two steps over all ranks (DeepSeek uses it for decode at large EP).

Everything here is CPU torch over host tensors; the result is a `Placement`, whose device
tables route each (token, expert) pair to one replica.

Shapes legend: Y MoE layers, E logical experts, P physical slots (E + R), G ranks, X the most
copies any expert has.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal

import torch

Algorithm = Literal["auto", "hierarchical", "global"]


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class Placement:
    """phys_to_log [Y, P]: the logical expert slot p holds (slot p lives on rank p // (P / G))."""

    phys_to_log: torch.Tensor  # [Y, P] int64
    num_ranks: int

    @property
    def num_slots(self) -> int:
        return self.phys_to_log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def num_experts(self) -> int:
        return int(self.phys_to_log.max()) + 1

    def replica_counts(self, num_experts: int) -> torch.Tensor:
        """-> copies of each logical expert [Y, E]."""
        Y = self.phys_to_log.shape[0]
        ones = torch.ones_like(self.phys_to_log)
        return torch.zeros(Y, num_experts, dtype=torch.int64).scatter_add_(1, self.phys_to_log, ones)

    def replica_table(self, num_experts: int) -> torch.Tensor:
        """-> log_to_phys [Y, E, X]: each logical expert's slots in ascending order, -1 past its
        copies."""
        Y, P = self.phys_to_log.shape
        counts = self.replica_counts(num_experts)
        table = torch.full((Y, num_experts, int(counts.max())), -1, dtype=torch.int64)
        for layer in range(Y):
            seen = [0] * num_experts
            for slot, expert in enumerate(self.phys_to_log[layer].tolist()):
                table[layer, expert, seen[expert]] = slot
                seen[expert] += 1
        return table

    def rank_of_slot(self) -> torch.Tensor:
        """-> [P] the rank each slot lives on."""
        return torch.arange(self.num_slots) // self.slots_per_rank

    def rank_loads(self, load: torch.Tensor) -> torch.Tensor:
        """load [Y, E] rows per logical expert -> [Y, G] rows per rank when each expert's rows
        split evenly over its copies."""
        counts = self.replica_counts(load.shape[1]).to(load.dtype)
        per_slot = load.gather(1, self.phys_to_log) / counts.gather(1, self.phys_to_log)  # [Y, P]
        return per_slot.view(per_slot.shape[0], self.num_ranks, -1).sum(2)


def trivial_placement(num_layers: int, num_experts: int, num_redundant: int, num_ranks: int) -> Placement:
    """Rank r's slots: its own E / G experts (r * E / G on), then R / G more copies of them in
    turn, so a rank fills every slot from the checkpoint tensors it reads anyway."""
    base, extra = num_experts // num_ranks, num_redundant // num_ranks
    rows = [r * base + j % base for r in range(num_ranks) for j in list(range(base)) + list(range(extra))]
    return Placement(torch.tensor(rows, dtype=torch.int64).repeat(num_layers, 1), num_ranks)


def imbalance(rank_loads: torch.Tensor) -> torch.Tensor:
    """rank_loads [..., G] -> (max - mean) / mean over the ranks [...]."""
    mean = rank_loads.float().mean(-1)
    return (rank_loads.float().amax(-1) - mean) / mean.clamp(min=1e-9)


def balancedness(rank_loads: torch.Tensor) -> torch.Tensor:
    """rank_loads [..., G] -> mean / max over the ranks [...] (1: perfectly balanced, or no rows)."""
    peak = rank_loads.float().amax(-1)
    return torch.where(peak > 0, rank_loads.float().mean(-1) / peak.clamp(min=1e-9), 1.0)


# ------------------------------------------------------------------------- the algorithm

def pack_balanced(weights: list[float], num_bins: int) -> list[int]:
    """weights [n] (n a multiple of num_bins) -> the bin of each item: n / num_bins items per
    bin, heaviest item first into the lightest bin with room (ties: the lower bin)."""
    capacity = len(weights) // num_bins
    if capacity * num_bins != len(weights):
        raise PlacementError(f"{len(weights)} items do not split evenly into {num_bins} bins")
    open_bins = [(0.0, b) for b in range(num_bins)]  # a heap of (total, bin) with room left
    sizes, where = [0] * num_bins, [0] * len(weights)
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        total, best = heapq.heappop(open_bins)
        where[item] = best
        sizes[best] += 1
        if sizes[best] < capacity:
            heapq.heappush(open_bins, (total + weights[item], best))
    return where


def heaviest_bin(load: list[float], copies: list[int], num_bins: int) -> float:
    """The heaviest bin `pack_balanced` makes of these copies (each weighing load / copies)."""
    weights = [load[e] / c for e, c in enumerate(copies) for _ in range(c)]
    totals = [0.0] * num_bins
    for w, b in zip(weights, pack_balanced(weights, num_bins)):
        totals[b] += w
    return max(totals)


def improve_copies(load: list[float], copies: list[int], num_bins: int, width: int = 8) -> list[int]:
    """A local search after `replicate` (not in DeepSeek's EPLB): move one extra copy from one
    expert to another while that lowers the heaviest packed bin. Replicating by load per copy
    alone can give the hottest expert copies that no packing evens out: on the tiny DeepSeek's
    skewed routing (one expert half the rows, three group-mates the rest, 12 slots on 4 ranks)
    it left ranks 20-35% over the mean where 2 copies of the hot expert and 2 of a mate balance
    them. Candidates: the `width` experts that lose least by giving up a copy, and the `width`
    with the highest load per copy."""
    best = heaviest_bin(load, copies, num_bins)
    for _ in range(sum(copies) - len(copies)):
        donors = sorted((e for e, c in enumerate(copies) if c > 1), key=lambda e: load[e] / (copies[e] - 1))[:width]
        takers = sorted(range(len(load)), key=lambda e: -load[e] / copies[e])[:width]
        found = None
        for a in donors:
            for b in (b for b in takers if b != a):
                trial = list(copies)
                trial[a] -= 1
                trial[b] += 1
                peak = heaviest_bin(load, trial, num_bins)
                if peak < best - 1e-9 * max(best, 1.0):
                    best, found = peak, trial
        if found is None:
            break
        copies = found
    return copies


def replicate(load: list[float], num_slots: int) -> list[int]:
    """load [E] -> copies of each expert [E] summing to num_slots: one each, then every extra
    copy to the expert with the highest load per copy (ties: the lower id)."""
    copies = [1] * len(load)
    for _ in range(num_slots - len(load)):
        best = max(range(len(load)), key=lambda e: (load[e] / copies[e], -e))
        copies[best] += 1
    return copies


def place_slots(load: list[float], experts: list[int], num_slots: int, num_bins: int) -> list[list[int]]:
    """Replicate `experts` (their loads in load) onto num_slots slots and pack them into
    num_bins bins -> each bin's logical experts (in slot order: by expert, then copy)."""
    loads = [load[e] for e in experts]
    copies = improve_copies(loads, replicate(loads, num_slots), num_bins)
    slots = [(e, load[e] / c) for e, c in zip(experts, copies) for _ in range(c)]
    where = pack_balanced([w for _, w in slots], num_bins)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for (expert, _), b in zip(slots, where):
        bins[b].append(expert)
    return bins


def place_layer(load: list[float], num_slots: int, num_groups: int, num_nodes: int, num_ranks: int) -> list[int]:
    """One layer's load [E] -> the logical expert of each of num_slots slots, rank after rank."""
    E = len(load)
    group_size = E // num_groups
    groups = [list(range(g * group_size, (g + 1) * group_size)) for g in range(num_groups)]
    node_of_group = pack_balanced([sum(load[e] for e in grp) for grp in groups], num_nodes)
    row: list[int] = []
    for node in range(num_nodes):
        experts = [e for g, grp in enumerate(groups) if node_of_group[g] == node for e in grp]
        for bin_ in place_slots(load, experts, num_slots // num_nodes, num_ranks // num_nodes):
            row += bin_
    return row


def choose_algorithm(algorithm: Algorithm, num_groups: int, num_nodes: int) -> Algorithm:
    """auto: hierarchical when the expert groups divide evenly over the nodes, global otherwise."""
    if algorithm != "auto":
        return algorithm
    return "hierarchical" if num_groups % num_nodes == 0 else "global"


def check_shape(num_experts: int, num_slots: int, num_ranks: int, num_groups: int, num_nodes: int,
                algorithm: Algorithm) -> None:
    if num_slots < num_experts or num_slots % num_ranks:
        raise PlacementError(f"{num_slots} physical slots for {num_experts} experts do not split evenly over "
                             f"{num_ranks} ranks")
    if algorithm == "hierarchical":
        if num_experts % num_groups or num_groups % num_nodes or num_ranks % num_nodes or num_slots % num_nodes:
            raise PlacementError(f"hierarchical placement needs {num_groups} expert groups and {num_ranks} ranks "
                                 f"to divide evenly over {num_nodes} nodes")


def compute_placement(load: torch.Tensor, num_redundant: int, num_ranks: int, num_groups: int = 1,
                      num_nodes: int = 1, algorithm: Algorithm = "auto") -> Placement:
    """load [Y, E] routed rows per logical expert -> the `Placement` of E + R slots on num_ranks."""
    Y, E = load.shape
    algorithm = choose_algorithm(algorithm, num_groups, num_nodes)
    if algorithm == "global":
        num_groups, num_nodes = 1, 1
    num_slots = E + num_redundant
    check_shape(E, num_slots, num_ranks, num_groups, num_nodes, algorithm)
    rows = [place_layer(load[y].double().tolist(), num_slots, num_groups, num_nodes, num_ranks) for y in range(Y)]
    return Placement(torch.tensor(rows, dtype=torch.int64), num_ranks)
