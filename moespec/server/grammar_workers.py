"""Grammar compiles in processes that can be stopped.

xgrammar has no time limit of its own (0.2.9: only a matcher recursion depth), and a thread
cannot be stopped, so a compile runs in a child process (structured.serve_compiles) that is
killed when it passes `server.grammar_compile_timeout_s` (a 400 naming the request field),
when its request goes away (the client left, or SIGTERM), or at shutdown. At most
`server.max_concurrent_compiles` run at once (more wait their turn), so distinct schemas
cannot take every core; a compiled grammar is sent back serialized and kept in the engine's
grammar cache, where the engine thread finds it. Idle processes are kept for the next compile.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading

from starlette.concurrency import run_in_threadpool

from moespec.structured import GrammarError, Grammars, StructuredOutputs, serve_compiles

logger = logging.getLogger(__name__)


class CompileTimeout(Exception):
    pass


class CompilesStopped(Exception):
    """The server is shutting down: compiles in flight were stopped (503)."""


class CompileProcess:
    def __init__(self, worker_args: tuple) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        self.connection, child = context.Pipe()
        self.process = context.Process(target=serve_compiles, args=(child, *worker_args), daemon=True,
                                       name="moespec-grammar")
        self.process.start()
        child.close()

    def wait_ready(self) -> None:
        """Blocks until the child has imported its engines and built its compiler (seconds; not part of
        any compile's time budget)."""
        if self.connection.recv() != "ready":
            raise RuntimeError("grammar compile process did not start")

    def compile(self, spec: StructuredOutputs) -> tuple:
        """Blocks until the child answers; EOFError when it was killed meanwhile."""
        self.connection.send(spec)
        return self.connection.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.connection.close()


class GrammarWorkers:
    def __init__(self, grammars: Grammars, timeout_s: float, max_concurrent: int) -> None:
        self.grammars, self.timeout_s = grammars, timeout_s
        self.slots = asyncio.Semaphore(max_concurrent)  # used on the server's event loop only
        self.idle: list[CompileProcess] = []
        self.busy: set[CompileProcess] = set()
        self.lock = threading.Lock()
        self.stopped = False

    async def prepare(self, spec: StructuredOutputs) -> None:
        """Compile `spec` into the grammar cache unless it is there (GrammarError, CompileTimeout,
        CompilesStopped; cancelling the caller kills the compile)."""
        if self.grammars.cached(spec) is not None:
            return
        async with self.slots:
            answer = await self.run(spec)
        if answer[0] == "error":
            raise GrammarError(answer[1], answer[2])
        await run_in_threadpool(self.grammars.load, spec, answer[1])

    async def run(self, spec: StructuredOutputs) -> tuple:
        taking = asyncio.ensure_future(run_in_threadpool(self.take))  # a started process: the budget counts
        try:                                                            # the compile only
            worker = await asyncio.shield(taking)
        except asyncio.CancelledError:  # the thread starts it all the same: keep it for the next compile
            taking.add_done_callback(lambda f: f.cancelled() or f.exception() or self.give_back(f.result()))
            raise
        call = asyncio.ensure_future(run_in_threadpool(worker.compile, spec))
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # EOFError once killed: expected
        try:
            answer = await asyncio.wait_for(asyncio.shield(call), self.timeout_s)
        except asyncio.TimeoutError:
            self.discard(worker)
            raise CompileTimeout(f"compiling took longer than {self.timeout_s:g} s "
                                 "(server.grammar_compile_timeout_s)") from None
        except (asyncio.CancelledError, EOFError, OSError) as e:
            self.discard(worker)
            if self.stopped:
                raise CompilesStopped("the server is shutting down; its grammar compile was stopped") from None
            if isinstance(e, asyncio.CancelledError):
                raise
            raise GrammarError(spec.kind, "the grammar compiler's process died on this grammar") from None
        self.give_back(worker)
        return answer

    def take(self) -> CompileProcess:
        """An idle compile process, or a new one (started here, in a worker thread)."""
        worker_args = self.grammars.worker_args()
        with self.lock:
            if self.stopped:
                raise CompilesStopped("the server is shutting down")
            if self.idle:
                worker = self.idle.pop()
                self.busy.add(worker)
                return worker
        worker = CompileProcess(worker_args)
        with self.lock:
            self.busy.add(worker)
        try:
            worker.wait_ready()
        except (EOFError, OSError):  # stopped while it started
            self.discard(worker)
            raise CompilesStopped("the server is shutting down") from None
        return worker

    def give_back(self, worker: CompileProcess) -> None:
        with self.lock:
            self.busy.discard(worker)
            if not self.stopped:
                self.idle.append(worker)
                return
        worker.kill()

    def discard(self, worker: CompileProcess) -> None:
        with self.lock:
            self.busy.discard(worker)
        worker.kill()

    def stop(self) -> None:
        """Kill every compile process, idle or busy: their requests get CompilesStopped."""
        with self.lock:
            self.stopped = True
            workers, self.idle, self.busy = [*self.idle, *self.busy], [], set()
        for worker in workers:
            worker.kill()
        if workers:
            logger.info("stopped %d grammar compile processes", len(workers))
