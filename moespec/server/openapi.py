"""The OpenAPI schema of this server, true to what it does.

FastAPI documents 422 for every body; this server answers 400 (OpenAI's error JSON), so the
schema lists the statuses each route really returns, with OpenAI's error body, the response
bodies, `/metrics` as Prometheus text, and the bounds of this deployment (n, prompt sizes,
token ids, chat roles, the served model's name) on the request fields. Constraints between
fields that JSON Schema cannot state are in the field descriptions.
"""
from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

import moespec
from moespec.server.protocol import ChatCompletionRequest, CompletionRequest
from moespec.server.tokens import DetokenizeRequest, TokenizeRequest

Finish = Literal["stop", "length", "abort"] | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int | None  # in the vocabulary, 1 = the most likely
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Finish
    stop_reason: int | str | None
    # vLLM's: per prompt token (null for the first) that token and its top alternatives, by token id
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class SpeculationUsage(BaseModel):
    draft_tokens: int
    accepted_tokens: int
    accept_length: float | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculation: SpeculationUsage


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null: only reasoning or tool calls
    reasoning_content: str | None = None  # with server.reasoning_parser
    reasoning: str | None = None  # the same (vLLM's newer name)
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int
    max_model_len: int
    vocab_size: int


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest,  # the routes parse their bodies themselves
                  TokenizeRequest, DetokenizeRequest)
RESPONSE_MODELS = (ErrorResponse, CompletionResponse, ChatCompletionResponse, ModelList, Health, TokenizeResponse,
                   DetokenizeResponse, TokenizerInfo)
ERRORS = {400: "Malformed JSON, a wrong type or value, or a request this deployment could never serve "
               "(`param` names the field)",
          401: "Missing or wrong API key (`Authorization: Bearer KEY`)",
          404: "`model` is not the model this server serves",
          408: "The body did not arrive within `server.body_read_timeout_s`",
          413: "The body is larger than `server.max_request_bytes`",
          429: "More than `server.max_waiting_requests` sequences would be waiting; retry later",
          500: "The engine failed while serving the request",
          503: "The server is shutting down"}
ROUTE_ERRORS = {("post", "/v1/completions"): (400, 401, 404, 408, 413, 429, 500, 503),
                ("post", "/v1/chat/completions"): (400, 401, 404, 408, 413, 429, 500, 503),
                ("get", "/v1/models"): (401, 503),
                ("post", "/tokenize"): (400, 401, 404, 408, 413, 503),
                ("post", "/detokenize"): (400, 401, 404, 408, 413, 503),
                ("get", "/tokenizer_info"): (400, 401, 503)}
OK = {("post", "/v1/completions"): "CompletionResponse", ("post", "/v1/chat/completions"): "ChatCompletionResponse",
      ("get", "/v1/models"): "ModelList", ("get", "/health"): "Health", ("post", "/tokenize"): "TokenizeResponse",
      ("post", "/detokenize"): "DetokenizeResponse", ("get", "/tokenizer_info"): "TokenizerInfo"}
STREAMED = {("post", "/v1/completions"), ("post", "/v1/chat/completions")}
SSE_EVENT = {  # one server-sent event (stream: true); its data is a JSON chunk, the last one "[DONE]"
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "A chunk object as JSON, or [DONE] at the end"},
                   "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
ONE_GRAMMAR = ("At most one of response_format, structured_outputs, the guided_* fields and a forced tool call "
               "constrains a request.")
CROSS_FIELD = {
    "min_tokens": "At most max_tokens (max_completion_tokens for chat); 0 with a structured output.",
    "response_format": "json_schema needs json_schema.schema, a JSON schema that xgrammar compiles within the "
                       "server's grammar bounds (server.max_schema_bytes, max_schema_depth, max_enum_items, "
                       "grammar_compile_timeout_s). " + ONE_GRAMMAR,
    "structured_outputs": "Exactly one of json (a JSON schema), json_object, regex, choice, grammar (EBNF with a "
                          "root rule named root); it must compile with xgrammar. " + ONE_GRAMMAR,
    "guided_json": "A JSON schema that xgrammar compiles (structured_outputs.json). " + ONE_GRAMMAR,
    "guided_regex": "A regex that xgrammar compiles (structured_outputs.regex). " + ONE_GRAMMAR,
    "guided_choice": "Non-empty strings (structured_outputs.choice). " + ONE_GRAMMAR,
    "guided_grammar": "EBNF that xgrammar compiles (structured_outputs.grammar). " + ONE_GRAMMAR,
    "logit_bias": "Keys are token ids in [0, vocab size) written as decimal strings.",
    "top_logprobs": "Needs logprobs: true.",
    "echo": "The prompt comes back before the completion; with logprobs, its tokens' logprobs too (the first "
            "token's null).",
    "tools": "Function names are distinct. With tool_choice auto (the default when tools are given) the server "
             "needs a tool-call parser (server.tool_call_parser).",
    "tool_choice": "Needs tools; a named function must be among them. required or a named function force a call "
                   "by a grammar built from the parameters schemas (it must compile within the grammar bounds). "
                   + ONE_GRAMMAR,
    "prompt": "Text must tokenize to fewer than max_model_len tokens.",
    "messages": "Their contents together must fit the prompt's character bound, and the rendered chat must "
                "tokenize to fewer than max_model_len tokens.",
}


