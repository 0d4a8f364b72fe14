"""`moespec serve`: build the engine from a config and serve it over HTTP.

Under torchrun or slurm only the leader (rank 0) owns the HTTP server, tokenizer and
scheduler; the other ranks run `follow`, which is where they take each step's broadcast batch
and run the model (the multi-rank engine lives in parallel/).
"""
from __future__ import annotations

import logging

from moespec.config import EngineConfig

logger = logging.getLogger(__name__)


def launch_rank() -> int:
    from moespec.parallel.groups import read_launch_env

    launch = read_launch_env()
    return 0 if launch is None else launch.rank


def serve(config: EngineConfig, host: str | None = None, port: int | None = None, api_key: str | None = None,
          log_level: str = "info") -> None:
    rank = launch_rank()
    if rank != 0:
        follow(config, rank)
        return
    import uvicorn

    from moespec.engine import Engine
    from moespec.server.app import create_app

    s = config.server
    host, port, api_key = host or s.host, port or s.port, api_key or s.api_key
    app = create_app(Engine(config), config.model.served_model_name, api_key, s.max_waiting_requests)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1, speculation: %s, auth: %s)",
                app.state.server.model_name, host, port, config.speculation.mode, "on" if api_key else "off")
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=5)


def follow(config: EngineConfig, rank: int) -> None:
    """A non-leader rank: runs the model on the batches the leader broadcasts; serves no HTTP."""
    raise NotImplementedError(f"rank {rank}: serving across ranks needs the follower loop of the multi-rank "
                              f"engine (parallel/); run `moespec serve` as one process for now")
