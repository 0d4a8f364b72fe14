"""One process's engine, alone or as one rank of several: join the ranks (torchrun, slurm),
build the Engine, warm it up, and hand rank 0's engine to its caller (`LLM`, the server) while
the other ranks serve their share until rank 0 closes. Above both the engine and the rank
plumbing (`moespec.distributed`), so neither imports the other's caller."""
from __future__ import annotations

import logging
import signal

from moespec.config import EngineConfig
from moespec.distributed import join_ranks
from moespec.engine import Engine
from moespec.machine import keep_freed_host_memory

logger = logging.getLogger(__name__)


def defer_signals_to_rank0(rank: int) -> None:
    """A launcher (torchrun, slurm) signals every rank at once. Rank 0 drains its requests and then
    ends the other ranks' loops; until then they keep serving their share, so they ignore it."""
    def note(signum: int, frame) -> None:
        logger.info("rank %d: signal %d; rank 0 drains, then stops this rank", rank, signum)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, note)


def start_engine(config: EngineConfig, warm_up: bool = False):
    """One process: its Engine. Under torchrun or slurm every rank builds its Engine; rank 0's is
    returned (it takes requests and places them on the ranks), the others serve their share
    until rank 0 closes its engine, then exit. `warm_up`: every rank compiles its static steps
    first (model.compile; no collectives), so none stalls the others at a serving step. Captured
    steps (model.cuda_graph) are captured at start-up always: across ranks only the warm-up, which
    every rank runs alike, captures them, and in one process a capture while serving would race
    the overlap helper thread's kernels."""
    keep_freed_host_memory()
    ranks = join_ranks(config)
    try:
        engine = Engine(config, ranks=ranks)
        if warm_up or config.model.cuda_graph:
            engine.warm_up()
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    if ranks is None or ranks.ctx.leader:
        return engine
    defer_signals_to_rank0(ranks.ctx.rank)
    try:
        engine.serve_forever()
    finally:
        engine.close()
    raise SystemExit(0)