def install_openapi(app: FastAPI, state) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=moespec.__version__, description=app.description,
                                 routes=app.routes)
            app.openapi_schema = describe(schema, state)
        return app.openapi_schema

    app.openapi = openapi


def describe(schema: dict, state) -> dict:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for model in (*REQUEST_MODELS, *RESPONSE_MODELS):
        add_model(components, model)
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            document_responses(operation, method, path)
    schema["paths"]["/metrics"]["get"]["responses"]["200"] = {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}}}
    constrain_requests(components, state)
    if state.api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, methods in schema["paths"].items():
            for method, operation in methods.items():
                if 401 in ROUTE_ERRORS.get((method, path), ()) or path.startswith("/v1/"):
                    operation["security"] = [{"bearer": []}]
    return schema


def add_model(components: dict, model: type[BaseModel]) -> None:
    body = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(body.pop("$defs", {}))
    components[model.__name__] = body


def document_responses(operation: dict, method: str, path: str) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    for status in ROUTE_ERRORS.get((method, path), ()):
        responses[str(status)] = {"description": ERRORS[status],
                                  "content": {"application/json": {"schema": ref("ErrorResponse")}}}
    if path == "/health":
        responses["503"] = {"description": "The engine is stuck or stopped, or the server is shutting down",
                            "content": {"application/json": {"schema": ref("ErrorResponse")}}}
    if path == "/expert_load":
        responses["404"] = {"description": "No expert-parallel MoE layers (parallel.ep_size 1): nothing is recorded",
                            "content": {"application/json": {"schema": ref("ErrorResponse")}}}
    if (method, path) in OK:
        content = {"application/json": {"schema": ref(OK[method, path])}}
        if (method, path) in STREAMED:  # stream: true
            content["text/event-stream"] = {"schema": SSE_EVENT}
        responses["200"] = {"description": "Success", "content": content}


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def constrain_requests(components: dict, state) -> None:
    """The deployment's bounds on the request fields."""
    limits = state.limits
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = components[name]["properties"]
        fields["model"] = {"anyOf": [{"type": "string", "enum": [state.model_name]}, {"type": "null"}],
                           "title": "Model"}
        set_bound(fields["n"], "maximum", limits.max_n)
        for item in each_schema(fields["stop_token_ids"], "integer"):
            item["maximum"] = limits.vocab_size - 1
        for bias in each_schema(fields["logit_bias"], "object"):
            bias["additionalProperties"] = False  # keys other than token ids are refused
        for field, note in CROSS_FIELD.items():
            if field in fields:
                fields[field]["description"] = note
    components["CompletionRequest"]["properties"]["max_tokens"]["description"] = (
        "0 only with echo or prompt_logprobs: the prompt is scored, nothing generated.")
    for name in ("functions", "function_call"):  # OpenAI's deprecated tool fields
        components["ChatCompletionRequest"]["properties"][name] = {
            "type": "null", "description": "Deprecated and not supported: use tools and tool_choice."}
    components["ChatCompletionRequest"]["properties"]["prompt_logprobs"] = {
        "type": "null", "description": "vLLM's prompt_logprobs is not supported on chat: /v1/completions returns "
                                       "them (the chat prompt's tokens come from POST /tokenize)."}
    prompt = components["CompletionRequest"]["properties"]["prompt"]
    for text in each_schema(prompt, "string"):
        text["maxLength"] = limits.max_prompt_chars
    for token in each_schema(prompt, "integer"):
        token["maximum"] = limits.vocab_size - 1
    for array in each_schema(prompt, "array"):
        items = array.get("items", {})
        if items.get("type") == "integer":
            array["maxItems"] = limits.max_model_len - 1
        else:  # a list of prompts
            array["maxItems"] = limits.max_prompts
    constrain_token_requests(components, state)
    message = components["ChatMessage"]["properties"]
    message["role"] = {"type": "string", "enum": list(limits.roles), "title": "Role"}
    for text in each_schema(message["content"], "string"):
        text["maxLength"] = limits.max_prompt_chars


def constrain_token_requests(components: dict, state) -> None:
    limits = state.limits
    model = {"anyOf": [{"type": "string", "enum": [state.model_name]}, {"type": "null"}], "title": "Model"}
    for name in ("TokenizePrompt", "TokenizeChat", "DetokenizeRequest"):
        components[name]["properties"]["model"] = model
    components["TokenizePrompt"]["properties"]["prompt"]["maxLength"] = limits.max_prompt_chars
    components["TokenizeChat"]["properties"]["continue_final_message"]["description"] = (
        "Needs add_generation_prompt false, and a last message the chat template renders as given.")
    tokens = components["DetokenizeRequest"]["properties"]["tokens"]
    tokens["maxItems"] = limits.max_model_len
    tokens["items"]["maximum"] = limits.vocab_size - 1


def set_bound(field: dict, key: str, value: int) -> None:
    for option in each_schema(field, "integer"):
        option[key] = value


def each_schema(node: dict, type_: str):
    """Every (nested) subschema of `type_` inside anyOf/items."""
    if node.get("type") == type_:
        yield node
    for option in node.get("anyOf", []):
        yield from each_schema(option, type_)
    if "items" in node and isinstance(node["items"], dict):
        yield from each_schema(node["items"], type_)
