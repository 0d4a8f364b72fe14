"""Every failure as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

# "SamplingParams.top_p=2.0: ..." (sampling) and "prompt: ..." (engine) name the field first
FIELD_PATTERNS = (re.compile(r"^SamplingParams\.(\w+)"), re.compile(r"^(\w+):"))
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable", 500: "internal_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def field_of(message: str) -> str | None:
    for pattern in FIELD_PATTERNS:
        match = pattern.match(message)
        if match:
            return match.group(1)
    return None


def bad_request(error: ValueError) -> ApiError:
    message = str(error)
    return ApiError(400, message, field_of(message))


def describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = loc[0] if loc and not loc[0].isdigit() else None
    return f"{'.'.join(loc) or 'body'}: {first.get('msg')}", param


async def handle_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def handle_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = describe_validation(exc)
    return error_response(400, message, param)


async def handle_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error serving %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(HTTPException, handle_http_error)
    app.add_exception_handler(Exception, handle_unexpected)
