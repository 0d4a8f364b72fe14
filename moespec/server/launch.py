"""`moespec serve`: build the engine from a config and serve it over HTTP.

Under torchrun or slurm rank 0 owns the HTTP server and places each request on a rank
(moespec.cluster); every rank runs its own engine, and the others exit when rank 0 stops.

SIGTERM (or Ctrl-C) drains: new requests get 503, requests still being prepared (a body
parsed, a grammar compiled) are stopped with a 503, running ones finish or, after
`server.drain_timeout_s`, are aborted, then the server shuts down and the process exits 0.
Whatever still runs then (a thread stuck in native code), the process exits 0 at most
SHUTDOWN_GRACE_S after the drain timeout. A second signal ends it at once.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

import uvicorn

from moespec.config import EngineConfig

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10.0  # after the drain: uvicorn's graceful close (5 s), the engine's, then a hard exit


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain between the first signal and the shutdown."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.loop, self.drain_timeout_s = state, state.loop, drain_timeout_s
        self.drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.drainer is not None:  # a second signal: stop at once
            logger.warning("signal %d during the drain: exiting now", sig)
            exit_now(0)
        logger.info("signal %d: draining (new requests get 503; running ones have %g s to finish)", sig,
                    self.drain_timeout_s)
        self.loop.draining.set()  # before the preparations stop: what they drop cannot reach the engine
        self.state.stop_preparation()
        self.drainer = threading.Thread(target=self.drain, name="moespec-drain", daemon=True)
        self.drainer.start()
        deadline = threading.Timer(self.drain_timeout_s + SHUTDOWN_GRACE_S, self.give_up)
        deadline.daemon = True
        deadline.start()

    def drain(self) -> None:
        aborted = self.loop.drain(self.drain_timeout_s)
        logger.info("drained (%d requests aborted); shutting down", aborted)
        self.should_exit = True

    def give_up(self) -> None:
        logger.warning("shutdown still running %g s after the drain timeout: exiting now", SHUTDOWN_GRACE_S)
        exit_now(0)


def exit_now(code: int) -> None:
    """End the process whatever its threads are doing (one may be stuck in native code), and its
    helper processes with it."""
    from moespec.server.engine_loop import kill_children
    kill_children()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(config: EngineConfig, host: str | None = None, port: int | None = None, api_key: str | None = None,
          log_level: str = "info") -> None:
    from moespec.startup import start_engine
    from moespec.server.app import create_app

    # model.compile: every rank compiles every bucket's static steps before the first request;
    # other ranks then serve their share of the requests and exit with rank 0
    engine = start_engine(config, warm_up=True)
    s = config.server
    host, port, api_key = host or s.host, port or s.port, api_key or s.api_key
    app = create_app(engine, config.model.served_model_name, api_key, s)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1, speculation: %s, auth: %s)",
                app.state.server.model_name, host, port, config.speculation.mode, "on" if api_key else "off")
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                           timeout_graceful_shutdown=5), app.state.server, s.drain_timeout_s)
    try:
        server.run()
    finally:
        engine.close()
