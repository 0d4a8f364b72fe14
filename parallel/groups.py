"""Process groups from the launcher's environment (torchrun or slurm), built explicitly.

Layout: every rank holds only its share of the routed experts; ranks [g * ep_size, (g + 1) * ep_size)
form expert-parallel group g. Attention is each rank's own (data-parallel) or replicated.
Nothing here runs at import time: `init_parallel(config)` returns a `ParallelContext` that
callers pass on, and `destroy(ctx)` tears it down.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from moespec.config import ParallelSection


class ParallelError(RuntimeError):
    pass


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, read from torchrun or slurm variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    local_rank: int
    ep_group: Any  # torch.distributed ProcessGroup, or None for a single process
    ep_rank: int
    ep_size: int
    leader: bool  # rank 0: takes the requests and places them on the ranks
    device: torch.device
    timeout_s: float = 120.0
    host: str = "127.0.0.1"  # where other ranks reach rank 0
    control_group: Any = None  # gloo over the EP group's ranks: the step agreement, beside the forwards'

    @property
    def distributed(self) -> bool:
        return self.ep_group is not None


DEFAULT_PORT = 29500


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand slurm's compressed host list: 'gpu[01-03,07],cpu5' -> gpu01, gpu02, gpu03, gpu07, cpu5."""
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        hosts += expand_host(item)
    return hosts


def expand_host(item: str) -> list[str]:
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if match is None:
        return [item]
    prefix, ranges, suffix = match.groups()
    hosts = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        for n in range(int(first), int(last or first) + 1):
            hosts.append(f"{prefix}{n:0{len(first)}d}{suffix}")
    return hosts


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """torchrun variables first, then slurm's; None when neither launcher set this process up."""
    env = os.environ if env is None else env
    port = int(env.get("MASTER_PORT", DEFAULT_PORT))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), port)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist and "MASTER_ADDR" not in env:
            raise ParallelError("slurm launch without SLURM_NODELIST: set MASTER_ADDR to the first node")
        master = env.get("MASTER_ADDR") or parse_nodelist(nodelist)[0]
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         master, port)
    return None


def check_layout(config: ParallelSection, world_size: int) -> None:
    if world_size % config.ep_size != 0:
        raise ParallelError(f"world size {world_size} is not a multiple of parallel.ep_size {config.ep_size}")
    if config.dist_backend == "nccl" and not torch.cuda.is_available():
        raise ParallelError("parallel.dist_backend 'nccl' needs CUDA; use 'gloo' on CPU")


def init_parallel(config: ParallelSection, env: Mapping[str, str] | None = None) -> ParallelContext:
    """Join the process group named by the launcher's environment and build the EP groups.

    A rank that never arrives or dies fails collectives after `config.timeout_s` seconds instead
    of hanging."""
    launch = read_launch_env(env)
    if launch is None:
        if config.ep_size != 1:
            raise ParallelError(f"parallel.ep_size {config.ep_size} needs a launcher: run under torchrun or slurm "
                                "(RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS unset)")
        return single_process_context(config)
    check_layout(config, launch.world_size)
    device = device_for(config, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA allocation (NCCL's, DeepEP's, the model's)
    timeout = datetime.timedelta(seconds=config.timeout_s)
    try:
        dist.init_process_group(config.dist_backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                                rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    except Exception as error:  # the store raises its own timeout/connection errors
        where = f"{launch.master_addr}:{launch.master_port}"
        raise ParallelError(f"rank {launch.rank} could not join {launch.world_size} ranks at {where} "
                            f"within {config.timeout_s:g} s: {error}") from error
    group, ep_rank = build_ep_group(launch.rank, launch.world_size, config.ep_size, timeout=timeout)
    control, _ = build_ep_group(launch.rank, launch.world_size, config.ep_size, "gloo", own=True, timeout=timeout)
    return ParallelContext(launch.rank, launch.world_size, launch.local_rank, group, ep_rank, config.ep_size,
                           launch.rank == 0, device, config.timeout_s, launch.master_addr, control)


def single_process_context(config: ParallelSection) -> ParallelContext:
    return ParallelContext(0, 1, 0, None, 0, 1, True, device_for(config, 0), config.timeout_s)


def device_for(config: ParallelSection, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if config.dist_backend == "nccl" else torch.device("cpu")


def build_ep_group(rank: int, world_size: int, ep_size: int, backend: str | None = None,
                   own: bool = False, timeout: datetime.timedelta | None = None) -> tuple[Any, int]:
    """Every rank must create every group (a collective), in the same order. `own`: a group of its
    own even over every rank (its collectives may run beside the default group's, from another
    thread)."""
    if ep_size == world_size and not own:
        return dist.group.WORLD, rank
    mine = None
    for start in range(0, world_size, ep_size):
        group = dist.new_group(list(range(start, start + ep_size)), backend=backend, timeout=timeout)
        if start <= rank < start + ep_size:
            mine = group
    return mine, rank % ep_size


def destroy(ctx: ParallelContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
