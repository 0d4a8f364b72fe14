"""The engine thread: the only thread that touches the engine.

HTTP handlers hand work over as closures on a thread-safe queue (add a request group of
tokenized prompts, abort request ids). The thread runs them between steps, steps the engine
while it has work, and sends each sequence's new output to its request's asyncio queue with
`loop.call_soon_threadsafe`, so every request streams on its own.

A watchdog thread fails the server when one step runs longer than `server.step_timeout_s`
(a stuck collective, a hung kernel): /health turns 503 and the process exits non-zero,
naming the phase the step was in, which ends its peer ranks too. `drain` (SIGTERM) stops
new requests, lets the running ones finish for up to `server.drain_timeout_s` and aborts
the rest.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from moespec.config import ServerSection
from moespec.engine import Engine
from moespec.llm import child_params
from moespec.sampling import SamplingParams
from moespec.sequence import Sequence, TokenLogprob
from moespec.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # how often an idle engine thread looks at its stop flag
STALL_EXIT_CODE = 70  # EX_SOFTWARE: the engine stopped making progress


class Overloaded(Exception):
    """Too many requests are waiting right now; the same request may succeed later (429)."""


class Draining(Exception):
    """The server is shutting down (503)."""


class EngineFailed(Exception):
    pass


def exit_process(message: str) -> None:
    """What a stalled engine does by default: say why on stderr and end the process at once
    (a stuck step cannot be interrupted; peers see the lost connection, or their launcher
    ends them)."""
    print(f"moespec: fatal: {message}; exiting", file=sys.stderr, flush=True)
    kill_children()
    os._exit(STALL_EXIT_CODE)


def kill_children() -> None:
    """Before an exit that skips cleanup (os._exit): kill this process's helper processes (body
    parsing, grammar compiles), which would otherwise live on orphaned."""
    for child in multiprocessing.active_children():
        child.kill()


@dataclass(frozen=True)
class SeqUsage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    spec_steps: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class Delta:
    """New output of one choice since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: SeqUsage | None = None  # set on the last delta
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, when the prompt has been scored


@dataclass
class Stream:
    """Engine-thread bookkeeping of how much of a sequence has been sent."""

    index: int
    send: Callable[[Delta | BaseException], None]
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_prompt: bool = False  # the prompt logprobs


@dataclass
class RequestHandle:
    """HTTP-side view of one request: its sequences' ids and the queue their deltas arrive on."""

    request_ids: list[str]
    prompt_tokens: list[int] = field(default_factory=list)  # per choice, filled in by the engine thread
    prompt_ids: list[list[int]] = field(default_factory=list)  # per prompt
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def deltas(self) -> AsyncIterator[Delta]:
        remaining = len(self.request_ids)
        while remaining:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finish_reason is not None
            yield item


