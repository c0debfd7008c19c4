"""Request bodies in, JSON bodies out: the body read within its size and time limits (413, 408), decoded and
checked as one of the protocol's models (400s that name the field), and a model written back as JSON."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from atlas.server import protocol as P
from atlas.server.errors import APIError, validation_error

# JSON nested deeper than this is refused (no OpenAI request needs more than a handful of levels).
MAX_JSON_DEPTH = 64
# After a 413, up to this much of the rest of the body is read and dropped, so that the client (still
# sending) reads the answer instead of a connection reset.
MAX_DRAIN_BYTES = 64 * 2**20


def _reject_nonfinite(constant: str) -> float:
    raise ValueError(f"{constant} is not a valid JSON number")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_json_tree(data: dict[str, Any], surrogates: bool) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH and, when the body has surrogate escapes, strings with a
    lone UTF-16 surrogate, which are not Unicode text (json.loads lets '\\ud800' through). Iterative, so
    nothing here can run out of recursion."""

    def refuse(where: str, message: str) -> APIError:
        top = re.split(r"[.\[]", where, maxsplit=1)[0]
        return APIError(400, f"{where if len(where) <= 60 else top + '...'}: {message}", param=top or None)

    def lone_surrogate(text: str) -> str:
        return (f"contains a lone UTF-16 surrogate (\\u{ord(_SURROGATE.search(text).group()):04x}), which is not "
                "valid Unicode text")

    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict):
            children = []
            for key, item in value.items():
                if surrogates and _SURROGATE.search(key):
                    raise refuse(path or "a field name", lone_surrogate(key))
                if isinstance(item, (dict, list)) or (surrogates and isinstance(item, str)):
                    children.append((item, f"{path}.{key}" if path else key))
        else:
            children = [(item, f"{path}[{i}]") for i, item in enumerate(value)
                        if isinstance(item, (dict, list)) or (surrogates and isinstance(item, str))]
        for item, where in children:
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    raise refuse(where, lone_surrogate(item))
            elif depth >= MAX_JSON_DEPTH:
                raise refuse(where, f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
            else:
                stack.append((item, depth + 1, where))


def decode_body(raw: bytes, model: type[BaseModel]) -> Any:
    """The request body as `model`, or an APIError (400) saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_nonfinite)
    except RecursionError:
        raise APIError(400, f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno}, column "
                            f"{exc.colno}; send one JSON object") from None
    except ValueError as exc:  # (_reject_nonfinite)
        raise APIError(400, f"the request body is not valid JSON: {exc}; send numbers as finite decimals") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_json_tree(data, surrogates=_SURROGATE_ESCAPE.search(text) is not None)
    unsupported = P.unsupported_field(data, chat=model is P.ChatCompletionRequest, accepted=model.model_fields)
    if unsupported is not None:
        name, why = unsupported
        raise APIError(400, f"{name}: {why}; send the request without it", param=name)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def read_body(request: Request, limit: int, timeout: float = 0.0) -> bytes:
    """The raw body, at most `limit` bytes (a larger one is a 413, whatever Content-Length says); with a
    `timeout`, each of its chunks must arrive within that many seconds of the one before (else a 408)."""

    def too_large() -> APIError:
        return APIError(413, f"the request body is larger than this server accepts ({limit:,} bytes)",
                        code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if int(declared) <= MAX_DRAIN_BYTES:
            await drain_body(request)
        raise too_large()
    chunks, size = [], 0
    while True:
        try:
            message = await (asyncio.wait_for(request.receive(), timeout) if timeout > 0 else request.receive())
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body stopped arriving (nothing for {timeout:g} s, --body-timeout)",
                           code="request_timeout") from None
        if message["type"] != "http.request":  # the client went away: nobody reads the answer
            raise APIError(400, "the client disconnected before sending the whole body")
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            if more:
                await drain_body(request)
            raise too_large()
        chunks.append(chunk)
        if not more:
            return b"".join(chunks)


async def drain_body(request: Request) -> None:
    """Read and drop what is left of the body (at most MAX_DRAIN_BYTES)."""
    drained = 0
    while drained <= MAX_DRAIN_BYTES:
        message = await request.receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has gone away (once its body is read, nothing else comes on the channel)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------- response bodies
def json_response(body: BaseModel) -> Response:
    """pydantic's own JSON (non-finite floats become null instead of failing the response)."""
    return Response(body.model_dump_json(), media_type="application/json")
