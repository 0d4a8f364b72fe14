"""The first stop of every HTTP request (pure ASGI, in front of FastAPI).

- A body larger than `server.max_request_bytes` gets 413, whether Content-Length says so or
  the body turns out longer while it is read; nothing beyond the limit is kept in memory.
- A body that has not arrived `server.body_read_timeout_s` after the request began gets 408
  (a client that trickles a body in holds no connection for ever).
- While the server drains (SIGTERM), new /v1 requests get 503.
- Every response is counted by route and status (`moespec_http_requests_total`).
"""
from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moespec.server.errors import error_response
from moespec.server.metrics import ROUTES

BODY_METHODS = ("POST", "PUT", "PATCH")


class RequestGate:
    def __init__(self, app: ASGIApp, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self.counting(scope, send)
        limit = self.state.settings.max_request_bytes
        if self.state.loop.draining.is_set() and scope["path"].startswith("/v1/"):
            await error_response(503, "the server is shutting down; send the request to another replica",
                                 code="server_shutting_down")(scope, receive, send)
            return
        if declared_length(scope) > limit:
            await too_large(limit)(scope, receive, send)
            return
        if scope["method"] in BODY_METHODS:
            timeout_s = self.state.settings.body_read_timeout_s
            try:
                body = await asyncio.wait_for(read_body(receive, limit), timeout_s)
            except asyncio.TimeoutError:
                await error_response(408, f"request body: not received within {timeout_s:g} s "
                                          "(server.body_read_timeout_s)", code="request_timeout",
                                     headers={"Connection": "close"})(scope, receive, send)
                return
            if body is None:
                await too_large(limit)(scope, receive, send)
                return
            receive = replay(body, receive)
        await self.app(scope, receive, send)

    def counting(self, scope: Scope, send: Send) -> Send:
        metrics = self.state.metrics
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                metrics.count_http(scope["method"], route, message["status"])
            await send(message)
        return counted


def declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def too_large(limit: int):
    return error_response(413, f"request body: larger than {limit} bytes (server.max_request_bytes)",
                          code="request_too_large")


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client went away; the app sees an empty body and then the disconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then what the client sends next."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed
