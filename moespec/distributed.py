"""Ranks stepping in lockstep under expert parallelism.

Rank 0 (the leader) owns the scheduler, sampler, tokenizer and server. Attention is replicated
and routed experts are sharded, so every forward that contains MoE layers (the target's, and
the MTP layer's) must run on every rank at once. Before each such forward the leader
broadcasts one message: an int64 header, the packed batch, and, for MTP forwards, the input
token ids and hidden states (or a flag saying "the target's hidden states and plan of the
previous forward", the verify re-run). Followers replay the forward into their own KV caches
and discard the outputs. The draft model of draft-target speculation runs on the leader only.

Shapes legend: T tokens, M hidden.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

import torch
import torch.distributed as dist

from moespec.attention import ForwardContext, create_backend
from moespec.batch import Batch
from moespec.config import EngineConfig

logger = logging.getLogger(__name__)

STOP, TARGET, MTP, NOOP = 0, 1, 2, 3  # NOOP: the leader is idle but alive (followers' waits would time out)
HEADER = 6  # op, reuse_target (hidden + plan of the previous target forward), batch len, ids len, hidden rows, cols


class RankSync:
    """Leader side: announces each MoE-bearing forward, and runs it inside the EP runtime's step."""

    def __init__(self, ctx, runtime) -> None:
        self.ctx, self.runtime = ctx, runtime
        self.last_announce = time.monotonic()

    @contextlib.contextmanager
    def target(self, batch: Batch) -> Iterator[None]:
        self.announce(TARGET, batch)
        with self.runtime.step(batch.qo_indptr):
            yield

    @contextlib.contextmanager
    def mtp(self, batch: Batch, token_ids: torch.Tensor, hidden: torch.Tensor, reuse_target: bool) -> Iterator[None]:
        self.announce(MTP, batch, token_ids, None if reuse_target else hidden)
        with self.runtime.step(batch.qo_indptr):
            yield

    def announce(self, op: int, batch: Batch | None = None, ids: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None) -> None:
        packed = batch.pack() if batch is not None else torch.zeros(0, dtype=torch.int64)
        ids = ids.to(torch.int64).cpu() if ids is not None else torch.zeros(0, dtype=torch.int64)
        rows, cols = hidden.shape if hidden is not None else (0, 0)
        reuse = int(op == MTP and hidden is None)
        self.last_announce = time.monotonic()
        send(torch.tensor([op, reuse, packed.numel(), ids.numel(), rows, cols]), self.ctx)
        for part in (packed, ids) + ((hidden.float().contiguous(),) if hidden is not None else ()):
            if part.numel():
                send(part.to(self.ctx.device), self.ctx)

    def stop(self) -> None:
        self.announce(STOP)

    def keep_alive(self, interval_s: float) -> None:
        """Tell idle followers the leader lives, at least every interval_s (below the collective timeout)."""
        if time.monotonic() - self.last_announce > interval_s:
            self.announce(NOOP)


def send(tensor: torch.Tensor, ctx) -> torch.Tensor:
    dist.broadcast(tensor, src=0)
    return tensor


def receive(shape: tuple[int, ...], dtype: torch.dtype, ctx) -> torch.Tensor:
    return send(torch.empty(shape, dtype=dtype, device=ctx.device), ctx)


def follow(config: EngineConfig, ctx, runtime, model=None) -> None:
    """Follower loop: replay the leader's forwards until it says stop."""
    from moespec.model_runner import ModelRunner
    from moespec.models import load_model
    from moespec.parallel import ep_experts_factory

    from moespec.plan import resolve_kv_pages

    config = resolve_kv_pages(config)  # the leader sizes its cache with the same plan
    model = model or load_model(config.model.path, config.model.dtype, config.model.device, show_progress=False,
                                quantization=config.model.quantization, experts_factory=ep_experts_factory(runtime))
    runner = ModelRunner(model, config.cache.num_kv_pages, config.cache.page_size, config.model.attention_backend,
                         config.model.device)
    mtp_backend = create_backend(config.model.attention_backend)
    last_hidden, last_ctx = None, None
    logger.info("rank %d following the leader", ctx.rank)
    while True:
        op, reuse, n_batch, n_ids, rows, cols = receive((HEADER,), torch.int64, ctx).tolist()
        if op == STOP:
            return
        if op == NOOP:
            continue
        batch = Batch.unpack(receive((n_batch,), torch.int64, ctx).cpu()).to(runner.device)
        with torch.inference_mode(), runtime.step(batch.qo_indptr):
            if op == TARGET:
                last_ctx = runner.plan(batch)
                last_hidden = model(batch.input_ids, batch.positions, last_ctx)
                continue
            ids = receive((n_ids,), torch.int64, ctx)
            if reuse:
                hidden, mtp_ctx = last_hidden, ForwardContext(last_ctx.backend, runner.cache.layers)
            else:
                hidden = receive((rows, cols), torch.float32, ctx).to(runner.dtype)
                mtp_backend.plan(batch.attention_metadata())
                mtp_ctx = ForwardContext(mtp_backend, runner.cache.layers)
            model.forward_mtp(0, ids, hidden, batch.positions, mtp_ctx)


class Ranks:
    """This process's place among the ranks: its context and the EP runtime shared by MoE layers."""

    def __init__(self, ctx, runtime) -> None:
        self.ctx, self.runtime = ctx, runtime
        self.last_announce = time.monotonic()

    def close(self) -> None:
        from moespec.parallel import destroy

        self.runtime.close()
        destroy(self.ctx)


def join_ranks(config: EngineConfig) -> Ranks | None:
    """Join the process group of a multi-rank launch (torchrun or slurm); None for one process."""
    if config.parallel.ep_size == 1:
        return None
    from moespec.parallel import EPRuntime, init_parallel

    ctx = init_parallel(config.parallel)
    k = config.speculation.num_speculative_tokens if config.speculation.mode != "none" else 0
    runtime = EPRuntime(ctx, backend=config.parallel.moe_backend, microbatch=config.parallel.microbatch,
                        max_tokens_per_rank=config.scheduler.max_num_seqs * (1 + k))
    return Ranks(ctx, runtime)


def run_as_rank(config: EngineConfig) -> Ranks | None:
    """Called before building an engine: followers replay the leader's forwards and exit when it
    stops; the leader (or a single process) gets its Ranks back and builds the engine."""
    ranks = join_ranks(config)
    if ranks is not None and not ranks.ctx.leader:
        try:
            follow(config, ranks.ctx, ranks.runtime)
        finally:
            ranks.close()
        raise SystemExit(0)
    return ranks
