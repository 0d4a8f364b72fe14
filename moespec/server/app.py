"""The FastAPI app: OpenAI routes, auth, streaming, health and metrics.

What a request costs is bounded before it costs it: the gate (gate.py) refuses bodies over
`server.max_request_bytes` (413), bodies that arrive too slowly (408) and new requests while
draining (503); `RequestLimits` refuses what could never fit (400); 429 means only "retry
later". Nothing slow runs on the event loop, so /health and other requests keep their pace
while one is prepared: large bodies are parsed in a separate process (bodies.py), grammars
compiled in killable processes (grammar_workers.py), prompts tokenized and chat templates
rendered in worker threads, never on the engine thread. A client that leaves while its
request is prepared stops that preparation; so does SIGTERM, with a 503.
"""
from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

import moespec
from moespec.config import ServerSection
from moespec.engine import Engine
from moespec.sampling import SamplingParams
from moespec.server.bodies import BodyParser
from moespec.server.chat import ChatOutput, chat_choice, chat_params, render_chat, tool_mode
from moespec.server.engine_loop import (Delta, Draining, EngineFailed, EngineLoop, Overloaded, RequestHandle,
                                        exit_process)
from moespec.server.errors import ApiError, bad_request, error_body, install_error_handlers
from moespec.server.gate import RequestGate
from moespec.server.grammar_workers import CompilesStopped, CompileTimeout, GrammarWorkers
from moespec.server.limits import RequestLimits
from moespec.server.metrics import ServerMetrics
from moespec.server.openapi import install_openapi
from moespec.server.protocol import ChatCompletionRequest, CompletionRequest, Prompt, RequestGrammar, SamplingRequest
from moespec.server.responses import (SSE_DONE, Choice, CompletionShape, TokenNames, UsageTotals, chat_logprobs,
                                      completion_choice, completion_payload, sse)
