"""Expert-parallel routed experts: dispatch -> local experts -> combine, optionally as two
microbatches whose all-to-alls overlap the other half's compute.

Data-parallel attention (`dp`): every rank runs its own requests, so its x [T_r, M] is its own;
it dispatches all of its rows and gets all of them back. T_r differs between ranks, and may be 0
for a rank with no work this forward: counts are exchanged, never inferred.

Replicated attention: every rank runs the same batch, so every rank holds the same x [T, M] and
routing. Each rank therefore sends only its own contiguous share of the tokens (about T / G
rows), and the shards are all-gathered afterwards so every rank again holds all T outputs.
Dispatching all T tokens from every rank would move G times more data for the same result.

Either way: one row per (token, destination rank) with that rank's expert ids and gate weights,
the local experts run, each row is weighted and summed on the expert side, and combined back.

Shapes legend: T tokens, A activated experts per token, E experts (global), L local experts,
M hidden, G EP group size, N rows this rank sends, R rows it receives, P (row, expert) pairs.
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Sequence

import torch
import torch.distributed as dist

from moespec.models.layers import CAPTURING, OP_OBJECTS, REAL_ROWS
from moespec.models.moe import EXPERT_NAME, LocalExperts
from moespec.models.two_batch import Stages, drive, interleave
from moespec.parallel.comm import Collectives, CommStream, Ready
from moespec.parallel.exchange import (TOPK_IDX_DTYPE, Call, EmulatedBuffer, LowLatencyExchange,
                                       aligned_capacity, capacity_rows)
from moespec.parallel.groups import ParallelContext, ParallelError

Backend = Literal["torch", "deepep"]
SharedExperts = Callable[[torch.Tensor], torch.Tensor] | None


# ---------------------------------------------------------------------------------- the step

def split_point(bounds: Sequence[int]) -> int:
    """The request boundary nearest the middle of the batch: each request's tokens stay in one half.
    bounds: the host's copy of qo_indptr [B+1] (`Batch.qo_bounds`: read on the host, not from the
    device). Depends only on the batch, so every rank that sees the batch agrees."""
    total = bounds[-1]
    return min(bounds, key=lambda b: (abs(2 * b - total), b))


class EPRuntime:
    """What every EP layer of one model shares: the group, the comm thread, the backend and the
    current step's microbatch split (set by `step`, read by every MoE layer, MTP included)."""

    def __init__(self, ctx: ParallelContext, collectives: Collectives | None = None, backend: Backend = "torch",
                 microbatch: bool = False, max_tokens_per_rank: int = 256, dp: bool = False,
                 two_batch: bool = False, fp8_dispatch: bool = False) -> None:
        self.ctx, self.backend, self.microbatch, self.dp = ctx, backend, microbatch, dp
        self.two_batch = two_batch  # the halves take turns across whole forwards (two_batch_split)
        self.two_batch_plans = 0  # forwards planned as two halves so far
        self.captured_halves = 0  # MoE forwards of captured steps run as two microbatches so far
        # DeepEP low-latency buffers: D * (1 + k), rounded up so that ranks * C is whole row tiles
        self.max_tokens_per_rank = aligned_capacity(max_tokens_per_rank, ctx.ep_size, capacity_rows(backend))
        self.fp8_dispatch = fp8_dispatch  # low-latency dispatch in FP8 with per-128 scales (combine: model dtype)
        self.collectives = collectives or Collectives(ctx)
        self.stream = CommStream(self.collectives)
        self.split: int | None = None
        self.num_tokens: int | None = None  # the step's real rows (a compiled step pads the batch past them)
        self.low_latency: bool | None = None  # the fixed-capacity exchange, agreed by all ranks for the step
        self.capacity: int | None = None  # its C under data-parallel attention, agreed for the step
        self.active = False
        self.captured = False  # model.cuda_graph: every fixed-capacity call at the buffer's capacity (`call_capacity`)
        self.fixed: LowLatencyExchange | None = None  # the fixed-capacity exchange, built on first use
        self.buffer, self.buffer_mode = None, None  # DeepEP: one Buffer per process
        self.buffer_shape: tuple[int, int] | None = None  # (hidden, experts) it serves
        # DeepEP: every rank's host, gathered here, where no helper thread yet uses the control group
        # (the Buffer is built inside the first forward, beside overlap's agreement on the next step)
        self.hosts = gather_hosts(ctx) if backend == "deepep" and ctx.ep_size > 1 else None

    @contextmanager
    def step(self, qo_bounds: Sequence[int] | None = None, low_latency: bool | None = None,
             capacity: int | None = None) -> Iterator[None]:
        """Run one forward; with microbatching on and request boundaries given (host ints), MoE
        layers split the batch in two at `split_point(qo_bounds)`. Both halves always run, empty or
        not, so every rank issues the same collectives whatever its own batch. `low_latency`: the
        fixed-capacity exchange (decode and verify steps), decided by all ranks; otherwise the
        uneven one (torch) or DeepEP's normal mode."""
        if self.active:
            raise ParallelError("EPRuntime.step() is already active: one batch runs at a time")
        self.active, self.low_latency, self.capacity = True, low_latency, capacity
        self.split = self.split_of(qo_bounds)
        self.num_tokens = qo_bounds[-1] if qo_bounds is not None else None
        try:
            yield
        finally:
            self.active, self.split, self.low_latency, self.capacity, self.num_tokens = False, None, None, None, None

    def configure(self, config, model_config=None, dtype: torch.dtype | None = None) -> None:
        """Take an engine config's attention layout and microbatching (its `parallel` section) and
        whether its steps are captured (`model.cuda_graph`): engines built in turn on the same ranks
        may differ in them. Two-batch overlap implies microbatching: forwards it does not split, split
        inside the MoE layers. With DeepEP, the model (its config and dtype) is checked against
        what DeepEP's kernels take, at engine build rather than at the first MoE call."""
        parallel = config.parallel
        if self.backend == "deepep" and model_config is not None:
            check_deepep_model(model_config.hidden_size, getattr(model_config, "num_experts_per_tok", 0), dtype,
                               parallel.fp8_dispatch)
        self.captured = config.model.cuda_graph
        self.dp = parallel.attention == "dp"
        self.microbatch = parallel.microbatch or parallel.two_batch_overlap
        self.two_batch = parallel.two_batch_overlap
        self.fp8_dispatch = parallel.fp8_dispatch

    def two_batch_split(self, qo_bounds: Sequence[int]) -> int | None:
        """Two-batch overlap: the request at which a forward over qo_bounds [B+1] (host ints) splits
        into two microbatches that take turns through every layer (the split `step` gives the MoE
        layers), or None when off or when a half would hold no tokens. Then the MoE layers split
        alone, which issues the same collectives in the same order, so ranks may differ."""
        if not (self.two_batch and self.microbatch) or len(qo_bounds) < 3:
            return None
        split = split_point(qo_bounds)
        if not 0 < split < qo_bounds[-1]:
            return None
        self.two_batch_plans += 1
        return list(qo_bounds).index(split)

    def exchange(self, num_experts: int) -> LowLatencyExchange:
        """The fixed-capacity exchange every layer shares: DeepEP's low-latency kernels on the
        process's one Buffer, or their emulation (fixed all-to-alls), one call in flight."""
        if self.fixed is None or self.fixed.num_experts != num_experts:  # engines in turn may differ in E + R
            C = self.max_tokens_per_rank
            if self.backend == "deepep":
                self.fixed = LowLatencyExchange(self, lambda hidden: self.deepep_buffer(hidden, num_experts, True),
                                                num_experts, C, per_call=False, index_dtype=deepep_index_dtype())
            else:
                emulated = EmulatedBuffer(self, num_experts)
                self.fixed = LowLatencyExchange(self, lambda hidden: emulated, num_experts, C, per_call=True)
        return self.fixed

    def deepep_buffer(self, hidden: int, num_experts: int, low_latency: bool):
        """The one DeepEP Buffer of this process; its low-latency area is cleaned after normal-mode
        use, and a low-latency call in flight is received before normal mode uses the buffer."""
        if not low_latency and self.fixed is not None:
            self.fixed.receive_in_flight()
        if self.buffer is None:
            self.buffer = build_deepep_buffer(self, hidden, num_experts)
            self.buffer_shape = (hidden, num_experts)
        elif self.buffer_shape != (hidden, num_experts):  # its sizes were DeepEP's hints for that shape
            raise ParallelError(f"DeepEP's buffer of this process was sized for (hidden, experts) {self.buffer_shape}, "
                                f"not {(hidden, num_experts)}: one process serves one DeepEP model shape")
        if low_latency and self.buffer_mode == "normal":
            self.buffer.clean_low_latency_buffer(self.max_tokens_per_rank, hidden, num_experts)
        self.buffer_mode = "low_latency" if low_latency else "normal"
        return self.buffer

    def before_replay(self) -> None:
        """Before a captured step replays: its low-latency kernels run without this Python, so
        DeepEP's buffer is cleaned here after normal-mode use (a prefill step), as the first eager
        low-latency call would."""
        if self.buffer is not None and self.buffer_mode == "normal":
            self.deepep_buffer(*self.buffer_shape, low_latency=True)

    @contextmanager
    def padded_split(self, qo_bounds: Sequence[int]) -> Iterator[None]:
        """A captured step's microbatch split: `split_point` of its padded batch's bounds (host
        ints), the one its capture took (`step` over the padded batch), at every replay, whichever
        rows of the batch are real (a graph holds the split it was captured with)."""
        saved, self.split = self.split, self.split_of(qo_bounds)
        try:
            yield
        finally:
            self.split = saved

    def split_of(self, qo_bounds: Sequence[int] | None) -> int | None:
        """Where the MoE layers split a forward over qo_bounds [B+1] (host ints): None when
        microbatching is off or no bounds are given."""
        return split_point(qo_bounds) if self.microbatch and qo_bounds is not None else None

    def call_capacity(self, num_tokens: int) -> int | None:
        """C of one fixed-capacity call over a batch (or half) of num_tokens, the same on every rank:
        replicated, every rank's share of it (all hold the batch); data-parallel, the step's agreed
        capacity (`capacity`, set by the step); None: the buffer's, always with captured steps
        (a graph's C is fixed, and an eager call on another rank must pair with it)."""
        if self.captured:
            return None
        if not self.dp:
            return max(1, -(-num_tokens // self.ctx.ep_size))
        return self.capacity

    def rows_of(self, num_tokens: int) -> tuple[int, int]:
        """Rows [lo, hi) of a batch of num_tokens this rank dispatches: all of its own under
        data-parallel attention, its share of the common batch under replicated attention."""
        if self.dp:
            return 0, num_tokens
        return shard_bounds(num_tokens, self.ctx.ep_rank, self.ctx.ep_size)

    def gather(self, shard: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Combined rows of this rank [hi - lo, M] -> the batch's [T, M] (all-gathered when replicated)."""
        return shard if self.dp else gather_shards(self.collectives, shard, num_tokens)

    def join(self, experts: list["EPExperts"], dtype: torch.dtype, low_latency: bool | None = None,
             capacity: int | None = None) -> None:
        """A forward this rank has no tokens for: run each MoE layer's collectives with zero rows
        (through the exchange the others use), so the ranks that do have tokens are not left
        waiting (data-parallel attention)."""
        with self.step((0,), low_latency, capacity):
            for layer in experts:
                hidden, top_k, device = layer.w2.shape[1], layer.top_k, layer.w2.device  # on the weights' device:
                layer.forward_with_shared(torch.zeros(0, hidden, dtype=dtype, device=device),  # collectives and
                                          torch.zeros(0, top_k, dtype=torch.int64, device=device),  # kernels take
                                          torch.zeros(0, top_k, dtype=dtype, device=device), None)  # device tensors

    def close(self) -> None:
        """Stop the comm thread and release DeepEP's buffer (built with explicitly_destroy: its
        destructor may hang Python's exception handling, says DeepEP's docstring)."""
        self.stream.close()
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None


def ep_experts_factory(runtime: EPRuntime, num_redundant: int = 0) -> Callable:
    """`load_model(path, experts_factory=ep_experts_factory(runtime))`: each MoE layer keeps only
    this rank's experts, and weight loading skips the others. `num_redundant`: R extra physical
    slots over the group (parallel.eplb), R / G more on each rank."""
    def build(config) -> LocalExperts:
        if runtime.ctx.ep_size == 1:
            return LocalExperts.for_config(config)
        cls = DeepEPExperts if runtime.backend == "deepep" else EPExperts
        return cls(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, runtime,
                   config.num_experts_per_tok, num_redundant)
    return build


def shard_bounds(num_tokens: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [lo, hi) of `num_tokens` this rank dispatches: an even split in rank order."""
    return num_tokens * rank // size, num_tokens * (rank + 1) // size


def check_divisible(num_experts: int, ep_size: int) -> None:
    if num_experts % ep_size != 0:
        raise ParallelError(f"n_routed_experts {num_experts} is not divisible by parallel.ep_size {ep_size}; "
                            "choose an ep_size that divides the expert count")


# ------------------------------------------------------------------------- torch backend

@dataclass
class Dispatched:
    """One half after dispatch: the rows this rank received and how to send results back."""

    x: torch.Tensor  # [R, M]
    local_ids: torch.Tensor  # [R, A] local expert ids, -1 where the expert lives elsewhere
    weights: torch.Tensor  # [R, A] gate weights, 0 where the expert lives elsewhere
    token_index: torch.Tensor  # [N] shard row each sent row came from (grouped by destination)
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int  # T of this half


@torch.library.custom_op("moespec::ep_experts", mutates_args=())
def ep_experts_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: int) -> torch.Tensor:
    """An EP layer inside a compiled step (`model.compile`): opaque to the compiler, so the
    exchange (collectives, the comm thread, host ints) runs eagerly between compiled graphs,
    and every layer's call keeps its own key in the graph (no graph break, no per-layer guard)."""
    return OP_OBJECTS[key].run_padded(x, topk_ids, topk_weights)


@ep_experts_op.register_fake
def ep_experts_fake(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)


class EPExperts(LocalExperts):
    """Routed experts [first, first + L) of this rank; all-to-all over torch.distributed.

    With redundant experts (parallel.eplb, parallel/eplb.py) the E logical experts live on
    E + R physical slots, L = (E + R) / G per rank: `num_experts` and every id the exchange sees
    are physical slots; the router's logical ids are routed to a replica first (`balancer`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, runtime: EPRuntime, top_k: int,
                 num_redundant: int = 0) -> None:
        ctx = runtime.ctx
        check_divisible(num_experts, ctx.ep_size)
        check_divisible(num_experts + num_redundant, ctx.ep_size)
        self.num_logical, self.num_own = num_experts, num_experts // ctx.ep_size  # own: read from the checkpoint
        num_local = (num_experts + num_redundant) // ctx.ep_size
        super().__init__(num_experts + num_redundant, hidden, intermediate, first=ctx.ep_rank * num_local,
                         num_local=num_local)
        self.runtime, self.top_k = runtime, top_k
        self.key = OP_OBJECTS.add(self)  # the compiled step's op finds the layer by it
        self.shared: SharedExperts = None  # set by `bind_shared`; not a submodule (its weights are the MoE's)
        self.balancer, self.balancer_index = None, 0  # parallel/eplb.py: records loads, routes to replicas

    def bind_balancer(self, balancer, index: int) -> None:
        """The model's `ExpertBalancer`, and this layer's row in its tables (a plain reference)."""
        self.__dict__["balancer"], self.balancer_index = balancer, index

    def mark_loaders(self) -> None:
        super().mark_loaders()
        for param, parts in ((self.w13, 2), (self.w2, 1), (self.w13_scale_inv, 2), (self.w2_scale_inv, 1)):
            if param is not None:
                param.num_loads = self.num_own * parts  # the replica slots are filled from these

    def locate_expert(self, param: torch.Tensor, name: str) -> torch.Tensor | None:
        """Checkpoint expert e of this rank's own E / G fills local slot e - rank * E / G (the
        trivial placement, parallel/placement.py); other ranks' experts are not read."""
        match = EXPERT_NAME.match(name)
        if match is None:
            return super().locate_expert(param, name)  # its error names the tensor
        expert, lo = int(match.group(1)), self.num_own * self.runtime.ctx.ep_rank
        if not lo <= expert < lo + self.num_own:
            return None
        return super().locate_expert(param, name.replace(f".experts.{expert}.", f".experts.{self.first + expert - lo}."))

    def fill_replicas(self) -> None:
        """The trivial placement's extra slots: copies of this rank's own experts, in turn."""
        for slot in range(self.num_own, self.num_local):
            for tensor in (self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv):
                if tensor is not None:
                    tensor[slot].copy_(tensor[slot % self.num_own])

    def bind_shared(self, shared: SharedExperts) -> None:
        """The shared experts of this layer's MoE block, for the compiled step's op."""
        self.__dict__["shared"] = shared  # a plain reference: nn.Module would register it a second time

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.forward_with_shared(x, topk_ids, topk_weights, None)

    def run_padded(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The compiled step's call: x [T', M] padded past the step's real rows; only the real ones
        are exchanged (padded rows must not reach other ranks, nor count against the agreed
        capacity), the padded ones get zeros. Outside a step (compiling at warm-up) nothing is
        exchanged. A captured step passes every row (its shapes are the padded batch's), and
        `forward_eager` routes the padded ones to no expert."""
        if CAPTURING.get():
            return self.forward_eager(x, topk_ids, topk_weights, self.shared)
        T = self.runtime.num_tokens if self.runtime.active else 0
        if T is None or T > x.shape[0]:
            raise ParallelError(f"EP layer in a compiled step: {T} real rows of a batch of {x.shape[0]}")
        out = x.new_zeros(x.shape)
        if self.runtime.active:
            out[:T] = self.forward_eager(x[:T], topk_ids[:T], topk_weights[:T], self.shared)
        return out

    def forward_with_shared(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            shared: SharedExperts) -> torch.Tensor:
        """Routed (+ shared) expert output [T, M]. Inside a compiled step: the opaque op
        (`ep_experts_op`), which runs `forward_eager` between the compiled graphs."""
        if torch.compiler.is_compiling():
            if shared is not self.shared:
                raise ParallelError("EP layer compiled with shared experts other than those bound to it")
            return torch.ops.moespec.ep_experts(x, topk_ids, topk_weights, self.key)
        return self.forward_eager(x, topk_ids, topk_weights, shared)

    def forward_eager(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      shared: SharedExperts) -> torch.Tensor:
        """Routed (+ shared) expert output [T, M]: the whole batch, or (microbatching) its halves
        [0, split) and [split, T) in turns, each half's transfers in flight while the other
        computes. Both halves run, empty or not, so the collectives pair up across ranks. In a
        captured step the padded rows route to no expert (id -1): they take no room in the
        exchange and no expert time, and come back as zeros."""
        topk_ids = mask_padding(topk_ids)
        if self.balancer is not None:  # logical ids counted, then routed to physical slots
            topk_ids = self.balancer.record_and_route(self.balancer_index, topk_ids)
        split = self.runtime.split
        if split is None:
            return drive(self.stages(x, topk_ids, topk_weights, shared))
        self.runtime.captured_halves += CAPTURING.get()
        halves = (slice(0, split), slice(split, x.shape[0]))
        return torch.cat(interleave([self.stages(x[h], topk_ids[h], topk_weights[h], shared, first=i == 0)
                                     for i, h in enumerate(halves)]))

    def stages(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               shared: SharedExperts, first: bool = True) -> Stages:
        """Dispatch -> experts -> combine of one batch (or microbatch), as a generator that yields
        while each transfer is in flight (models/two_batch.py) -> routed (+ shared) output [T, M].
        The shared experts run in the first half's dispatch window and in the last half's
        combine window.

        The fixed-capacity exchange has one call in flight (parallel/exchange.py): issuing a call
        first receives the one in flight. Two halves A and B in turns therefore run a layer as
        DeepEP's figures/low-latency.png draws it, each window holding the other half's compute:

            A: issue dispatch A, shared experts A                     | yield
            B: receive dispatch A, issue dispatch B                   | yield
            A: experts A, receive dispatch B, issue combine A         | yield
            B: experts B, receive combine A, issue combine B, shared experts B | yield
            A: output A;  B: receive combine B, output B

        Across a forward (two-batch overlap) B's attention also runs in dispatch A's window and
        A's next attention in combine B's."""
        T = x.shape[0]
        check_device(self.w2.device, x=x, topk_ids=topk_ids, topk_weights=topk_weights)
        sent = self.send(x, topk_ids, topk_weights)
        shared_out = shared(x) if shared is not None and first else None
        yield
        back = self.send_back(sent.wait(), topk_ids, topk_weights, T)
        if shared is not None and not first:
            shared_out = shared(x)
        yield
        out = back.wait()  # [T, M]
        return out if shared_out is None else out + shared_out

    def fixed_exchange(self, num_tokens: int) -> bool:
        """Whether a call over num_tokens takes the fixed-capacity exchange (the step decides)."""
        return bool(self.runtime.low_latency)

    def send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """This rank's rows dispatched, in flight -> a handle whose wait() is what this rank received."""
        T = x.shape[0]
        if not self.fixed_exchange(T):
            return self.runtime.stream.submit("dispatch", self.dispatch, x, topk_ids, topk_weights)
        rows = self.shard_of(slice(0, T))
        return self.runtime.exchange(self.num_experts).dispatch(x[rows], topk_ids[rows],
                                                                self.runtime.call_capacity(T))

    def send_back(self, received, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int):
        """The local experts over what this rank received, then their combine in flight -> a
        handle whose wait() is the output [T, M] (all-gathered when attention is replicated)."""
        if not self.fixed_exchange(num_tokens):
            combine = self.runtime.stream.submit("combine", self.combine, self.compute(received), received)
        else:
            rows = self.shard_of(slice(0, num_tokens))
            y = self.forward_masked(received.x, received.counts, received.dtype)  # [L, G*C, M]
            combine = self.runtime.exchange(self.num_experts).combine(y, topk_ids[rows], topk_weights[rows], received)
        return self.gathered(combine, num_tokens)

    def gathered(self, combine, num_tokens: int):
        """A combine, then (replicated) the all-gather of every rank's rows, queued on the comm
        thread behind the combine so it overlaps compute too."""
        if self.runtime.dp:
            return combine
        if isinstance(combine, Call):  # a low-latency receive hook runs on this thread, in its turn
            return Gathered(combine, self.runtime, num_tokens)
        return self.runtime.stream.submit("gather", lambda: self.runtime.gather(combine.wait(), num_tokens))

    def shard_of(self, half: slice) -> slice:
        """This rank's rows of one half, as absolute rows of the batch."""
        lo, hi = self.runtime.rows_of(half.stop - half.start)
        return slice(half.start + lo, half.start + hi)

    # -- the three stages (dispatch and combine run on the comm thread)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Send each token of this rank's rows once to every rank owning one of its experts."""
        ctx, coll = self.runtime.ctx, self.runtime.collectives
        lo, hi = self.runtime.rows_of(x.shape[0])
        token_index, dest = self.plan_rows(topk_ids[lo:hi])  # [N], [N]
        ids = topk_ids[lo:hi][token_index]  # [N, A]
        owned = ids // self.num_local == dest[:, None]  # [N, A] expert lives on the row's destination
        local_ids = torch.where(owned, ids - dest[:, None] * self.num_local, -1).to(torch.int32)
        weights = torch.where(owned, topk_weights[lo:hi][token_index], 0).to(x.dtype)
        send_counts = torch.bincount(dest, minlength=ctx.ep_size)  # [G]
        recv_counts = coll.exchange_counts(send_counts).tolist()
        payload = pack_rows(x[lo:hi][token_index], weights, local_ids)  # [N, bytes]
        received = coll.all_to_all(payload, send_counts.tolist(), recv_counts)
        rx, rw, rids = unpack_rows(received, x.shape[1], topk_ids.shape[1], x.dtype)
        return Dispatched(rx, rids, rw, token_index, send_counts.tolist(), recv_counts, x.shape[0])

    def plan_rows(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_ids [Ts, A] -> (token row, destination rank) of each row to send, grouped by rank."""
        G = self.runtime.ctx.ep_size
        dest = topk_ids // self.num_local  # [Ts, A]
        hits = torch.zeros(topk_ids.shape[0], G, dtype=torch.bool, device=topk_ids.device)
        hits.scatter_(1, dest, True)  # [Ts, G] token needs rank g
        rank, token = hits.t().nonzero(as_tuple=True)  # rank-major: grouped by destination
        return token, rank

    def compute(self, received: Dispatched) -> torch.Tensor:
        return self.compute_rows(received.x, received.local_ids, received.weights)

    def compute_rows(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [R, M], local_ids [R, A] (-1: not here), weights [R, A] -> weighted sum of this rank's
        experts per row [R, M]."""
        rows, slots = (local_ids >= 0).nonzero(as_tuple=True)  # [P] each
        ids = local_ids[rows, slots].long()[:, None] + self.first  # [P, 1] global ids
        out = x.new_zeros(x.shape)
        if rows.numel():
            out.index_add_(0, rows, LocalExperts.forward(self, x[rows], ids, weights[rows, slots][:, None]))
        return out

    def combine(self, y: torch.Tensor, received: Dispatched) -> torch.Tensor:
        """y [R, M] -> back to the senders, summed per token -> this rank's rows [Ts, M]."""
        back = self.runtime.collectives.all_to_all(y, received.recv_counts, received.send_counts)  # [N, M]
        lo, hi = self.runtime.rows_of(received.num_tokens)
        return y.new_zeros(hi - lo, y.shape[1]).index_add_(0, received.token_index, back)  # [Ts, M]


class Gathered:
    """A low-latency combine, then (replicated attention) the all-gather of every rank's rows:
    `wait()` receives the combine here, then runs the all-gather on the comm thread in its turn."""

    def __init__(self, combine: Call, runtime: EPRuntime, num_tokens: int) -> None:
        self.combine, self.runtime, self.num_tokens = combine, runtime, num_tokens

    def wait(self) -> torch.Tensor:
        return self.runtime.stream.run("gather", self.runtime.gather, self.combine.wait(), self.num_tokens)


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Every tensor the EP path hands to a collective or kernel is on the weights' device."""
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise ParallelError(f"EP layer input {name} is on {tensor.device}, its experts' weights on {device}")


def mask_padding(topk_ids: torch.Tensor) -> torch.Tensor:
    """topk_ids [T, A] with the rows past a captured step's real ones (`REAL_ROWS`, a device
    scalar) routed to no expert (-1); unchanged outside a captured step."""
    real = REAL_ROWS.get()
    if real is None:
        return topk_ids
    padded = torch.arange(topk_ids.shape[0], device=topk_ids.device) >= real  # [T]
    return topk_ids.masked_fill(padded[:, None], -1)


def gather_shards(coll: Collectives, shard: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Every rank's shard [Ts, M] -> [T, M]; shards are padded to one size for the all-gather."""
    G, width = coll.size, -(-num_tokens // coll.size)
    padded = shard.new_zeros(width, shard.shape[1])
    padded[: shard.shape[0]] = shard
    gathered = coll.all_gather(padded)  # [G * width, M]
    parts = [gathered[g * width: g * width + hi - lo] for g, (lo, hi) in
             enumerate(shard_bounds(num_tokens, g, G) for g in range(G))]
    return torch.cat(parts)


def pack_rows(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """x [N, M], weights [N, A], local_ids [N, A] int32 -> one byte row each [N, bytes], so a
    dispatch is a single all-to-all."""
    return torch.cat([t.contiguous().view(torch.uint8) for t in (x, weights, local_ids)], dim=1)


def unpack_rows(payload: torch.Tensor, hidden: int, top_k: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    size = torch.empty((), dtype=dtype).element_size()
    x_end, w_end = hidden * size, (hidden + top_k) * size
    x = payload[:, :x_end].contiguous().view(dtype)  # [R, M]
    weights = payload[:, x_end:w_end].contiguous().view(dtype)  # [R, A]
    local_ids = payload[:, w_end:].contiguous().view(torch.int32)  # [R, A]
    return x, weights, local_ids


# ------------------------------------------------------------------------- DeepEP backend

class DeepEPExperts(EPExperts):
    """DeepEP V1 API (`from deep_ep import Buffer`) on the process's one Buffer: low-latency
    kernels for decode and verify steps (`DeepEPExchange`, through `EPExperts.stages` like the
    torch backend), normal mode for prefill. Needs CUDA, NVSHMEM and a DeepEP build; it has not
    run on this project's CPU machines. Under data-parallel attention every rank must pick the
    same mode although its batch is its own: the step's agreed `runtime.low_latency` decides
    (without one: normal mode under data-parallel attention; with replicated batches, low latency
    where the largest rank's share fits)."""

    def fixed_exchange(self, num_tokens: int) -> bool:
        low_latency = self.runtime.low_latency
        if low_latency is None:  # no agreement: what every rank decides alike (else one would wait forever)
            largest_share = -(-num_tokens // self.runtime.ctx.ep_size)  # of a replicated batch: alike on all ranks
            return not self.runtime.dp and largest_share <= self.runtime.max_tokens_per_rank
        return low_latency

    def send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        if self.fixed_exchange(x.shape[0]):
            return super().send(x, topk_ids, topk_weights)
        rows = self.shard_of(slice(0, x.shape[0]))  # normal mode: the whole exchange, here and now
        return Ready(self.run_normal(x[rows], topk_ids[rows], topk_weights[rows]))

    def send_back(self, received, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int):
        if self.fixed_exchange(num_tokens):
            return super().send_back(received, topk_ids, topk_weights, num_tokens)
        return Ready(self.runtime.gather(received, num_tokens))  # received: run_normal's rows [Ts, M]

    def run_normal(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Prefill: layout -> dispatch -> experts (weighted here: DeepEP's combine sums unweighted)
        -> combine. The host waits for the receive counts here: prefill is not captured."""
        buf = self.runtime.deepep_buffer(x.shape[1], self.num_experts, low_latency=False)
        ids, x = topk_ids.to(deepep_index_dtype()).contiguous(), x.contiguous()  # DeepEP asserts contiguous inputs
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.num_experts)
        recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=topk_weights.float().contiguous())
        y = self.compute_rows(recv_x, recv_ids, recv_w.to(x.dtype))  # recv_ids are local ids, -1 elsewhere
        combined, _, _ = buf.combine(y.contiguous(), handle)
        return combined  # [Ts, M]


def build_deepep_buffer(runtime: EPRuntime, hidden: int, num_experts: int):
    """The process's one DeepEP Buffer, shared by every MoE layer (the MTP layer's too) and by
    both modes: low-latency RDMA bytes for `max_tokens_per_rank` tokens, normal-mode NVLink/RDMA
    bytes by DeepEP's hints, one queue pair per local expert (at least DeepEP's default 24 for
    normal mode), and NVSHMEM's queue depth raised to what that many tokens need. A second
    low-latency Buffer in one process trips DeepEP's `cpu_rdma_team` assertion.

    NVLink stays allowed for low-latency traffic between GPUs of a node (DeepEP's default). Its
    docstring calls that "somehow incompatible with the hook-based overlapping": over NVLink the
    send kernel copies the rows itself ("NVLink uses memory semantics, kernels won't exit only if
    the transmission is finished", DeepEP PR #173), so those bytes move before the send returns
    instead of behind the other microbatch's compute. The order stays correct (the hook still
    receives); only the intra-node share of the transfer is not hidden, and without NVLink a
    node's ranks would need RDMA loopback through their NICs."""
    Buffer = import_deepep().Buffer
    group, size, budget = runtime.ctx.ep_group, runtime.ctx.ep_size, runtime.max_tokens_per_rank
    check_deepep_hosts(runtime.hosts)
    depth = 2 * (budget + 1)  # DeepEP asserts nvshmem_qp_depth >= (tokens + 1) * 2 (default depth 1024)
    if int(os.environ.get("NVSHMEM_QP_DEPTH", "1024")) < depth:
        os.environ["NVSHMEM_QP_DEPTH"] = str(depth)  # read when NVSHMEM starts, inside the Buffer
    rdma = Buffer.get_low_latency_rdma_size_hint(budget, hidden, size, num_experts)
    configs = (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size))
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, size) for c in configs)  # bf16 rows
    if size > 8:
        rdma = max([rdma] + [c.get_rdma_buffer_size_hint(hidden * 2, size) for c in configs])
    return Buffer(group, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma, low_latency_mode=True,
                  num_qps_per_rank=max(num_experts // size, 24), allow_nvlink_for_low_latency_mode=True,
                  explicitly_destroy=True)


DEEPEP_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # its kernels' hidden sizes (3072: after v1.2.1)
DEEPEP_MAX_TOP_K = 11  # its low-latency kernels' kNumMaxTopK
DEEPEP_NVL_PEERS = 8  # ranks DeepEP takes as one NVLink node: each 8 consecutive ranks of the group


def check_deepep_model(hidden: int, top_k: int, dtype: torch.dtype | None, fp8_dispatch: bool) -> None:
    """What DeepEP's kernels take (csrc/kernels/legacy/launch.cuh's hidden sizes, internode_ll.cu's
    top-k, buffer.hpp's bf16 rows; FP8 dispatch: hidden % 512), refused by name up front: DeepEP
    asserts on one rank at the first MoE call, and the others wait for it until its timeout."""
    if dtype is not None and dtype != torch.bfloat16:
        raise ParallelError(f"parallel.moe_backend 'deepep' sends bfloat16 rows; model.dtype is {dtype}")
    if hidden not in DEEPEP_HIDDEN:
        raise ParallelError(f"parallel.moe_backend 'deepep': the model's hidden size {hidden} is not one DeepEP's "
                            f"kernels are built for ({', '.join(map(str, DEEPEP_HIDDEN))}); use moe_backend 'torch'")
    if top_k > DEEPEP_MAX_TOP_K:
        raise ParallelError(f"parallel.moe_backend 'deepep': num_experts_per_tok {top_k} is over DeepEP's "
                            f"{DEEPEP_MAX_TOP_K}")
    if fp8_dispatch and hidden % 512:
        raise ParallelError(f"parallel.fp8_dispatch needs hidden % 512 == 0 (DeepEP asserts it); hidden is {hidden}")


def gather_hosts(ctx: ParallelContext) -> list[str]:
    """Every EP rank's host name, in rank order (a collective on the control group)."""
    hosts: list[str] = [""] * ctx.ep_size
    dist.all_gather_object(hosts, socket.gethostname(), group=ctx.control_group or ctx.ep_group)
    return hosts


def check_deepep_hosts(hosts: Sequence[str]) -> None:
    """DeepEP takes each 8 consecutive ranks of the group (all of them, if fewer) as one NVLink
    node and opens CUDA IPC handles between them (buffer.hpp `sync`): each such block must be one
    host, or building the Buffer fails on every rank. hosts [G]: each EP rank's host."""
    block = min(len(hosts), DEEPEP_NVL_PEERS)
    for first in range(0, len(hosts), block):
        if len(set(hosts[first:first + block])) > 1:
            raise ParallelError(f"DeepEP takes EP ranks {first}-{first + block - 1} as one NVLink node, but they "
                                f"run on hosts {', '.join(hosts[first:first + block])}: place 8 consecutive ranks on "
                                "each node (or all ranks on one node when ep_size < 8), or use moe_backend 'torch'")


def import_deepep():
    try:
        import deep_ep  # optional: built from source, see docs/expert-parallel.md
    except Exception as error:  # its import also checks the NCCL it was built with is the one loaded
        raise ParallelError("parallel.moe_backend 'deepep' needs DeepEP built from source "
                            "(github deepseek-ai/DeepEP, v1.2.1 or later; the PyPI deep-ep package cannot compile); "
                            f"use moe_backend 'torch' otherwise. Importing it failed: {error!r} (a mismatched NCCL: "
                            "see DeepEP's EP_SUPPRESS_NCCL_CHECK)") from error
    return deep_ep


def deepep_index_dtype() -> torch.dtype:
    """DeepEP's top-k id dtype: `deep_ep.topk_idx_t` where exported (int64 unless DeepEP was built
    with EP_NUM_TOPK_IDX_BITS), int64 in v1.2.1, which has no such name."""
    return getattr(import_deepep(), "topk_idx_t", TOPK_IDX_DTYPE)
