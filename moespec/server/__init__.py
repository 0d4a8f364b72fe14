"""OpenAI-compatible HTTP server: FastAPI routes in front of an engine stepped by its own thread.

  protocol.py     request bodies (pydantic) -> SamplingParams
  engine_loop.py  the engine thread: adds/aborts handed over by queue, output deltas fed to
                  per-request asyncio queues
  responses.py    OpenAI response and stream-chunk payloads (choices, logprobs, usage)
  errors.py       OpenAI error JSON for every failure
  metrics.py      Prometheus collectors on the server's own registry
  app.py          the FastAPI app: routes, auth, streaming
  launch.py       `moespec serve`: build the engine, run uvicorn on the leader rank
"""
from moespec.server.app import create_app

__all__ = ["create_app"]