class EngineLoop:
    def __init__(self, engine: Engine, settings: ServerSection, metrics: ServerMetrics,
                 on_stall: Callable[[str], None] = exit_process) -> None:
        self.engine = engine
        self.max_waiting_requests = settings.max_waiting_requests
        self.step_timeout_s = settings.step_timeout_s
        self.metrics = metrics
        self.on_stall = on_stall
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.streams: dict[str, Stream] = {}  # engine thread only
        self.stopping = threading.Event()
        self.draining = threading.Event()
        self.step_started: float | None = None  # monotonic start of the running step (engine thread writes)
        self.stalled: str | None = None
        self.thread = threading.Thread(target=self.run, name="moespec-engine", daemon=True)
        self.watchdog = threading.Thread(target=self.watch, name="moespec-watchdog", daemon=True)
        metrics.observe_engine(engine)  # /metrics shows the free pages before the first request

    # ------------------------------------------------------------------ HTTP side

    def start(self) -> None:
        self.thread.start()
        self.watchdog.start()

    def stop(self) -> None:
        self.stopping.set()
        self.commands.put(lambda: None)
        self.thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def unhealthy(self) -> str | None:
        """Why /health should fail, or None."""
        if self.stalled:
            return self.stalled
        if not self.is_alive():
            return "the engine loop is not running"
        if self.draining.is_set():
            return "the server is shutting down"
        return None

    async def add(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> RequestHandle:
        """Adds n sequences per prompt (choice index = prompt * n + i); raises ValueError, Overloaded
        or Draining."""
        if self.draining.is_set():
            raise Draining("the server is shutting down; send the request to another replica")
        loop = asyncio.get_running_loop()
        ids = [f"{request_id}-{p}-{i}" for p in range(len(prompts)) for i in range(params.n)]
        handle = RequestHandle(ids, prompt_ids=prompts)
        done: asyncio.Future = loop.create_future()

        def add_on_engine_thread() -> None:
            try:
                self.add_group(handle, prompts, params, loop)
            except Exception as e:  # handed back to the HTTP handler, which maps it to a status
                loop.call_soon_threadsafe(resolve, done, e)
            else:
                loop.call_soon_threadsafe(resolve, done, None)

        self.commands.put(add_on_engine_thread)
        try:
            error = await done
        except asyncio.CancelledError:
            self.abort(ids)
            raise
        if error is not None:
            raise error
        return handle

    def abort(self, request_ids: list[str]) -> None:
        self.commands.put(lambda: self.abort_group(request_ids))

    def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to timeout_s for the running ones, abort the rest; returns
        how many were aborted. Called off the engine thread."""
        self.draining.set()
        deadline = time.monotonic() + timeout_s
        while (self.streams or not self.commands.empty()) and time.monotonic() < deadline and self.is_alive():
            time.sleep(0.05)
        if not self.streams or not self.is_alive():
            return 0
        aborted: list[int] = []
        done = threading.Event()

        def abort_all() -> None:  # on the engine thread, which owns the streams
            aborted.append(len(self.streams))
            logger.warning("drain timeout (%g s): aborting %d running requests", timeout_s, aborted[0])
            self.abort_group(list(self.streams))
            done.set()

        self.commands.put(abort_all)
        done.wait(timeout=10)
        return aborted[0] if aborted else 0

    # ------------------------------------------------------------------ watchdog

    def watch(self) -> None:
        poll = min(1.0, self.step_timeout_s / 10)
        while not self.stopping.wait(poll):
            started = self.step_started
            if started is not None and time.monotonic() - started > self.step_timeout_s:
                self.stall(f"engine step stuck in phase {self.engine.phase!r} for {time.monotonic() - started:.0f} s "
                           f"(server.step_timeout_s = {self.step_timeout_s:g})")
                return

    def stall(self, message: str) -> None:
        self.stalled = message
        logger.critical(message)
        self.on_stall(message)

    # ------------------------------------------------------------------ engine thread

    def run(self) -> None:
        logger.info("engine loop started")
        while not self.stopping.is_set():
            self.run_commands(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self.step()
            else:
                self.keep_alive()
        self.abort_group(list(self.streams))
        logger.info("engine loop stopped")

    def run_commands(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            run_safely(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
        self.metrics.observe_engine(self.engine)  # adds and aborts change the queues and pages

    def add_group(self, handle: RequestHandle, prompts: list[list[int]], params: SamplingParams,
                  loop: asyncio.AbstractEventLoop) -> None:
        waiting = self.engine.num_waiting()
        if waiting + len(handle.request_ids) > self.max_waiting_requests:
            raise Overloaded(f"{waiting} sequences are waiting and this request adds {len(handle.request_ids)} "
                             f"(server.max_waiting_requests = {self.max_waiting_requests}); retry later")
        added: list[str] = []
        try:
            for index, request_id in enumerate(handle.request_ids):
                prompt = prompts[index // params.n]
                seq = self.engine.add_request(prompt, child_params(params, index % params.n), request_id)
                added.append(request_id)
                handle.prompt_tokens.append(len(seq.prompt_ids))
                self.streams[request_id] = Stream(index, sender(loop, handle.queue))
        except Exception:
            self.abort_group(added)  # all of a request's choices are added, or none
            raise

    def abort_group(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            stream = self.streams.pop(request_id, None)
            if stream is None:  # finished already
                continue
            self.engine.abort(request_id)
            self.metrics.count_finished("abort")
            stream.send(Delta(stream.index, "", [], [], finish_reason="abort"))  # ends the handler's wait

    def step(self) -> None:
        outputs = self.watched(self.engine.step)
        if outputs is None:
            return
        for seq in outputs.updated:
            self.publish(seq)
        self.metrics.observe_engine(self.engine)

    def keep_alive(self) -> None:
        """An idle rank 0's empty step now and then, watched like a step (it is a collective)."""
        self.watched(self.engine.keep_alive)

    def watched(self, action: Callable[[], object]):
        """Run engine work under the watchdog's clock; a failure fails every request (None)."""
        self.step_started = time.monotonic()
        try:
            return action()
        except Exception as e:
            logger.exception("engine work failed; aborting %d requests", len(self.streams))
            if self.engine.lockstep is not None:  # the ranks are out of step: no later step can pair up
                self.stall(f"engine step failed across ranks: {type(e).__name__}: {e}")
            self.fail_all(EngineFailed(f"the engine failed: {type(e).__name__}: {e}"))
            return None
        finally:
            self.step_started = None

    def publish(self, seq: Sequence) -> None:
        stream = self.streams.get(seq.request_id)
        if stream is None:
            return
        delta = take_delta(stream, seq)
        self.metrics.count_tokens(len(delta.token_ids))
        if seq.is_finished:
            del self.streams[seq.request_id]
            self.metrics.observe_finished(seq)
        if delta.text or delta.token_ids or delta.prompt_logprobs is not None or seq.is_finished:
            stream.send(delta)

    def fail_all(self, error: Exception) -> None:
        streams, self.streams = self.streams, {}
        for request_id, stream in streams.items():
            self.engine.abort(request_id)
            stream.send(error)


def run_safely(command: Callable[[], None]) -> None:
    try:
        command()
    except Exception:  # one bad hand-over must not stop the loop every request depends on
        logger.exception("engine loop command failed")


def take_delta(stream: Stream, seq: Sequence) -> Delta:
    end = max(stream.sent_chars, seq.streamable_chars)
    delta = Delta(stream.index, seq.text[stream.sent_chars:end], seq.output_ids[stream.sent_tokens:],
                  seq.logprobs[stream.sent_logprobs:])
    stream.sent_chars, stream.sent_tokens, stream.sent_logprobs = end, len(seq.output_ids), len(seq.logprobs)
    if not stream.sent_prompt and prompt_scored(seq):
        delta.prompt_logprobs, stream.sent_prompt = list(seq.prompt_logprobs), True
    if seq.is_finished:
        m = seq.metrics
        delta = dataclasses.replace(delta, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                    usage=SeqUsage(len(seq.prompt_ids), len(seq.output_ids), m.num_draft_tokens,
                                                   m.num_accepted_tokens, m.num_spec_steps,
                                                   m.num_cached_tokens or 0))
    return delta


def prompt_scored(seq: Sequence) -> bool:
    """Its prompt logprobs are all in (on rank 0 a request of another rank gets them at once)."""
    scored = seq.prompt_logprobs
    return scored is not None and (seq.is_finished or all(entry is not None for entry in scored[1:]))


def sender(loop: asyncio.AbstractEventLoop, target: asyncio.Queue) -> Callable[[Delta | BaseException], None]:
    def send(item: Delta | BaseException) -> None:
        try:
            loop.call_soon_threadsafe(target.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass
    return send


def resolve(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():
        future.set_result(error)
