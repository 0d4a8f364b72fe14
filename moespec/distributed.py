"""Ranks stepping in lockstep under expert parallelism.

Every rank builds the same `Engine` and runs the same `Engine.step`. Its routed experts are
this rank's share; everything else (attention, dense layers, KV cache, scheduler, sampler,
speculator) is its own. With `parallel.attention: dp` each rank serves its own requests;
with `replicated` every rank holds every request and runs the same batches.

The MoE layers (the target's, and the built-in MTP layer's) exchange tokens over the EP group,
so every rank must run the same sequence of MoE-bearing forwards. Once per step, after
scheduling and before any forward, the ranks agree on the step with one small all-gather of
per-rank reports (`StepReport` -> `StepPlan`): whether anyone has work, the draft length k,
how many MTP forwards come before the target forward and whether one follows it, the phase
(all decode: DeepEP's low-latency mode), and rank 0's count of commands sent to each rank
(`moespec.cluster`). A rank with fewer forwards of its own joins the others' with empty ones
(`Lockstep.join_target`, `pad_mtp`): its MoE layers run their collectives with zero rows.

The agreement runs on its own gloo group over host tensors (`ParallelContext.control_group`), so
under overlap scheduling a helper thread agrees on step n+1 while step n's MoE layers exchange
tokens; `Lockstep.begin` sets the plan a step's forwards follow when they start.

Shapes legend: G ranks in the EP group, F report fields.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields
from typing import Iterator

import torch
import torch.distributed as dist

from moespec.batch import Batch
from moespec.config import EngineConfig, tree_shapes


@dataclass(frozen=True)
class StepReport:
    """One rank's view of the step it is about to run (all ints, for one all-gather)."""

    stop: int = 0  # rank 0: every rank leaves its loop after this agreement
    has_work: int = 0  # scheduled at least one chunk
    k_wish: int = -1  # draft tokens its policy asks for; -1: this step cannot speculate here
    room: int = 0  # the most draft tokens its requests have room for
    lags: int = 0  # its MTP layer catches up before drafting
    flush: int = 0  # a plain target forward here is followed by an MTP flush
    decode: int = 1  # decode-only (or nothing scheduled)
    num_tokens: int = 0  # tokens in its target forward (k not included)
    running: int = 0
    waiting: int = 0
    free_pages: int = 0
    num_pages: int = 0
    moe_tokens: int = 0  # the most tokens any of its MoE-bearing forwards this step sends (decode steps)
    rebalance: int = 0  # rank 0: move the experts to a new placement before this step (parallel.eplb)

    @classmethod
    def size(cls) -> int:
        return len(fields(cls))

    def encode(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in fields(self)]


@dataclass(frozen=True)
class RankLoad:
    running: int
    waiting: int
    free_pages: int
    num_pages: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_pages / self.num_pages if self.num_pages else 0.0


@dataclass(frozen=True)
class StepPlan:
    """What every rank derives from all reports; identical on every rank."""

    stop: bool
    run: bool  # some rank has work: every rank runs the step's forwards
    ks: tuple[int, ...]  # [G] draft tokens each rank verifies (0: a plain step there)
    mtp_before: int  # MoE-bearing MTP forwards before the target forward (catch-up, chain steps)
    mtp_after: bool  # one MoE-bearing MTP forward after it (the verify re-run, or a flush)
    decode: bool  # every rank with work runs decode or verify tokens only
    sent: tuple[int, ...]  # [G] commands rank 0 has sent to each rank so far
    loads: tuple[RankLoad, ...]  # [G]
    capacity: int = 1  # C of the fixed-capacity exchange this step: every rank's tokens fit
    rebalance: bool = False  # rank 0 asked: every rank moves its experts before the step's forwards


