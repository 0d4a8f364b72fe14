"""Request bodies of the OpenAI API (pydantic), and their translation to SamplingParams.

Sampling fields are nullable: OpenAI clients send `null` for "use the default". The field
constraints here are the ones that hold for every deployment; those that depend on the
model and config (n, prompt sizes, token ids, chat roles) are checked by `RequestLimits`
in limits.py, and both appear in the OpenAPI schema (openapi.py).
"""
from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from moespec.sampling import MAX_LOGPROBS, SamplingParams
from moespec.server.errors import ApiError, bad_request
from moespec.server.tool_calls import forced_call_schema
from moespec.structured import GrammarError, StructuredOutputs

Prompt = str | list[int]
MAX_STOP_STRINGS = 16  # each one is searched for after every token
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
FIELD_RULES = {  # the rule a field's validation error is completed with
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings, each of 1 to {MAX_STOP_CHARS} characters",
    "stop_token_ids": f"at most {MAX_STOP_TOKEN_IDS} token ids",
    "logit_bias": f"at most {MAX_LOGIT_BIAS} entries, token ids as decimal strings to biases in [-100, 100]",
}

STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # unknown fields are ignored; "1" is no number


def whole_number(value):
    """JSON Schema's integer: 3.0 is one, as it is to OpenAI's clients."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds) -> type:
    """An integer field (3.0 accepted as 3) with JSON Schema bounds (ge=..., le=...)."""
    return Annotated[int, Field(**bounds), BeforeValidator(whole_number)]  # bounds first: they reach the schema


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Int(ge=0)
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,18}$")]  # a token id as a decimal string
Bias = Annotated[float, Field(ge=-100, le=100)]


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    """OpenAI's: plain text, any JSON object, or JSON following a schema."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    model_config = STRICT

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def constraint(self) -> dict:
        given = {"json": self.json_, "json_object": self.json_object, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar}
        return {name: value for name, value in given.items() if value is not None and value is not False}


class RequestGrammar(NamedTuple):
    spec: StructuredOutputs
    param: str  # the request field it came from, named by errors


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model_config = STRICT

    model: str | None = None
    n: Int(ge=1) | None = 1
    max_tokens: Int(ge=1) | None = None
    min_tokens: Int(ge=0) | None = 0
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Int(ge=-1) | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: Int() | None = None  # any integer (reduced mod 2^64)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: Annotated[dict[TokenKey, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None  # share cached pages only
    # with requests of the same salt (tenants that must not learn each other's prompts from timing)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None  # vLLM's older names for structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def grammar(self) -> RequestGrammar | None:
        """The one structured-output constraint the request gives, if any (a 400 naming the field
        when it does not parse, or when several fields give one)."""
        given = [(param, constraint) for param, constraint in self.constraints() if constraint]
        if not given:
            return None
        if len(given) > 1:
            names = " and ".join(param for param, _ in given)
            raise ApiError(400, f"{given[1][0]}: {names} both constrain the output; give one", given[1][0])
        param, constraint = given[0]
        try:
            return RequestGrammar(StructuredOutputs.unparsed(**constraint), param)  # xgrammar parses it later
        except GrammarError as e:
            raise ApiError(400, f"{param}: {e.reason}", param) from None

    def constraints(self) -> list[tuple[str, dict]]:
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        return [("response_format", response_format_constraint(self.response_format)),
                ("structured_outputs", self.structured_outputs.constraint() if self.structured_outputs else {}),
                *((f"guided_{kind}", {kind: value}) for kind, value in guided.items() if value is not None)]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                        grammar: RequestGrammar | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        """max_tokens None: until EOS, a stop or max_model_len (OpenAI's null)."""
        bias = parse_logit_bias(self.logit_bias, vocab_size)
        check_vocab("stop_token_ids", self.stop_token_ids or [], vocab_size)
        options = dict(n=self.n, min_tokens=self.min_tokens, temperature=self.temperature,
                       top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
                       stop_token_ids=self.stop_token_ids, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                       logit_bias=bias, ignore_eos=self.ignore_eos, logprobs=logprobs,
                       skip_special_tokens=self.skip_special_tokens,
                       include_stop_str_in_output=self.include_stop_str_in_output, cache_salt=self.cache_salt,
                       structured=grammar.spec if grammar else None, prompt_logprobs=prompt_logprobs)
        try:
            return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in options.items() if v is not None})
        except ValueError as e:
            raise bad_request(e) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def response_format_constraint(response_format: ResponseFormat | None) -> dict:
    if response_format is None or response_format.type == "text":
        return {}
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise ApiError(400, "response_format: type json_schema needs json_schema.schema", "response_format")
    return {"json": response_format.json_schema.schema_}


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    parsed = {int(token): value for token, value in bias.items()}  # keys matched TokenKey
    check_vocab("logit_bias", parsed, vocab_size)
    return parsed


def check_vocab(name: str, token_ids, vocab_size: int) -> None:
    outside = [t for t in token_ids if not 0 <= t < vocab_size]
    if outside:
        raise ApiError(400, f"{name}: token ids must be in [0, {vocab_size}), got {outside[:3]}", name)


PromptText = Annotated[str, Field(min_length=1)]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1)] | PromptIds \
        | Annotated[list[PromptIds], Field(min_length=1)]
    max_tokens: Int(ge=0) | None = 16  # OpenAI's legacy default; 0 only with echo or prompt_logprobs
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, if asked)
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None  # vLLM's: each prompt token's, and the top n

    def num_prompt_logprobs(self) -> int | None:
        """The top alternatives the engine scores each prompt token with (None: it scores none):
        those prompt_logprobs asks for, and with echo those logprobs asks for. An echo of
        max_tokens 0 needs the prompt's pass only: it scores the chosen tokens at least."""
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ApiError(400, "max_tokens: 0 only with echo or prompt_logprobs (nothing else to return)",
                           "max_tokens")
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if not wanted:
            return 0 if self.max_tokens == 0 else None
        return max(wanted)

    def prompts(self) -> list[Prompt]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(t, int) for t in prompt):
            return [prompt]  # type: ignore[list-item]  # one prompt given as token ids
        return list(prompt)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT

    role: str  # the roles the model's chat template accepts (limits.py)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the schema is enforced wherever a grammar forces a call

    def template_input(self) -> dict:
        return self.model_dump(exclude_none=True)


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT

    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None  # OpenAI's deprecated names for tools and tool_choice: refused
    function_call: str | dict | None = None
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None  # vLLM's; refused here, served by /v1/completions

    def constraints(self) -> list[tuple[str, dict]]:
        return [*super().constraints(), ("tool_choice", self.tool_constraint())]

    def forced_function(self) -> str | None:
        """The function a named tool_choice forces."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_constraint(self) -> dict:
        """A named or `required` tool_choice: the grammar of the call it forces."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return {}
        functions = [tool.function.model_dump() for tool in self.tools]
        return {"json": forced_call_schema(functions, self.forced_function(), self.parallel_tool_calls is not False)}

    def check_tools(self) -> None:
        """400s for the tool fields this server cannot honour."""
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise ApiError(400, f"{name}: deprecated and not supported; use tools and tool_choice", name)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ApiError(400, "tool_choice: needs tools", "tool_choice")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools: function names must be distinct", "tools")
        forced = self.forced_function()
        if forced is not None and forced not in names:
            raise ApiError(400, f"tool_choice: function {forced!r} is not among tools", "tool_choice")

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        if self.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs: not supported on /v1/chat/completions; /v1/completions returns "
                                "them (with the chat prompt from POST /tokenize)", "prompt_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
