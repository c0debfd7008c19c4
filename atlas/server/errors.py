"""What a client sees when something goes wrong: every exception becomes OpenAI's error body
{"error": {"message", "type", "param", "code"}} with a 4xx status for the client's mistakes and a 5xx for the
server's (logged here, never sent as a traceback); a stream, whose status line is gone, gets it as an event."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from atlas.engine.async_engine import EngineDeadError, EngineStepError
from atlas.errors import InvalidRequestError, ModelNotFoundError, PromptTooLongError, ServerBusyError
from atlas.outputs import CompletionOutput
from atlas.server import protocol as P

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An answer other than 200, as OpenAI writes it."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code))
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers or None)


class ServerShutdownError(EngineDeadError):
    """The request was still running when --shutdown-timeout passed."""


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        msg = "is required"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return APIError(400, f"{param}: {msg}{more}" if param else msg + more, param=loc[0] if loc else None)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error the client sees (logged when it is the server's fault)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), param=exc.param, code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, ServerBusyError):
        return APIError(429, str(exc), type="rate_limit_error", code="too_many_requests", retry_after=1)
    if isinstance(exc, ServerShutdownError):
        return APIError(503, str(exc), type="server_error", code="server_shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_unavailable")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, "internal server error: this request could not be answered; the server's log has the "
                         "details", type="server_error")


def error_event(exc: BaseException) -> str:
    err = to_api_error(exc)
    body = P.ErrorResponse(error=P.ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code))
    return f"data: {body.model_dump_json()}\n\n"


def raise_if_failed(c: CompletionOutput) -> None:
    """A sequence the engine ended with an error (its grammar allowed no token) fails the request: nothing
    is returned as if it had finished."""
    if c.finish_reason == "error":
        raise APIError(400, f"structured outputs: {c.error}", param="structured_outputs")