def decide(reports: list[StepReport], sent: tuple[int, ...] = ()) -> StepPlan:
    """The step every rank runs. k is the smallest draft length any speculating rank's policy asks
    for (so a loaded rank turns speculation down for all), capped per rank by its requests' room."""
    wishes = [r.k_wish for r in reports if r.k_wish >= 0]
    k = min(wishes) if wishes else 0
    ks = tuple(max(0, min(k, r.room)) if r.k_wish >= 0 and r.has_work else 0 for r in reports)
    mtp_before = max((int(r.lags) + kr - 1 for r, kr in zip(reports, ks) if kr), default=0)
    mtp_after = any(ks) or any(r.flush and r.has_work for r in reports)
    loads = tuple(RankLoad(r.running, r.waiting, r.free_pages, r.num_pages) for r in reports)
    capacity = 1 << max(0, max(r.moe_tokens for r in reports) - 1).bit_length()  # a power of two: few shapes
    return StepPlan(bool(reports[0].stop), any(r.has_work for r in reports), ks, mtp_before, mtp_after,
                    all(r.decode for r in reports), sent or (0,) * len(reports), loads, capacity,
                    bool(reports[0].rebalance))


class Lockstep:
    """This rank's part in each step's agreement and MoE-bearing forwards."""

    def __init__(self, ranks, target_experts: list, mtp_experts: list, dtype: torch.dtype, fixed: bool,
                 balancer=None) -> None:
        self.ctx, self.runtime, self.fixed, self.balancer = ranks.ctx, ranks.runtime, fixed, balancer
        self.target_experts, self.mtp_experts, self.dtype = target_experts, mtp_experts, dtype
        self.plan: StepPlan | None = None  # the step whose forwards run now
        self.latest: StepPlan | None = None  # the last agreement (overlap: the step after the running one)
        self.mtp_done = 0  # MoE-bearing MTP forwards this step, own or joined

    @property
    def rank(self) -> int:
        return self.ctx.ep_rank

    def agree(self, report: StepReport, sent: tuple[int, ...]) -> StepPlan:
        """All-gather every rank's report [G, F] (rank 0 appends its per-rank command counts) on the
        control group: host tensors over gloo, beside the forwards' collectives (overlap agrees on
        step n+1 from a helper thread while step n's MoE layers exchange tokens)."""
        G = self.ctx.ep_size
        mine = torch.tensor(report.encode() + list(sent if sent else (0,) * G), dtype=torch.int64)
        table = torch.empty(G * mine.numel(), dtype=torch.int64)
        dist.all_gather_into_tensor(table, mine, group=self.ctx.control_group)
        rows = table.view(G, -1).tolist()
        F = StepReport.size()
        reports = [StepReport(*row[:F]) for row in rows]
        self.latest = decide(reports, tuple(rows[0][F:]))
        return self.latest

    def begin(self, plan: StepPlan) -> None:
        """The agreed step `plan` runs its forwards now (on the engine's thread). The step boundary
        first: the last step's expert loads into the window, and an agreed rebalance (parallel.eplb)."""
        if self.balancer is not None:
            self.balancer.step_boundary(self.plan is not None and self.plan.run, plan.rebalance)
        self.plan, self.mtp_done = plan, 0

    def expert_load(self) -> dict | None:
        """The EP layers' routed rows per expert over the last summed window (`ExpertBalancer.stats`)."""
        return self.balancer.stats() if self.balancer is not None else None

    def rebalance_due(self) -> bool:
        """Rank 0 asks for a rebalance every parallel.eplb.rebalance_interval_steps steps."""
        return self.balancer is not None and self.ctx.ep_rank == 0 and self.balancer.due()

    def two_batch_split(self, batch: Batch) -> int | None:
        """Two-batch overlap: the request where this batch's forwards split (EPRuntime)."""
        return self.runtime.two_batch_split(batch.qo_bounds)

    @contextlib.contextmanager
    def target(self, batch: Batch) -> Iterator[None]:
        with self.runtime.step(batch.qo_bounds, self.low_latency, self.capacity):
            yield

    @contextlib.contextmanager
    def mtp(self, batch: Batch) -> Iterator[None]:
        self.mtp_done += 1
        if self.plan is not None and self.mtp_done > self.plan.mtp_before + self.plan.mtp_after:
            raise RuntimeError(f"rank {self.rank} ran MTP forward {self.mtp_done} of a step agreed to have "
                               f"{self.plan.mtp_before + self.plan.mtp_after}: the ranks would deadlock")
        with self.runtime.step(batch.qo_bounds, self.low_latency, self.capacity):
            yield

    @property
    def capacity(self) -> int | None:
        return None if self.plan is None else self.plan.capacity

    @property
    def low_latency(self) -> bool:
        """The fixed-capacity exchange for this step's MoE layers: a decode step everywhere."""
        return self.fixed and self.plan is not None and self.plan.decode

    def join_target(self) -> None:
        self.runtime.join(self.target_experts, self.dtype, self.low_latency, self.capacity)

    def pad_mtp(self, count: int) -> None:
        """Join the others' MTP forwards until this step has run `count` of them."""
        if not self.mtp_experts:
            return
        while self.mtp_done < count:
            self.mtp_done += 1
            self.runtime.join(self.mtp_experts, self.dtype, self.low_latency, self.capacity)