from moespec.server import tokens as token_endpoints
from moespec.server.tokens import DetokenizeRequest, TokenizeRequest, require_tokenizer
from moespec.structured import GrammarError

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerState:
    engine: Engine
    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    names: TokenNames
    limits: RequestLimits
    settings: ServerSection
    bodies: BodyParser
    compiles: GrammarWorkers

    def start(self) -> None:
        self.bodies.start()
        self.loop.start()

    def stop_preparation(self) -> None:
        """SIGTERM: stop parsing bodies and compiling grammars; their requests get 503."""
        self.compiles.stop()
        self.bodies.stop()

    async def parse(self, model: type[SamplingRequest], request: Request) -> SamplingRequest:
        try:
            return await self.bodies.parse(model, await request.body(), self.limits)
        except BrokenProcessPool:  # stopped by SIGTERM
            raise ApiError(503, "the server is shutting down; send the request to another replica",
                           code="server_shutting_down") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    async def submit(self, request_id: str, prompts: list[Prompt], params: SamplingParams,
                     grammar: RequestGrammar | None = None) -> RequestHandle:
        """Compile the grammar (in a compile process) and tokenize (in a worker thread), then hand
        the token ids to the engine thread, which finds the grammar in its cache."""
        try:
            if grammar is not None:
                await self.compile(grammar)
            ids = await run_in_threadpool(self.tokenize, prompts)
            return await self.loop.add(request_id, ids, params)
        except Overloaded as e:
            raise ApiError(429, str(e), code="too_many_waiting_requests") from None
        except (Draining, CompilesStopped) as e:
            raise ApiError(503, str(e), code="server_shutting_down") from None
        except ValueError as e:
            raise bad_request(e) from None

    async def compile(self, grammar: RequestGrammar) -> None:
        try:
            await self.compiles.prepare(grammar.spec)
        except GrammarError as e:
            raise ApiError(400, f"{grammar.param}: {e.reason}", grammar.param) from None
        except CompileTimeout as e:
            raise ApiError(400, f"{grammar.param}: {e}", grammar.param, "grammar_compile_timeout") from None

    def tokenize(self, prompts: list[Prompt]) -> list[list[int]]:
        """Token ids of every prompt; the text ones are checked here, the others were already."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = encode_texts(self.engine.tokenizer, texts)
        for ids in encoded:
            if not ids:
                raise ValueError("prompt: must contain at least one token")
            self.limits.check_ids(ids)
        encoded_iter = iter(encoded)
        return [next(encoded_iter) if isinstance(p, str) else list(p) for p in prompts]


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, as Engine.encode gives them; a fast tokenizer's batch call lets
    other threads run meanwhile (it releases the GIL)."""
    if not texts:
        return []
    if tokenizer is None:
        raise ValueError("prompt: this model has no tokenizer; pass token ids instead of text")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        if backend is None:
            return [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    except Exception as e:  # tokenizers' TypeError on text that is not valid Unicode, and its kin
        raise ValueError(f"prompt: the tokenizer cannot take this text ({type(e).__name__}: {e})") from None


def create_app(engine: Engine, model_name: str | None = None, api_key: str | None = None,
               settings: ServerSection | None = None, on_stall: Callable[[str], None] = exit_process) -> FastAPI:
    """The OpenAI app for `engine`; `settings` default to the engine config's server section."""
    settings = settings or engine.config.server
    metrics = ServerMetrics()
    limits = RequestLimits.build(settings, engine.max_model_len, engine.vocab_size, engine.tokenizer)
    compiles = GrammarWorkers(engine.grammars, settings.grammar_compile_timeout_s, settings.max_concurrent_compiles)
    state = ServerState(engine, EngineLoop(engine, settings, metrics, on_stall), metrics,
                        model_name or default_model_name(engine), api_key, TokenNames(engine.tokenizer), limits,
                        settings, BodyParser(), compiles)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        state.stop_preparation()
        state.loop.stop()

    app = FastAPI(title="moespec", version=moespec.__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions with speculative decoding")
    app.state.server = state
    install_error_handlers(app)
    app.include_router(public)
    app.include_router(v1, dependencies=[Depends(check_api_key)])
    app.include_router(tokens, dependencies=[Depends(check_api_key)])
    app.add_middleware(RequestGate, state=state)
    install_openapi(app, state)
    return app


def default_model_name(engine: Engine) -> str:
    model = engine.config.model
    return model.served_model_name or model.path.rstrip("/").rsplit("/", 1)[-1] or "moespec"


def server_of(request: Request) -> ServerState:
    return request.app.state.server


async def check_api_key(request: Request) -> None:
    expected = server_of(request).api_key
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


public = APIRouter()
v1 = APIRouter(prefix="/v1")
tokens = APIRouter()  # vLLM's token endpoints (tokens.py), at the root as vLLM serves them


@public.get("/health")
async def health(request: Request) -> JSONResponse:
    problem = server_of(request).loop.unhealthy()
    if problem is not None:
        return JSONResponse(error_body(503, problem, code="unhealthy"), status_code=503)
    return JSONResponse({"status": "ok"})


@public.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@public.get("/expert_load")
async def expert_load(request: Request) -> JSONResponse:
    """Routed rows per MoE layer and expert over the last load window, summed over the ranks, with
    rows per rank, balancedness and imbalance (parallel/eplb.py); a file of it seeds
    parallel.eplb.init. 404 without expert parallelism."""
    lockstep = server_of(request).engine.lockstep
    load = lockstep.expert_load() if lockstep is not None else None
    if load is None:
        return JSONResponse(error_body(404, "no expert-parallel MoE layers: the load recorder runs with "
                                       "parallel.ep_size > 1", code="not_found"), status_code=404)
    return JSONResponse(load)


@v1.get("/models")
async def list_models(request: Request) -> dict:
    server = server_of(request)
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                        "owned_by": "moespec", "max_model_len": server.engine.max_model_len}]}


