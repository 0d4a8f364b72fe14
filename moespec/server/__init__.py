"""OpenAI-compatible HTTP server: FastAPI routes in front of an engine stepped by its own thread.

  gate.py         first stop of every request: body size (413), draining (503), HTTP counters
  protocol.py     request bodies (pydantic) -> SamplingParams
  bodies.py       JSON parsing and validation of bodies, large ones in a separate process
  grammar_workers.py  grammar compiles in killable processes: time budget, cap, cancellation
  tokens.py       vLLM's token endpoints: /tokenize, /detokenize, /tokenizer_info
  limits.py       the deployment's bounds on a request (n, prompts, prompt length, chat roles)
  engine_loop.py  the engine thread: adds/aborts handed over by queue, output deltas fed to
                  per-request asyncio queues; the step watchdog and the drain
  responses.py    OpenAI response and stream-chunk payloads (choices, logprobs, usage)
  errors.py       OpenAI error JSON for every failure
  metrics.py      Prometheus collectors on the server's own registry
  openapi.py      the OpenAPI schema as the server behaves (statuses, bodies, bounds)
  app.py          the FastAPI app: routes, auth, streaming
  launch.py       `moespec serve`: build the engine, run uvicorn on the leader rank, drain on SIGTERM
"""
__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":  # lazily: a body-parsing or grammar process imports only what it needs
        from moespec.server.app import create_app

        return create_app
    raise AttributeError(name)
