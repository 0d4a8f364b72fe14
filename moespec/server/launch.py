"""`moespec serve`: build the engine from a config and serve it over HTTP.

Under torchrun or slurm only the leader (rank 0) owns the HTTP server, tokenizer and
scheduler; the other ranks replay its forwards (moespec.distributed.follow) and exit with it.
"""
from __future__ import annotations

import logging

from moespec.config import EngineConfig

logger = logging.getLogger(__name__)


def serve(config: EngineConfig, host: str | None = None, port: int | None = None, api_key: str | None = None,
          log_level: str = "info") -> None:
    import uvicorn

    from moespec.distributed import run_as_rank
    from moespec.engine import Engine
    from moespec.server.app import create_app

    ranks = run_as_rank(config)  # other ranks replay the leader's forwards and exit with it
    engine = Engine(config, ranks=ranks)
    s = config.server
    host, port, api_key = host or s.host, port or s.port, api_key or s.api_key
    app = create_app(engine, config.model.served_model_name, api_key, s.max_waiting_requests)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1, speculation: %s, auth: %s)",
                app.state.server.model_name, host, port, config.speculation.mode, "on" if api_key else "off")
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=5)
    finally:
        engine.close()
