"""Run a function on several local ranks as processes (tests and benchmarks on one machine).

Each child gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a
free port), runs `fn(rank, *args)` and sends back its result (torch-serialized) or its error.
A child that neither answers nor exits within `timeout_s` is killed, so nothing hangs.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None  # the child's exception, formatted
    exitcode: int | None = None
    seconds: float = 0.0  # from start until the child answered


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_main(fn: Callable, rank: int, world_size: int, port: int, results, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)
        results.put((rank, buffer.getvalue(), None))
    except BaseException as error:  # report everything, including a peer's failure
        results.put((rank, None, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 60.0) -> list[RankResult]:
    """Start `world_size` processes running `fn(rank, *args)`; results in rank order."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=child_main, args=(fn, r, world_size, port, results, args), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    outcomes = collect(results, procs, time.monotonic(), timeout_s)
    stop(procs)
    for outcome, proc in zip(outcomes, procs):
        outcome.exitcode = proc.exitcode
    return outcomes


def collect(results, procs: list, start: float, timeout_s: float) -> list[RankResult]:
    outcomes = [RankResult(r) for r in range(len(procs))]
    pending = set(range(len(procs)))
    while pending and time.monotonic() - start < timeout_s:
        try:
            rank, payload, error = results.get(timeout=0.2)
        except queue.Empty:
            pending -= {r for r in pending if not procs[r].is_alive() and procs[r].exitcode is not None
                        and results.empty()}
            continue
        value = torch.load(io.BytesIO(payload), weights_only=False) if payload is not None else None
        outcomes[rank] = RankResult(rank, value, error, seconds=time.monotonic() - start)
        pending.discard(rank)
    for rank in pending:
        if procs[rank].is_alive():
            outcomes[rank].error = f"rank {rank} did not finish within {timeout_s:g} s"
    return outcomes


def stop(procs: list) -> None:
    for proc in procs:
        proc.join(timeout=5)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