def request_body(model: str) -> dict:
    """The route's documented body (parsed by the route itself, off the event loop when large)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model}"}}}}}


@v1.post("/completions", openapi_extra=request_body("CompletionRequest"))
async def create_completion(request: Request) -> Response:
    server = server_of(request)
    body = await server.parse(CompletionRequest, request)
    server.check_model(body.model)
    prompts = body.prompts()
    grammar = body.grammar()
    params = body.sampling_params(body.max_tokens, body.logprobs, server.engine.vocab_size, grammar,
                                  body.num_prompt_logprobs())
    request_id = f"cmpl-{uuid.uuid4().hex}"
    handle = await until_disconnected(request, server.submit(request_id, prompts, params, grammar))
    shape = await run_in_threadpool(completion_shape, server, body, prompts, handle)
    header = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": server.model_name}
    if body.stream:
        chunks = stream_completion(server, handle, header, shape, body.include_usage, params.n)
        return AbortOnCloseResponse(chunks, lambda: server.loop.abort(handle.request_ids))
    choices, usage = await gather(server, handle, request, params.n)
    return JSONResponse({**header, "choices": [completion_choice(c, server.names, shape) for c in choices],
                         "usage": usage.as_dict()})


def completion_shape(server: ServerState, body: CompletionRequest, prompts: list[Prompt],
                     handle: RequestHandle) -> CompletionShape:
    """An echo gives back each prompt's text: as sent, or its token ids decoded."""
    texts = ()
    if body.echo:
        tokenizer = server.engine.tokenizer
        texts = tuple(p if isinstance(p, str) else tokenizer.decode(ids) if tokenizer is not None else ""
                      for p, ids in zip(prompts, handle.prompt_ids))
    return CompletionShape(body.logprobs, body.echo, body.prompt_logprobs is not None, texts,
                           tuple(map(tuple, handle.prompt_ids)), body.n or 1)


@v1.post("/chat/completions", openapi_extra=request_body("ChatCompletionRequest"))
async def create_chat_completion(request: Request) -> Response:
    server = server_of(request)
    body = await server.parse(ChatCompletionRequest, request)
    server.check_model(body.model)
    settings = server.settings
    mode = tool_mode(body, settings.tool_call_parser)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    grammar = body.grammar()
    params = chat_params(body.sampling_params(max_tokens, body.num_logprobs(), server.engine.vocab_size, grammar),
                         settings, mode)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    prompt = await run_in_threadpool(render_chat, server.engine.tokenizer, body, mode)
    handle = await until_disconnected(request, server.submit(request_id, [prompt], params, grammar))
    header = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": server.model_name}
    outputs = partial(ChatOutput, settings.reasoning_parser, mode, settings.tool_call_parser, body.forced_function())
    if body.stream:
        header["object"] = "chat.completion.chunk"
        chunks = stream_chat(server, handle, header, body.logprobs, body.include_usage, params.n, outputs)
        return AbortOnCloseResponse(chunks, lambda: server.loop.abort(handle.request_ids))
    choices, usage = await gather(server, handle, request, params.n)
    return JSONResponse({**header, "choices": [chat_choice(c, server.names, body.logprobs, outputs()) for c in choices],
                         "usage": usage.as_dict()})


@tokens.post("/tokenize", openapi_extra=request_body("TokenizeRequest"))
async def tokenize(request: Request) -> JSONResponse:
    server = server_of(request)
    body = await server.parse(TokenizeRequest, request)
    server.check_model(body.model)
    require_tokenizer(server.engine.tokenizer)
    answer = await run_in_threadpool(token_endpoints.tokenize, server.engine.tokenizer, body,
                                     server.engine.max_model_len)
    return JSONResponse(answer)


@tokens.post("/detokenize", openapi_extra=request_body("DetokenizeRequest"))
async def detokenize(request: Request) -> JSONResponse:
    server = server_of(request)
    body = await server.parse(DetokenizeRequest, request)
    server.check_model(body.model)
    require_tokenizer(server.engine.tokenizer)
    return JSONResponse(await run_in_threadpool(token_endpoints.detokenize, server.engine.tokenizer, body))


@tokens.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    engine = server_of(request).engine
    require_tokenizer(engine.tokenizer)
    return JSONResponse(token_endpoints.tokenizer_info(engine.tokenizer, engine.max_model_len, engine.vocab_size))