def build_balancer(eplb, layers: list, ctx, model_config):
    """The load recorder and, with parallel.eplb on, the replica tables over `layers` (the target's
    EP layers, then the MTP layer's), placed from parallel.eplb.init or trivially; None without EP layers."""
    if not layers:
        return None
    from moespec.parallel.eplb import ExpertBalancer

    balancer = ExpertBalancer(eplb, layers, ctx, num_nodes=count_nodes(ctx.ep_size),
                              num_groups=getattr(model_config, "n_group", 1) or 1)
    balancer.start_from(eplb.init)
    return balancer


def count_nodes(ep_size: int) -> int:
    """Nodes the EP group spans, from the launcher's ranks per node (torchrun's LOCAL_WORLD_SIZE,
    slurm's SLURM_NTASKS_PER_NODE); one when neither says or they do not divide the group."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or ep_size)
    return ep_size // per_node if 0 < per_node <= ep_size and ep_size % per_node == 0 else 1


def ep_layers(module: torch.nn.Module) -> list:
    """The expert-parallel MoE layers of `module`, in forward order."""
    from moespec.parallel import EPExperts

    return [m for m in module.modules() if isinstance(m, EPExperts)]


class Ranks:
    """This process's place among the ranks: its context, the EP runtime shared by MoE layers and
    the channel that carries requests from rank 0 and their tokens back."""

    def __init__(self, ctx, runtime, channel) -> None:
        self.ctx, self.runtime, self.channel = ctx, runtime, channel

    @property
    def dp(self) -> bool:
        return self.runtime.dp

    def close(self) -> None:
        from moespec.parallel import destroy

        self.channel.close()
        self.runtime.close()
        destroy(self.ctx)


def dispatch_capacity(config: EngineConfig) -> int:
    """Tokens one rank sends in one fixed-capacity (low-latency) dispatch, at most: the largest
    MoE-bearing forward of a decode or verify step on one rank. Verify and the MTP re-run carry
    D x (1 + k) tokens; an MTP flush after a plain decode step up to D x (2 + k) (1 + k held
    target hidden states and the new one); a draft tree's verify D x (1 + N)."""
    spec = config.speculation
    k = spec.num_speculative_tokens if spec.mode != "none" else 0
    extra = 1 if spec.mode == "mtp" else 0
    per_request = max([1 + k + extra] + [shape.tokens_per_request for shape in tree_shapes(spec)])
    return config.scheduler.max_num_seqs * per_request


def join_ranks(config: EngineConfig) -> Ranks | None:
    """Join the process group of a multi-rank launch (torchrun or slurm); None for one process."""
    if config.parallel.ep_size == 1:
        return None
    from moespec.cluster import Channel
    from moespec.parallel import EPRuntime, ParallelError, init_parallel

    ctx = init_parallel(config.parallel)
    if ctx.world_size != ctx.ep_size:
        raise ParallelError(f"world size {ctx.world_size} != parallel.ep_size {ctx.ep_size}: run one expert-parallel "
                            "group (one rank per GPU of the group)")
    runtime = EPRuntime(ctx, backend=config.parallel.moe_backend, max_tokens_per_rank=dispatch_capacity(config))
    return Ranks(ctx, runtime, Channel.connect(ctx))
