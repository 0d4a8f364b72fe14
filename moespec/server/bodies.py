"""Request bodies: JSON parsing, validation and the deployment's bounds, off the event loop.

`parse_body` is pure: bytes in, a validated request (already within `RequestLimits`) or an
error out. A body up to `SMALL_BODY_BYTES` is parsed on the event loop (a few milliseconds);
a larger one in a separate process (`BodyParser`), since json.loads and pydantic hold the GIL
for as long as they run (28 MB of token ids: seconds) and a thread would stall /health as
much as the loop itself. What comes back is bounded by the limits, so unpickling it is cheap.

Every failure names its field and the rule it broke: text that is not UTF-8 (a lone
surrogate in a \\u escape), integers past Python's 4300-digit conversion limit, and pydantic's
errors, where a union's branch that fails on type yields to the one that fails on the value.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor

from pydantic import ValidationError

from moespec.server.errors import ApiError
from moespec.server.limits import RequestLimits
from moespec.server.protocol import FIELD_RULES, SamplingRequest

SMALL_BODY_BYTES = 64 << 10
PARENT_POLL_S = 0.5  # how often the body-parsing process looks whether the server is still there
MAX_INT_DIGITS = 4300  # sys.get_int_max_str_digits(): json.loads refuses longer integers
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # lone surrogates reach a str only as \u escapes
UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "constrained-str"}
Parsed = tuple  # ("ok", request) or ("error", status, message, param)


def parse_body(model: type[SamplingRequest], body: bytes, limits: RequestLimits) -> Parsed:
    try:
        request = validate(model, body)
        limits.check_request(request)
    except ApiError as e:
        return "error", e.status, e.message, e.param
    return "ok", request


def validate(model: type[SamplingRequest], body: bytes) -> SamplingRequest:
    data = load_json(body)
    if not isinstance(data, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = describe_errors(e.errors(include_url=False))
        raise ApiError(400, message, param) from None


def load_json(body: bytes) -> object:
    try:
        data = json.loads(body)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"malformed JSON body: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except ValueError:  # an integer longer than Python converts: find which field holds it
        data = json.loads(body, parse_int=TooLong.or_int)
        path = find(data, lambda v: isinstance(v, TooLong))
        raise ApiError(400, f"{dotted(path)}: an integer of {find_value(data, path).digits} digits; integers have "
                            f"at most {MAX_INT_DIGITS} digits", field_name(path)) from None
    if SURROGATE_ESCAPE.search(body):
        path = find(data, lambda v: isinstance(v, str) and not encodable(v))
        if path is not None:
            raise ApiError(400, f"{dotted(path)}: text must be valid Unicode; a lone surrogate (\\ud800-\\udfff) "
                                "is not", field_name(path))
    return data


class TooLong:
    def __init__(self, digits: int) -> None:
        self.digits = digits

    @classmethod
    def or_int(cls, text: str) -> int | TooLong:
        return cls(len(text.lstrip("-"))) if len(text) > MAX_INT_DIGITS else int(text)


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find(data: object, bad) -> list | None:
    """The path (keys and indices) to the first value (or object key) for which bad() holds."""
    stack: list[tuple[object, list]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        if bad(value):
            return path
        if isinstance(value, dict):
            for key, item in value.items():
                if bad(key):
                    return [*path, key]
                stack.append((item, [*path, key]))
        elif isinstance(value, list):
            stack.extend((item, [*path, i]) for i, item in enumerate(value))
    return None


def find_value(data: object, path: list) -> object:
    for part in path:
        data = data[part]
    return data


def dotted(path: list) -> str:
    return ".".join(str(p) if encodable(str(p)) else repr(p) for p in path) or "body"


def field_name(path: list) -> str | None:
    return path[0] if path and isinstance(path[0], str) and encodable(path[0]) else None


def describe_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One message for pydantic's errors: the first that is about the value rather than the type
    (a union's other branches fail on type), its field path without union tags, and the
    field's rule where the message alone would not state it."""
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    loc = [part for part in first.get("loc", ()) if part not in UNION_TAGS and "[" not in str(part)
           and not str(part)[:1].isupper()]  # nor a union's model branch (TokenizePrompt)
    field = loc[0] if loc and isinstance(loc[0], str) else None
    message = f"{'.'.join(map(str, loc)) or 'body'}: {first['msg']}"
    if field in FIELD_RULES:
        message += f" ({field}: {FIELD_RULES[field]})"
    return message, field


def is_ready() -> bool:
    return True


def exit_with_parent(parent: int) -> None:
    """In the body-parsing process: end it once the server process is gone (its queue's pipe
    never closes here, so nothing else tells it), rather than live on orphaned after a kill -9
    or an exit that could not stop it."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="moespec-parent-watch").start()


class BodyParser:
    """Parses bodies over SMALL_BODY_BYTES in one separate process (spawned, started at once
    so that the first large body does not wait for its imports)."""

    def __init__(self) -> None:
        self.pool: ProcessPoolExecutor | None = None
        self.warm: Future | None = None

    def start(self) -> None:
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=exit_with_parent, initargs=(os.getpid(),))
        self.warm = self.pool.submit(is_ready)  # imports this module there; large bodies queue behind it

    def wait_ready(self, timeout: float) -> None:
        self.warm.result(timeout)

    async def parse(self, model: type[SamplingRequest], body: bytes, limits: RequestLimits) -> SamplingRequest:
        if len(body) <= SMALL_BODY_BYTES or self.pool is None:
            parsed = parse_body(model, body, limits)
        else:
            parsed = await asyncio.wrap_future(self.pool.submit(parse_body, model, body, limits))
        if parsed[0] == "error":
            raise ApiError(*parsed[1:])
        return parsed[1]

    def stop(self) -> None:
        if self.pool is None:
            return
        processes = list((self.pool._processes or {}).values())  # noqa: SLF001  no public handle to end them
        self.pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()