async def until_disconnected(request: Request, preparation: Awaitable[RequestHandle]) -> RequestHandle:
    """The request's preparation, cancelled (a compile killed) if the client goes away meanwhile."""
    task = asyncio.ensure_future(preparation)
    while not task.done():
        await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise ApiError(400, "the client went away while the request was prepared", code="client_disconnected")
    return task.result()


# ---------------------------------------------------------------------- non-streaming


async def gather(server: ServerState, handle: RequestHandle, request: Request, n: int
                 ) -> tuple[list[Choice], UsageTotals]:
    choices = [Choice(i) for i in range(len(handle.request_ids))]
    usage = UsageTotals.for_request(handle, n)
    watcher = asyncio.create_task(abort_on_disconnect(server, handle, request))
    try:
        async for delta in handle.deltas():
            choices[delta.index].add(delta)
            usage.add(delta)
    except EngineFailed as e:
        raise ApiError(500, str(e)) from None
    finally:
        watcher.cancel()
    return choices, usage


async def abort_on_disconnect(server: ServerState, handle: RequestHandle, request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    server.loop.abort(handle.request_ids)


# ---------------------------------------------------------------------- streaming


class AbortOnCloseResponse(StreamingResponse):
    """Aborts the request however the stream ends: finished, failed, or the client went away
    (before the first chunk too, when the body generator never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()  # a no-op on the engine thread once every choice has finished


async def stream_completion(server: ServerState, handle: RequestHandle, header: dict, shape: CompletionShape,
                            include_usage: bool, n: int) -> AsyncIterator[str]:
    offsets: dict[int, int] = {}  # per choice: the characters sent (its first delta opens it: the echo)

    def choice(delta: Delta) -> list[dict]:
        opening = delta.index not in offsets
        offset = offsets.setdefault(delta.index, 0)
        payload = completion_payload(delta.index, delta.text, delta.logprobs, delta.prompt_logprobs, server.names,
                                     shape, offset, opening)
        offsets[delta.index] += len(payload["text"])
        return [payload | {"finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}]

    async for event in stream_choices(handle, header, include_usage, n, choice, first=[]):
        yield event


async def stream_chat(server: ServerState, handle: RequestHandle, header: dict, want_logprobs: bool,
                      include_usage: bool, n: int, outputs: Callable[[], ChatOutput]) -> AsyncIterator[str]:
    """One chunk per chat delta (reasoning, content, a tool call); a delta's logprobs and finish
    reason go on its last chunk."""
    per_choice = [outputs() for _ in handle.request_ids]

    def choices(delta: Delta) -> list[dict]:
        output = per_choice[delta.index]
        parts = output.feed(delta.text) + (output.finish() if delta.finish_reason is not None else [])
        logprobs = chat_logprobs(delta.logprobs, server.names) if want_logprobs else None
        chunks = [{"index": delta.index, "delta": part, "logprobs": None, "finish_reason": None} for part in parts]
        if not chunks or logprobs or delta.finish_reason is not None:
            chunks = chunks or [{"index": delta.index, "delta": {"content": ""}, "logprobs": None}]
            chunks[-1].update(logprobs=logprobs, finish_reason=output.finish_reason(delta.finish_reason),
                              stop_reason=delta.stop_reason)
        return chunks

    roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(len(handle.request_ids))]
    async for event in stream_choices(handle, header, include_usage, n, choices, first=roles):
        yield event


async def stream_choices(handle: RequestHandle, header: dict, include_usage: bool, n: int,
                         choice: Callable[[Delta], list[dict]], first: list[dict]) -> AsyncIterator[str]:
    """SSE events of one request: `first` choices, the events of each delta, usage if asked, [DONE]."""
    usage = UsageTotals.for_request(handle, n)
    for opening in first:
        yield sse({**header, "choices": [opening]})
    try:
        async for delta in handle.deltas():
            usage.add(delta)
            for chunk in choice(delta):
                yield sse({**header, "choices": [chunk]})
    except EngineFailed as e:
        yield sse(error_body(500, str(e)))
    if include_usage:
        yield sse({**header, "choices": [], "usage": usage.as_dict()})
    yield SSE_DONE
