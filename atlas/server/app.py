"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending in `data: [DONE]`), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics,
POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /openapi.json and GET /docs.

Every error a client can cause is answered with OpenAI's body {"error": {"message", "type", "param",
"code"}} and a 4xx status; a server fault is a 5xx with the same body, never a traceback. A client
that goes away has its requests aborted (their KV pages are freed at the next step).

One request never holds up the others: the event loop only moves bytes. Decoding the JSON body,
tokenizing and rendering the chat template run in a thread pool (the tokenizer releases the GIL), the
body is capped (413), a request's sequences are capped (prompts x n), and chat templates render in a
sandbox with limits on size and time (atlas/engine/chat_template.py); templates sent by clients are
refused unless the operator trusts them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import re
import struct
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from atlas.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError, RequestStream
from atlas.engine.chat_template import RESERVED_TEMPLATE_VARIABLES, TemplateLimits
from atlas.engine.cpu_threads import available_cpus
from atlas.engine.info import check_pooled_length
from atlas.engine.tokenizer import Tokenizer
from atlas.errors import InvalidRequestError, PromptTooLongError, ServerBusyError, busy_message
from atlas.outputs import CompletionOutput, Logprob, RequestOutput
from atlas.processes import give_back_memory
from atlas.sampling_params import SamplingParams, StructuredOutputsParams, resolve_max_tokens
from atlas.server import protocol as P
from atlas.server import responses as R
from atlas.server.browsers import (
    BrowserGuard,
    CORSMiddleware,
    cors_options,
    default_allowed_hosts,
    parse_list,
)
from atlas.server.large_responses import LARGE_RESPONSE_ENTRIES, chat_entries, dump_in_pieces, logprob_entries
from atlas.server.output_parsers import (
    HARMONY_REASONING,
    REASONING_PARSERS,
    TOOL_PARSERS,
    ChoiceParser,
    HarmonyToolParser,
    NamedToolParser,
    ReasoningParser,
    RequiredToolParser,
    ToolParser,
)
from atlas.server.preprocess_workers import PreprocessWorkers, RemoteTokenizer
from atlas.structured.json_schema import embed_schema

logger = logging.getLogger(__name__)

# OpenAI's default max_tokens for /v1/completions; chat defaults to what the context leaves.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# Request bodies up to this size are decoded, and single prompt texts up to this many characters tokenized, on the
# event loop: that takes less than the hop to the preprocessing pool and back (larger ones go to the pool).
INLINE_BODY_BYTES = 16 * 1024
INLINE_PROMPT_CHARS = 4096
# Work past these runs in the heavy pool (OpenAIServer.heavy_pool), so that ordinary requests never queue
# behind it: a request body, a prompt or messages' text, a chat's messages, a request's tools.
HEAVY_BODY_BYTES = 1 << 20
HEAVY_CHARS = 256 * 1024
HEAVY_MESSAGES = 512
HEAVY_TOOLS = 128
# JSON nested deeper than this is refused (no OpenAI request needs more than a handful of levels).
MAX_JSON_DEPTH = 64
# A chat template sent with a request (when trusted) may be at most this long.
MAX_REQUEST_TEMPLATE_CHARS = 128 * 1024
# After a 413, up to this much of the rest of the body is read and dropped, so that the client (still
# sending) reads the answer instead of a connection reset.
MAX_DRAIN_BYTES = 64 * 2**20


# /docs: Swagger UI from the CDN at one pinned release, each file with its subresource-integrity hash (the sha384
# of that file in the swagger-ui-dist npm package of this version), so that a browser runs no other code than
# that release's, whatever the CDN serves. To move to another release, hash its files the same way.
SWAGGER_UI_VERSION = "5.35.0"
SWAGGER_UI_FILES = {
    "swagger-ui.css": "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I",
    "swagger-ui-bundle.js": "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9",
}


def docs_page(openapi_url: str, title: str) -> str:
    """The /docs page: the pinned, hash-checked Swagger UI over `openapi_url` (no other file from elsewhere)."""
    import html

    def url(name: str) -> str:
        return f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}/{name}"

    def checked(name: str) -> str:
        return f'integrity="{SWAGGER_UI_FILES[name]}" crossorigin="anonymous" referrerpolicy="no-referrer"'

    options = json.dumps({"url": openapi_url, "dom_id": "#swagger-ui", "deepLinking": True, "layout": "BaseLayout",
                          "showExtensions": True, "showCommonExtensions": True})
    return f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{url('swagger-ui.css')}" {checked('swagger-ui.css')}>
</head>
<body>
<div id="swagger-ui"></div>
<script src="{url('swagger-ui-bundle.js')}" {checked('swagger-ui-bundle.js')}></script>
<script>
const options = {options};
options.presets = [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset];
window.ui = SwaggerUIBundle(options);
</script>
</body>
</html>
"""


@dataclass(frozen=True)
class ServerSettings:
    """The server's own settings (the `atlas serve` flags beyond the engine's)."""

    api_key: str | None = None
    # With an API key: False also puts /metrics, /docs and /openapi.json behind it (/health stays open).
    public_metrics_and_docs: bool = True
    max_request_body_bytes: int = 8 * 2**20
    max_sequences_per_request: int = 256  # prompts x n
    # Most items in one of a request's lists (stop_token_ids, stop, tools, messages, prompts, token ids to
    # detokenize beyond the context): the work a request causes is bounded before any of it is done.
    max_request_list_items: int = 4096
    # Prompt text longer than this many characters per token of the context cannot fit; it is refused before
    # it is tokenized (a 15 MB prompt tokenized for nothing held the preprocessing pool for seconds).
    max_prompt_chars_per_token: int = 64
    # Admission control: requests (prompts) that may wait for a sequence slot beyond the --max-num-seqs running;
    # past it new requests get 429 with Retry-After. None: 8 x --max-num-seqs; 0: no bound.
    max_waiting_requests: int | None = None
    trust_request_chat_template: bool = False
    log_requests: bool = False  # a line per request as it starts (--enable-log-requests)
    chat_template_timeout: float = 5.0  # seconds one chat template may render
    shutdown_timeout: float = 10.0  # how long in-flight requests may finish once shutdown begins
    # Connections (atlas/server/connections.py): deadlines for a request's headers and between its body's chunks,
    # idle keep-alive, caps on open connections in all and per client address (0: no cap).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    timeout_keep_alive: float = 5.0
    max_connections: int = 4096
    max_connections_per_client: int = 0
    preprocess_threads: int | None = None  # default: CPUs available + 2
    # Worker processes for large preprocessing (a client's chat template, large chats, tokenizations): at most
    # this many at once (preprocess_workers.py); 0: in the front end's heavy thread.
    preprocess_workers: int = 1
    start_preprocess_workers: bool = False  # at start-up (atlas serve); else with the first large request
    # Tool calling and reasoning output (vLLM's flags).
    enable_auto_tool_choice: bool = False  # tool_choice "auto": tool calls parsed from the reply's text
    tool_call_parser: str | None = None  # how the model writes tool calls (TOOL_PARSERS)
    reasoning_parser: str | None = None  # <think>...</think> into reasoning_content (REASONING_PARSERS)
    # Browsers (atlas/server/browsers.py). The address the server is bound to (--host) sets the default
    # allowed hosts; allowed_hosts None = that default, ("*",) = any Host.
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] | None = None
    # CORS (vLLM's flags): off while allowed_origins is empty; ("*",) = any origin.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "timeout_keep_alive", "max_connections",
                     "max_connections_per_client", "preprocess_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.api_key is not None:
            # A key read from a file or a secret often ends in a newline, and clients' tokens are stripped:
            # strip it, so that it can match. A key of only spaces is a mistake, not "no key".
            object.__setattr__(self, "api_key", self.api_key.strip())
            if not self.api_key:
                raise ValueError("--api-key (or ATLAS_API_KEY) is empty or only spaces")
            # An HTTP header carries bytes that clients write as ASCII (the openai library cannot send anything
            # else), and a bearer token is ASCII by its RFC: a key beyond it could never be sent as written.
            if not all(" " <= ch <= "~" for ch in self.api_key):
                raise ValueError("--api-key (or ATLAS_API_KEY) has characters outside printable ASCII (accents, "
                                 "other scripts or control characters), which clients cannot send in an "
                                 "Authorization header: use letters, digits and punctuation, e.g. the output of "
                                 "'openssl rand -hex 32'")
        for name in ("allowed_hosts", "allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_list(value, f"--{name.replace('_', '-')}"))
        if self.allowed_hosts is not None and not self.allowed_hosts:
            raise ValueError("--allowed-hosts is empty: name the hosts the server answers for, or '*' for any")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials with --allowed-origins '*' would let every web page make "
                             "requests with its users' credentials: name the origins")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser: one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes "
                             "tool calls in)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.reasoning_parser == HARMONY_REASONING and self.tool_call_parser not in (None, "openai"):
            raise ValueError(f"--reasoning-parser {HARMONY_REASONING} reads gpt-oss's harmony format, whose tool "
                             f"calls --tool-call-parser openai reads, not {self.tool_call_parser}")
        for name in ("max_request_body_bytes", "max_sequences_per_request", "max_request_list_items",
                     "max_prompt_chars_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("--max-waiting-requests must be >= 0 (0: no bound)")
        for name in ("chat_template_timeout", "shutdown_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")


# ---------------------------------------------------------------------------------- errors
class APIError(Exception):
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


def _validation_error(exc: ValidationError) -> APIError:
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
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, ValidationError):
        return _validation_error(exc)
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


def _error_event(exc: BaseException) -> str:
    err = to_api_error(exc)
    body = P.ErrorResponse(error=P.ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code))
    return f"data: {body.model_dump_json()}\n\n"


def json_response(body: BaseModel) -> Response:
    """pydantic's own JSON (non-finite floats become null instead of failing the response)."""
    return Response(body.model_dump_json(), media_type="application/json")


# ---------------------------------------------------------------------------------- request bodies
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
        raise _validation_error(exc) from None


async def read_body(request: Request, limit: int, timeout: float = 0.0) -> bytes:
    """The raw body, at most `limit` bytes (a larger one is a 413, whatever Content-Length says); with a
    `timeout`, each of its chunks must arrive within that many seconds of the one before (else a 408)."""

    def too_large() -> APIError:
        return APIError(413, f"the request body is larger than this server accepts ({limit:,} bytes)",
                        code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if int(declared) <= MAX_DRAIN_BYTES:
            await _drain(request)
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
                await _drain(request)
            raise too_large()
        chunks.append(chunk)
        if not more:
            return b"".join(chunks)


async def _drain(request: Request) -> None:
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
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams, as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()



def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE writes each byte as one printable character: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class TokenText:
    """One token as logprobs show it: its text, and its exact bytes (a token may hold part of a
    UTF-8 character; its text is then written as OpenAI does, e.g. 'bytes:\\xe2\\x80')."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.alphabet: dict[str, int] | None = None
        self.special: set[int] = set()
        if tokenizer is not None:
            decoder = getattr(getattr(tokenizer.hf, "backend_tokenizer", None), "decoder", None)
            if type(decoder).__name__ == "ByteLevel":
                self.alphabet = _byte_level_alphabet()
            self.special = set(tokenizer.hf.all_special_ids)

    def _raw(self, token: int) -> bytes:
        hf = self.tokenizer.hf
        piece = hf.convert_ids_to_tokens(token)
        if isinstance(piece, str) and token not in self.special:
            if self.alphabet is not None and piece and all(c in self.alphabet for c in piece):
                return bytes(self.alphabet[c] for c in piece)
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # sentencepiece byte fallback
            if m:
                return bytes([int(m.group(1), 16)])
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()

    def _lookup(self, token: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token)
        if hit is None:
            if self.tokenizer is None:
                hit = (f"token_id:{token}", [])
            else:
                raw = self._raw(token)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                hit = (text, list(raw))
            self.cache[token] = hit
        return hit

    def text(self, token: int) -> str:
        return self._lookup(token)[0]

    def bytes(self, token: int) -> list[int]:
        return self._lookup(token)[1]


@dataclass
class PromptInfo:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass
class ChoiceState:
    """What one streamed choice has sent so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0
    done: bool = False
    prompt_ids_sent: bool = False  # (return_token_ids: the prompt's ids go with the first chunk sent)


def _shorten(vector: list[float], dimensions: int, normalized: bool) -> list[float]:
    """A matryoshka embedding's first `dimensions` values (L2-normalized again when the model's vectors are:
    the same as normalizing the pooled vector's first values, as vLLM does)."""
    head = vector[:dimensions]
    if not normalized:
        return head
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return [v / norm for v in head]


def _echo_only(c: CompletionOutput) -> CompletionOutput:
    """A completion of `max_tokens: 0` with `echo`: the token generated for it is dropped."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                               finish_reason="length" if c.finish_reason is not None else None, stop_reason=None)


# The schema of a function declared without parameters: an object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


def required_tools_schema(tools: list[P.ToolDefinition], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one call or more (one with parallel_tool_calls false), each
    {"name": one of the tools, "parameters": valid for that tool}."""
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name},
                             # (the tool's own "#/..." references keep pointing inside its parameters)
                             "parameters": embed_schema(t.function.parameters, f"#/items/anyOf/{i}/properties/parameters",
                                                        f"tools[{i}].function.parameters")
                             if t.function.parameters is not None else _NO_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _raise_if_failed(c: CompletionOutput) -> None:
    """A sequence the engine ended with an error (its grammar allowed no token) fails the request: nothing
    is returned as if it had finished."""
    if c.finish_reason == "error":
        raise APIError(400, f"structured outputs: {c.error}", param="structured_outputs")


_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


class ChunkWriter:
    """Server-sent events of a stream's plain chunks (text only: no logprobs, token ids, tool calls or reasoning),
    written without building pydantic models: the same JSON as the models give (a test compares them), at a
    fraction of the cost, for the events that make up almost every stream."""

    def __init__(self, kind: str, request_id: str, created: int, model: str):
        self.chat = kind == "chat.completion.chunk"
        self.head = (f'data: {{"id":{_JSON(request_id)},"object":"{kind}","created":{created},"model":{_JSON(model)},'
                     '"choices":[{"index":')

    def text(self, index: int, text: str | None, finish_reason: str | None, stop_reason: int | str | None) -> str:
        if self.chat:
            body = f'"delta":{{"content":{_JSON(text)}}}' if text is not None else '"delta":{}'
        else:
            body = f'"text":{_JSON(text)}'
        return (f'{self.head}{index},{body},"logprobs":null,"finish_reason":{_JSON(finish_reason)},'
                f'"stop_reason":{_JSON(stop_reason)}}}],"usage":null}}\n\n')


def prompt_logprobs_of(out: RequestOutput) -> list[dict[int, P.PromptLogprob] | None]:
    """vLLM's prompt_logprobs field: each prompt token's entry (None for the first, which nothing predicts)."""
    return [None if entry is None else {t: P.PromptLogprob(logprob=lp.logprob if math.isfinite(lp.logprob) else -9999.0,
                                                           rank=lp.rank, decoded_token=lp.decoded_token)
                                        for t, lp in entry.items()}
            for entry in out.prompt_logprobs or []]


def _finish_reason(reason: str | None, has_calls: bool, tool_mode: str) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call tools (auto, required) and stopped by itself; a
    named function ends with "stop"."""
    if reason == "stop" and has_calls and tool_mode in ("auto", "required"):
        return "tool_calls"
    return reason


# ---------------------------------------------------------------------------------- the server
class OpenAIServer:
    def __init__(self, engine: AsyncEngine, served_model_names: list[str], settings: ServerSettings,
                 tokenizer: Tokenizer | None = None):
        self.engine = engine
        self.info = engine.info
        self.names = list(served_model_names)
        self.model_name = self.names[0]
        self.settings = settings
        self.api_key = settings.api_key
        # The server's own tokenizer instance: the engine thread uses the engine's concurrently.
        self.tokenizer = tokenizer
        if tokenizer is not None:
            tokenizer.set_template_limits(TemplateLimits(timeout_s=settings.chat_template_timeout))
        self.token_text = TokenText(tokenizer)
        engine.enable_metrics(self.model_name)  # (kept where the engine runs)
        cap = settings.max_waiting_requests
        engine.max_waiting = 8 * self.info.max_num_seqs if cap is None else cap
        # CPU work of a request (JSON decoding, tokenization, chat templates) runs here, off the event loop.
        threads = settings.preprocess_threads or available_cpus() + 2
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="atlas-preprocess")
        # Large work (a client's own chat template, huge bodies, prompts, chats, tool lists) has one thread of its
        # own: such requests wait for each other, not ordinary requests for them (8 client templates queued every
        # chat behind them for 10 s). One thread: templates and JSON are Python, which a second thread would not
        # run any faster (the interpreter lock), only take from the event loop and the ordinary requests.
        # With --preprocess-workers (default 1), that thread hands the tokenizer's work (templates, tokenization)
        # to worker processes (preprocess_workers.py) and only waits for the answer.
        self._thread = threading.local()
        self.heavy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atlas-heavy",
                                             initializer=lambda: setattr(self._thread, "heavy", True))
        self.workers = (PreprocessWorkers(tokenizer.source, settings.chat_template_timeout,
                                          settings.preprocess_workers)
                        if tokenizer is not None and settings.preprocess_workers else None)
        self.shutting_down = False
        self.in_flight = 0  # HTTP requests being answered, /health aside (DrainGuard)
        self.num_cut = 0  # requests cut at the shutdown timeout
        self._cut_timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once it runs

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, heavy: bool = False) -> Any:
        """fn(*args) in the preprocessing pool (the heavy pool for large work); the event loop keeps serving
        meanwhile."""
        if not heavy:
            return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

        def run() -> Any:
            try:
                return fn(*args)
            finally:
                give_back_memory()  # (what the large work freed goes back to the system, not into the heap)

        return await asyncio.get_running_loop().run_in_executor(self.heavy_pool, run)

    @staticmethod
    def heavy_chat(req: Any) -> bool:
        """Whether a chat's rendering is large work: a client's own template, or many or long messages or tools."""
        messages = req.messages or []
        return (getattr(req, "chat_template", None) is not None or len(messages) > HEAVY_MESSAGES
                or len(getattr(req, "tools", None) or []) > HEAVY_TOOLS
                or sum(len(m.text()) for m in messages) > HEAVY_CHARS)

    async def parse_body(self, request: Request, model: type[BaseModel]) -> Any:
        raw = await read_body(request, self.settings.max_request_body_bytes, self.settings.body_timeout)
        if len(raw) <= INLINE_BODY_BYTES:  # (tens of microseconds: less than the hop to the pool and back)
            return decode_body(raw, model)
        return await self.run_blocking(decode_body, raw, model, heavy=len(raw) > HEAVY_BODY_BYTES)

    # ------------------------------------------------------------------ shutdown
    def begin_shutdown(self) -> None:
        """Shutdown has begun (no new connections): requests still running after --shutdown-timeout are
        cut then: streams get an error event and [DONE], the others a 503."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self._cut_timer = asyncio.get_running_loop().call_later(self.settings.shutdown_timeout, self.cut_in_flight)

    async def drain(self, stop: Callable[[], bool]) -> None:
        """The drain before the listener closes: until no request is in flight (the cut at --shutdown-timeout ends
        those still running), `stop()` (a third signal) or the timeout plus a second. Meanwhile the server still
        accepts connections, /health answers 503 and new requests get a 503 (DrainGuard), so that a load balancer
        sees the drain instead of refused connections."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_timeout + 1.0
        while self.in_flight and not stop() and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def cut_in_flight(self, forced: bool = False) -> int:
        """Cut what still runs: streams get an error event and [DONE], the others a 503. `forced`: a second
        signal came during the drain (no waiting for the timeout)."""
        timeout = self.settings.shutdown_timeout
        error = ServerShutdownError(
            "the server was stopped at once (a second signal during its shutdown) while this request was running"
            if forced else f"the server is shutting down and this request was still running after its shutdown "
                           f"timeout ({timeout:g} s)")
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        cut = self.engine.cut(error)
        if cut:
            self.num_cut += cut
            logger.warning("shutdown: %d request(s) still running after --shutdown-timeout %g s were cut "
                           "(streams get an error event, others a 503)", cut, timeout)
        return cut

    def close(self) -> None:
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.heavy_pool.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()

    # ------------------------------------------------------------------ shared checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        headers = request.headers.getlist("authorization")
        if len(headers) > 1:
            raise APIError(401, "the request has several Authorization headers: send one, "
                                "'Authorization: Bearer <key>'", param=None, code="invalid_api_key")
        header = headers[0] if headers else ""
        scheme, _, token = header.partition(" ")
        # The header's own bytes (Starlette reads them as latin-1, which gives them back unchanged) against the
        # key's (printable ASCII: ServerSettings); only spaces and tabs around the token are dropped.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(" \t").encode("latin-1"),
                                                                 self.api_key.encode("ascii")):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                           param=None, code="invalid_api_key")

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.names:
            return self.model_name if name is None else name
        raise APIError(404, f"the model {name!r} does not exist; this server serves {', '.join(self.names)}",
                       param="model", code="model_not_found")

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """Cap the sequences one request creates (prompts x n)."""
        cap = self.settings.max_sequences_per_request
        if num_prompts * n > cap:
            what = f"{num_prompts} prompt(s) x n={n}" if num_prompts > 1 else f"n={n}"
            raise APIError(400, f"this request asks for {num_prompts * n} sequences ({what}); this server allows at "
                                f"most {cap} per request", param="n" if n > 1 else "prompt")

    def check_sizes(self, req: BaseModel, must_fit: bool = True) -> None:
        """Each list and prompt of the request within its limit, before any work is done for it (400s naming the
        field and the flag that raises the limit). must_fit: the prompt is for generation, so one that could not
        fit in the context is refused untokenized (/tokenize counts any text the body limit lets through)."""
        cap = self.settings.max_request_list_items
        stop = getattr(req, "stop", None)
        lists = {"stop_token_ids": getattr(req, "stop_token_ids", None), "tools": getattr(req, "tools", None),
                 "messages": getattr(req, "messages", None), "stop": stop if isinstance(stop, list) else None,
                 "logit_bias": getattr(req, "logit_bias", None)}
        prompt = getattr(req, "prompt", None)
        texts: list[str] = [prompt] if isinstance(prompt, str) else []
        id_lists: list[list] = []
        if isinstance(prompt, list):
            if all(isinstance(p, int) for p in prompt):
                id_lists = [prompt]
            else:  # several prompts
                lists["prompt"] = prompt
                texts = [p for p in prompt if isinstance(p, str)]
                id_lists = [p for p in prompt if isinstance(p, list)]
        for field, items in lists.items():
            if items is not None and len(items) > cap:
                raise APIError(400, f"{field}: {len(items):,} items; this server takes at most {cap:,} "
                                    "(--max-request-list-items)", param=field)
        context = self.info.max_model_len
        if not must_fit:
            return
        for ids in id_lists:
            if len(ids) > context:
                raise PromptTooLongError(f"the prompt has {len(ids):,} tokens; the context holds {context:,} "
                                         "(--max-model-len)", param="prompt")
        messages = lists["messages"] or []
        texts.append("".join(m.content for m in messages if isinstance(getattr(m, "content", None), str)))
        chars = context * self.settings.max_prompt_chars_per_token
        for text in texts:
            if len(text) > chars:
                raise PromptTooLongError(
                    f"the {'messages have' if messages else 'prompt has'} {len(text):,} characters, more than "
                    f"{self.settings.max_prompt_chars_per_token} per token of the context ({context:,} tokens, "
                    "--max-model-len) could hold; shorten it (or raise --max-prompt-chars-per-token)",
                    param="messages" if messages else "prompt")

    def need_tokenizer(self, param: str) -> Tokenizer | RemoteTokenizer:
        """The tokenizer; in the heavy thread, the stand-in whose work runs in a preprocessing worker process."""
        if self.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer (--skip-tokenizer-init): send token ids",
                           param=param)
        if self.workers is not None and getattr(self._thread, "heavy", False):
            return self.workers.tokenizer
        return self.tokenizer

    def prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.need_tokenizer("prompt").encode(prompt)
            if not ids:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return prompt, ids
        return None, self.info.check_prompt_ids(list(prompt))

    def resolve_max_tokens(self, requested: int | None, default: int | None, num_prompt: int, param: str) -> int:
        return resolve_max_tokens(requested, default, num_prompt, self.info.max_model_len, param)

    def sampling_params(self, req: P.SamplingRequest, max_tokens: int, logprobs: int | None,
                        rename: dict[str, str] | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
        defaults = self.info.sampling_defaults  # (--generation-config: for the fields the request leaves out)

        def pick(name: str, builtin: float) -> float:
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, builtin)

        try:
            params = SamplingParams(
                n=req.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=pick("repetition_penalty", 1.0),
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                structured_outputs=structured,
                cache_salt=req.cache_salt,
                priority=req.priority or 0,
                logit_bias=req.logit_bias,
            )
            params.check_token_ids(self.info.vocab_size)
            return params
        except InvalidRequestError as exc:
            param = (rename or {}).get(exc.param, exc.param)
            if param != exc.param:
                raise InvalidRequestError(str(exc).replace(exc.param, param, 1), param=param) from None
            raise

    def check_stream_options(self, req: P.SamplingRequest) -> bool:
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs: returned only in non-streaming responses (stream: false)",
                           param="prompt_logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        return bool(req.stream_options and req.stream_options.include_usage)

    def template_and_kwargs(self, chat_template: str | None, kwargs: dict[str, Any] | None
                            ) -> tuple[str | None, dict[str, Any]]:
        """The request's own chat template (if any, and if allowed) and its extra template variables."""
        kwargs = dict(kwargs or {})
        if "chat_template" in kwargs:
            inner = kwargs.pop("chat_template")
            if not isinstance(inner, str):
                raise APIError(400, "chat_template_kwargs.chat_template: must be a string", param="chat_template_kwargs")
            if chat_template is not None and inner != chat_template:
                raise APIError(400, "chat_template is given twice (as a field and in chat_template_kwargs)",
                               param="chat_template")
            chat_template = inner
        hints = {"messages": "the request's messages", "add_generation_prompt": "the request field add_generation_prompt",
                 "tools": "the request's tools", "documents": "not supported"}
        for name in RESERVED_TEMPLATE_VARIABLES:
            if name in kwargs:
                raise APIError(400, f"chat_template_kwargs.{name}: the server sets this template variable itself "
                                    f"(from {hints[name]}); leave it out of chat_template_kwargs",
                               param="chat_template_kwargs")
        if chat_template is not None:
            if not self.settings.trust_request_chat_template:
                raise APIError(400, "this server does not accept chat templates from requests; it renders the model's "
                                    "own (the operator can allow them with --trust-request-chat-template)",
                               param="chat_template")
            if len(chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
                raise APIError(400, f"chat_template: at most {MAX_REQUEST_TEMPLATE_CHARS:,} characters",
                               param="chat_template")
        return chat_template, kwargs

    # ------------------------------------------------------------------ structured outputs and tools
    @staticmethod
    def structured_spec(req: P.SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
        """The request's output constraint and the field that gave it, from response_format, structured_outputs
        or the guided_* fields (at most one of them)."""
        found: list[tuple[StructuredOutputsParams, str]] = []
        fmt = req.response_format
        if fmt is not None and fmt.type != "text":
            spec = (StructuredOutputsParams(json_object=True) if fmt.type == "json_object"
                    else StructuredOutputsParams(structural_tag=fmt.structural_tag()) if fmt.type == "structural_tag"
                    else StructuredOutputsParams(json=fmt.json_schema.json_schema))
            found.append((spec, "response_format"))
        if req.structured_outputs is not None:
            fields = req.structured_outputs
            unknown = sorted(set(fields) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise APIError(400, f"structured_outputs: unknown field(s) {', '.join(unknown)}; it takes "
                                    f"{', '.join(StructuredOutputsParams.KINDS)}", param="structured_outputs")
            found.append((StructuredOutputsParams(**fields), "structured_outputs"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(req, name) is not None:
                found.append((StructuredOutputsParams(**{kind: getattr(req, name)}), name))
        if len(found) > 1:
            raise APIError(400, f"{found[1][1]}: the output is already constrained by {found[0][1]}; give one "
                                "constraint", param=found[1][1])
        if not found:
            return None
        spec, param = found[0]
        try:
            spec.validate(param)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=param) from None
        return spec, param

    async def compile_constraint(self, spec: StructuredOutputsParams, param: str) -> None:
        """Compile (or find in the cache) off the event loop and the engine thread: a constraint that does not
        compile is this request's 400, and nothing else waits for it."""
        try:
            await self.engine.compile_constraint(spec)
        except InvalidRequestError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    async def tool_plan(self, req: P.ChatCompletionRequest
                        ) -> tuple[Callable[[], ToolParser] | None, StructuredOutputsParams | None, str]:
        """(a maker of the reply's tool parser, the constraint tool_choice imposes, the mode: none / auto /
        required / named). Each tool's parameter schema must compile."""
        tools = req.tools or []
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if not tools:
            if choice in ("none", "auto"):
                return None, None, "none"
            raise APIError(400, "tool_choice: there are no tools to call (give tools)", param="tool_choice")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: two tools have the same name", param="tools")
        for i, tool in enumerate(tools):
            if tool.function.parameters is not None:
                await self.compile_constraint(StructuredOutputsParams(json=tool.function.parameters),
                                              f"tools[{i}].function.parameters")
        if choice == "none":
            return None, None, "none"
        if choice == "auto":
            settings = self.settings
            if not settings.enable_auto_tool_choice:
                raise APIError(400, 'tool_choice "auto" (the default with tools) needs the server to run with '
                                    '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice '
                                    '"required", "none" or a named function', param="tool_choice")
            schemas = {t.function.name: t.function.parameters or {} for t in tools}  # (formats typed by schema)
            return functools.partial(TOOL_PARSERS[settings.tool_call_parser], schemas), None, "auto"
        if choice == "required":
            spec = StructuredOutputsParams(json=required_tools_schema(tools, req.parallel_tool_calls is not False))
            await self.compile_constraint(spec, "tools")
            return RequiredToolParser, spec, "required"
        name = choice.function.name
        if name not in names:
            raise APIError(400, f"tool_choice: there is no tool named {name!r} (tools: {', '.join(names)})",
                           param="tool_choice")
        parameters = tools[names.index(name)].function.parameters
        spec = StructuredOutputsParams(json=parameters if parameters is not None else _NO_PARAMETERS)
        await self.compile_constraint(spec, "tool_choice")
        return functools.partial(NamedToolParser, name), spec, "named"

    # ------------------------------------------------------------------ running requests
    def check_admission(self, num_prompts: int) -> None:
        """429 with Retry-After when more requests already wait for a sequence slot than --max-waiting-requests:
        a loaded server says so at once instead of queueing work it cannot start in time. (Checked here
        against this front end's requests, and by an engine in a process of its own against all of them.)"""
        running = self.info.max_num_seqs
        cap = self.engine.max_waiting
        if cap and self.engine.num_streams + num_prompts > running + cap:
            raise ServerBusyError(busy_message(running, cap))

    async def start(self, request_id: str, prompts: list[PromptInfo], arrival: float) -> list[RequestStream]:
        """Queue every prompt; all or nothing."""
        self.check_admission(len(prompts))
        if self.settings.log_requests:
            for i, p in enumerate(prompts):
                logger.info("request %s: %d prompt tokens, %s", request_id if len(prompts) == 1 else f"{request_id}-{i}",
                            len(p.token_ids), p.params.summary())
        results = await asyncio.gather(
            *(self.engine.add_request({"prompt_token_ids": p.token_ids}, p.params,
                                      request_id if len(prompts) == 1 else f"{request_id}-{i}", arrival,
                                      group=request_id)
              for i, p in enumerate(prompts)),
            return_exceptions=True)
        streams = [r for r in results if not isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException):
                for s in streams:
                    s.close()
                raise r
        return streams

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
        """Final outputs, or None if the client went away first (its requests are then aborted)."""
        async def last(stream: RequestStream) -> RequestOutput:
            out = None
            async for out in stream:  # noqa: B007 - only the last one matters
                pass
            return out

        work = asyncio.gather(*(last(s) for s in streams))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            logger.info("client disconnected; aborting %s", ", ".join(s.request_id for s in streams))
            return None
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                work.add_done_callback(lambda f: f.cancelled() or f.exception())  # nothing left to report
            for s in streams:
                s.close()

    # ------------------------------------------------------------------ logprobs
    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], start: int,
                            out: P.CompletionLogprobs | None = None) -> tuple[P.CompletionLogprobs, int]:
        """Legacy completions logprobs of token_ids, text offsets counted from `start`, appended to
        `out` if given. An entry of None (the first prompt token, which nothing predicts) gives nulls."""
        out = out or P.CompletionLogprobs()
        offset = start
        for token, entries in zip(token_ids, logprobs, strict=False):
            s = self.token_text.text(token)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if entries is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entries[token].logprob)
            top: dict[str, float] = {}
            for t, e in entries.items():  # two tokens may print alike: keep the likelier
                key = self.token_text.text(t)
                top[key] = max(e.logprob, top.get(key, e.logprob))
            out.top_logprobs.append(top)
        return out, offset

    def echo_logprobs(self, prompt: PromptInfo, out: RequestOutput) -> P.CompletionLogprobs | None:
        """The echoed prompt's logprobs (offsets from 0), to which the completion's are appended."""
        if out.prompt_logprobs is None:
            return None
        return self.completion_logprobs(prompt.token_ids, out.prompt_logprobs, 0)[0]

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int
                      ) -> P.ChatChoiceLogprobs:
        text, raw = self.token_text.text, self.token_text.bytes
        content = []
        for token, entries in zip(token_ids, logprobs, strict=False):
            top = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank <= k)
            content.append(P.ChatTokenLogprob(
                token=text(token), logprob=entries[token].logprob, bytes=raw(token),
                top_logprobs=[P.TopLogprob(token=text(t), logprob=lp, bytes=raw(t)) for _, t, lp in top]))
        return P.ChatChoiceLogprobs(content=content)

    # ------------------------------------------------------------------ /v1/embeddings
    def check_generation(self) -> None:
        """A generation endpoint on an embedding server: 400 naming the fix."""
        if self.info.runner == "pooling":
            raise APIError(400, "this server runs an embedding model (--runner pooling): it serves POST /v1/embeddings "
                                "only; start it without --runner pooling to generate text")

    def check_dimensions(self, dimensions: int | None) -> int | None:
        """The request's `dimensions`: only for a matryoshka model (config.json's is_matryoshka or
        matryoshka_dimensions, as vLLM reads them), within its hidden size and the lengths it lists."""
        if dimensions is None:
            return None
        info = self.info
        if not info.matryoshka:
            raise APIError(400, "dimensions: this model does not support matryoshka representation (its config.json "
                                "sets neither is_matryoshka nor matryoshka_dimensions), so its embeddings cannot be "
                                "shortened; leave dimensions out", param="dimensions")
        allowed = info.matryoshka_dimensions
        if dimensions > info.embedding_size or (allowed and dimensions not in allowed):
            choices = ", ".join(map(str, allowed)) if allowed else f"1 to {info.embedding_size}"
            raise APIError(400, f"dimensions: {dimensions} is not a length this model's embeddings come in ({choices})",
                           param="dimensions")
        return dimensions

    def embedding_prompts(self, req: P.EmbeddingRequest) -> list[PromptInfo]:
        """Tokenize and check every input (runs in the preprocessing pool)."""
        params = SamplingParams(max_tokens=1)
        prompts = []
        for item in req.inputs():
            if isinstance(item, str):
                ids = self.need_tokenizer("input").encode(item, add_special_tokens=req.add_special_tokens)
                if not ids:
                    raise InvalidRequestError("the input has no tokens", param="input")
            else:
                try:
                    ids = self.info.check_prompt_ids(item)
                except InvalidRequestError as exc:
                    raise InvalidRequestError(str(exc), param="input") from None
            check_pooled_length(len(ids), self.info.max_model_len)
            prompts.append(PromptInfo(item if isinstance(item, str) else None, ids, params))
        return prompts

    async def embeddings(self, request: Request) -> Response:
        arrival = time.time()
        req: P.EmbeddingRequest = await self.parse_body(request, P.EmbeddingRequest)
        model = self.check_model(req.model)
        if self.info.runner != "pooling":
            raise APIError(400, "this server generates text; embeddings need an embedding checkpoint served with "
                                "--runner pooling (vLLM's flag; --task embed is its older form)")
        dimensions = self.check_dimensions(req.dimensions)
        inputs = req.inputs()
        cap = self.settings.max_request_list_items
        if len(inputs) > cap:
            raise APIError(400, f"input: {len(inputs):,} items; this server takes at most {cap:,} "
                                "(--max-request-list-items)", param="input")
        self.check_sequences(len(inputs), 1)
        chars = self.info.max_model_len * self.settings.max_prompt_chars_per_token
        if any(isinstance(t, str) and len(t) > chars for t in inputs):
            raise PromptTooLongError(f"an input has more than {self.settings.max_prompt_chars_per_token} characters "
                                     f"per token of the context ({self.info.max_model_len:,} tokens, --max-model-len) "
                                     "could hold; shorten it", param="input")
        small = sum(len(t) for t in inputs if isinstance(t, str)) <= INLINE_PROMPT_CHARS
        heavy = sum(len(t) for t in inputs if isinstance(t, str)) > HEAVY_CHARS
        prompts = (self.embedding_prompts(req) if small
                   else await self.run_blocking(self.embedding_prompts, req, heavy=heavy))
        request_id = f"embd-{uuid.uuid4().hex}"
        streams = await self.start(request_id, prompts, arrival)
        finals = await self.collect(request, streams)
        if finals is None:
            return Response(status_code=499)
        data = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                _raise_if_failed(c)
            vector = out.embedding
            if vector is None:
                raise EngineStepError("the engine returned no embedding for this input")
            if dimensions is not None:
                vector = _shorten(vector, dimensions, self.info.normalized)
            value: list[float] | str = vector
            if req.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append(P.EmbeddingData(index=i, embedding=value))
        tokens = sum(len(p.token_ids) for p in prompts)
        return json_response(P.EmbeddingResponse(id=request_id, model=model, data=data,
                                                 usage=P.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    # ------------------------------------------------------------------ /v1/completions
    def completion_prompts(self, req: P.CompletionRequest, structured: StructuredOutputsParams | None = None
                           ) -> list[PromptInfo]:
        """Tokenize and check every prompt (runs in the preprocessing pool)."""
        echo_only = bool(req.echo) and req.max_tokens == 0
        prompts = []
        for prompt in req.prompts():
            text, ids = self.prompt_ids(prompt)
            self.info.check_prompt_length(len(ids))
            if echo_only:  # prompt scoring: one token is generated and dropped, as vLLM does
                max_tokens = 1
            else:
                default = self.info.sampling_defaults.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
                max_tokens = self.resolve_max_tokens(req.max_tokens, default, len(ids), "max_tokens")
            params = self.sampling_params(req, max_tokens, req.logprobs, structured=structured)
            if req.echo and req.logprobs is not None:  # the echoed prompt gets its logprobs too
                params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
            elif req.prompt_logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=req.prompt_logprobs)
            if req.echo and text is None:
                text = self.need_tokenizer("prompt").decode(ids) if self.tokenizer else ""
            prompts.append(PromptInfo(text, ids, params))
        return prompts

    async def completions(self, request: Request) -> Response:
        arrival = time.time()
        self.check_generation()
        req: P.CompletionRequest = await self.parse_body(request, P.CompletionRequest)
        model = self.check_model(req.model)
        include_usage = self.check_stream_options(req)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: must be an integer >= 1 (0 only with echo, to score the prompt)",
                           param="max_tokens")
        self.check_sizes(req)
        self.check_sequences(len(req.prompts()), req.n)
        constraint = self.structured_spec(req)
        if constraint is not None:
            await self.compile_constraint(*constraint)
        spec = constraint[0] if constraint else None
        small = isinstance(req.prompt, str) and len(req.prompt) <= INLINE_PROMPT_CHARS
        heavy = sum(len(p) for p in ([req.prompt] if isinstance(req.prompt, str) else req.prompt)
                    if isinstance(p, str)) > HEAVY_CHARS
        prompts = (self.completion_prompts(req, spec) if small
                   else await self.run_blocking(self.completion_prompts, req, spec, heavy=heavy))
        echo_only = bool(req.echo) and req.max_tokens == 0
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.start(request_id, prompts, arrival)
        created = int(time.time())
        if req.stream:
            return self.sse(self.completion_events(req, model, request_id, created, prompts, streams,
                                                   include_usage, echo_only))
        finals = await self.collect(request, streams)
        if finals is None:
            return Response(status_code=499)
        if logprob_entries(finals, req.logprobs) > LARGE_RESPONSE_ENTRIES:  # (seconds of Python: off the loop)
            return await self.run_blocking(self.completion_response, req, model, request_id, created, prompts,
                                           finals, echo_only)
        return self.completion_response(req, model, request_id, created, prompts, finals, echo_only)

    def completion_response(self, req: P.CompletionRequest, model: str, request_id: str, created: int,
                            prompts: list[PromptInfo], finals: list[RequestOutput], echo_only: bool) -> Response:
        choices = []
        for i, out in enumerate(finals):
            prefix = prompts[i].text if req.echo else ""
            for c in out.outputs:
                _raise_if_failed(c)
                c = _echo_only(c) if echo_only else c
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    echoed = self.echo_logprobs(prompts[i], out) if req.echo else None
                    logprobs, _ = self.completion_logprobs(c.token_ids, c.logprobs, len(prefix), echoed)
                ids = req.return_token_ids
                choices.append(P.CompletionChoice(index=i * req.n + c.index, text=prefix + c.text,
                                                  logprobs=logprobs, finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason,
                                                  prompt_token_ids=prompts[i].token_ids if ids else None,
                                                  token_ids=list(c.token_ids) if ids else None,
                                                  prompt_logprobs=(prompt_logprobs_of(out)
                                                                   if req.prompt_logprobs is not None else None)))
        body = P.CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                    usage=self.usage(prompts, finals, echo_only))
        return Response(dump_in_pieces(body), media_type="application/json")

    @staticmethod
    def usage(prompts: list[PromptInfo], finals: list[RequestOutput], echo_only: bool = False) -> P.UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = 0 if echo_only else sum(len(c.token_ids) for out in finals for c in out.outputs)
        return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)

    @staticmethod
    def sse(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    def _deltas(states: dict[int, ChoiceState], index: int, c: CompletionOutput
                ) -> tuple[ChoiceState, str, slice] | None:
        state = states.setdefault(index, ChoiceState())
        if state.done:
            return None
        text = c.text[state.text_sent:]
        tokens = slice(state.tokens_sent, len(c.token_ids))
        state.text_sent = len(c.text)
        state.tokens_sent = len(c.token_ids)
        state.done = c.finish_reason is not None
        return state, text, tokens

    async def completion_events(self, req: P.CompletionRequest, model: str, request_id: str, created: int,
                                prompts: list[PromptInfo], streams: list[RequestStream], include_usage: bool,
                                echo_only: bool = False) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        finals: dict[int, RequestOutput] = {}
        want_logprobs = req.logprobs is not None
        writer = ChunkWriter("text_completion", request_id, created, model)
        try:
            async for i, out in merge_streams(streams):
                if out.finished:
                    finals[i] = out
                events = []  # one write per engine output
                for c in out.outputs:
                    _raise_if_failed(c)
                    c = _echo_only(c) if echo_only else c
                    index = i * req.n + c.index
                    first = index not in states
                    delta = self._deltas(states, index, c)
                    if delta is None:
                        continue
                    state, text, tokens = delta
                    echoed = None
                    if first and req.echo:
                        text = (prompts[i].text or "") + text
                        state.text_offset = len(prompts[i].text or "")
                        if want_logprobs:
                            echoed = self.echo_logprobs(prompts[i], out)
                    new_tokens = tokens.stop > tokens.start
                    if not text and not ((want_logprobs or req.return_token_ids) and new_tokens) and not state.done:
                        continue
                    logprobs = None
                    if want_logprobs and c.logprobs is not None:
                        logprobs, state.text_offset = self.completion_logprobs(
                            c.token_ids[tokens], c.logprobs[tokens], state.text_offset, echoed)
                    prompt_ids = token_ids = None
                    if req.return_token_ids:
                        token_ids = list(c.token_ids[tokens])
                        if not state.prompt_ids_sent:
                            prompt_ids, state.prompt_ids_sent = prompts[i].token_ids, True
                    if logprobs is None and token_ids is None:
                        events.append(writer.text(index, text, c.finish_reason, c.stop_reason))
                        continue
                    chunk = P.CompletionChunk(id=request_id, created=created, model=model, choices=[
                        P.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                           stop_reason=c.stop_reason, prompt_token_ids=prompt_ids,
                                           token_ids=token_ids)])
                    events.append(f"data: {chunk.model_dump_json()}\n\n")
                if events:
                    yield "".join(events)
            if include_usage:
                chunk = P.CompletionChunk(id=request_id, created=created, model=model, choices=[],
                                          usage=self.usage(prompts, [finals[i] for i in sorted(finals)], echo_only))
                yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream
            yield _error_event(exc)
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ /v1/chat/completions
    @staticmethod
    def check_continue_final_message(req: P.ChatCompletionRequest | P.TokenizeRequest) -> None:
        """vLLM's rules: continue_final_message continues the last message, which must be the assistant's, and
        excludes add_generation_prompt (true by default: the request sends false)."""
        if not req.continue_final_message:
            return
        if req.add_generation_prompt:
            raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
                                "(send add_generation_prompt: false to continue the final message)",
                           param="continue_final_message")
        if req.messages and req.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message continues the final message, which must be the "
                                f"assistant's (it is a {req.messages[-1].role} message)",
                           param="continue_final_message")

    def with_reasoning_effort(self, effort: str, template: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """reasoning_effort as the chat template's variable of that name (as gpt-oss's template reads it), refused
        where the template never reads it: it would change nothing."""
        source = template if template is not None else self.need_tokenizer("messages").chat_template
        if source is None or "reasoning_effort" not in source:
            raise APIError(400, "reasoning_effort: this model's chat template does not read reasoning_effort, so it "
                                "would change nothing; send the request without it", param="reasoning_effort")
        if kwargs.get("reasoning_effort", effort) != effort:
            raise APIError(400, "reasoning_effort is given twice (as a field and in chat_template_kwargs)",
                           param="reasoning_effort")
        return {**kwargs, "reasoning_effort": effort}

    def chat_prompt_ids(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                        chat_template: str | None, template_kwargs: dict[str, Any],
                        tools: list[P.ToolDefinition] | None = None, continue_final_message: bool = False
                        ) -> list[int]:
        """Render the chat template and tokenize (runs in the preprocessing pool)."""
        tokenizer = self.need_tokenizer("messages")
        ids = tokenizer.chat_ids([m.for_template() for m in messages], add_generation_prompt,
                                 chat_template=chat_template,
                                 tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                                 continue_final_message=continue_final_message, **template_kwargs)
        if not ids:
            raise InvalidRequestError("the chat template produced an empty prompt", param="messages")
        return ids

    def chat_request_prompt(self, req: P.ChatCompletionRequest, template: str | None,
                            template_kwargs: dict[str, Any], structured: StructuredOutputsParams | None = None
                            ) -> PromptInfo:
        ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt, template, template_kwargs, req.tools,
                                   req.continue_final_message)
        try:
            self.info.check_prompt_length(len(ids))
        except PromptTooLongError as exc:
            raise PromptTooLongError(str(exc).replace("the prompt has", "the messages make a prompt of"),
                                     param="messages") from None
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(requested, self.info.sampling_defaults.get("max_tokens"), len(ids), param)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, k, rename={"max_tokens": param, "logprobs": "top_logprobs"},
                                      structured=structured)
        if req.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=req.prompt_logprobs)
        return PromptInfo(None, ids, params)

    @staticmethod
    def chat_reply(req: P.ChatCompletionRequest) -> tuple[str, str]:
        """(the reply's role, the text `echo` puts before it), as vLLM has them: the role is the assistant's with
        add_generation_prompt, else the last message's (the reply continues that message); echo repeats the last
        message's content when it has the reply's role."""
        last = req.messages[-1]
        role = "assistant" if req.add_generation_prompt else last.role
        return role, last.text() if req.echo and last.role == role else ""

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.time()
        self.check_generation()
        req: P.ChatCompletionRequest = await self.parse_body(request, P.ChatCompletionRequest)
        result = await self.chat(request, req, arrival)
        if isinstance(result, BaseModel):
            if chat_entries(result) > LARGE_RESPONSE_ENTRIES:
                return Response(await self.run_blocking(dump_in_pieces, result), media_type="application/json")
            return json_response(result)
        if isinstance(result, Response):
            return result
        return self.sse(result)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: through the chat path (atlas/server/responses.py)."""
        arrival = time.time()
        self.check_generation()
        req: R.ResponsesRequest = await self.parse_body(request, R.ResponsesRequest)
        model = self.check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = await self.engine.load_response(req.previous_response_id)
            if history is None:
                raise APIError(400, f"previous_response_id: no stored response {req.previous_response_id!r} (it was "
                                    "made with store: false, or is too old)", param="previous_response_id")
        body, conversation = R.chat_request(req, history)
        try:
            chat_req = P.ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        result = await self.chat(request, chat_req, arrival)
        if isinstance(result, Response):
            return result  # (the client left)
        response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())

        async def keep(message: dict[str, Any]) -> None:
            if req.store is not False:
                await self.engine.store_response(response_id, [*conversation, message])

        if isinstance(result, BaseModel):
            data = result.model_dump()
            choice = data["choices"][0]
            output, message = R.output_of_chat(choice)
            await keep(message)
            status = "incomplete" if choice["finish_reason"] == "length" else "completed"
            return JSONResponse(R.response_object(req, response_id, created, model, output, status, data["usage"]))
        return self.sse(R.translate_stream(result, R.StreamTranslator(req, response_id, created, model), keep))

    async def chat(self, request: Request, req: P.ChatCompletionRequest, arrival: float
                   ) -> P.ChatCompletionResponse | AsyncIterator[str] | Response:
        """A chat request, validated: its response, its stream's SSE lines, or a 499 when the client left
        (also the Responses API's way in)."""
        model = self.check_model(req.model)
        include_usage = self.check_stream_options(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.check_sizes(req)
        self.check_sequences(1, req.n)
        self.check_continue_final_message(req)
        template, template_kwargs = self.template_and_kwargs(req.chat_template, req.chat_template_kwargs)
        if req.reasoning_effort is not None:
            template_kwargs = self.with_reasoning_effort(req.reasoning_effort, template, template_kwargs)
        constraint = self.structured_spec(req)
        tool_parser, tool_spec, tool_mode = await self.tool_plan(req)
        if tool_spec is not None and constraint is not None:
            raise APIError(400, f"{constraint[1]}: tool_choice {tool_mode!r} already constrains the output; give "
                                "one of them", param=constraint[1])
        if constraint is not None:
            await self.compile_constraint(*constraint)
        structured = tool_spec if tool_spec is not None else (constraint[0] if constraint else None)
        reasoning = self.settings.reasoning_parser
        # gpt-oss (harmony): one parser reads reasoning, answer and calls, unless the grammar forces the reply.
        harmony = tool_mode in ("none", "auto") and (reasoning == HARMONY_REASONING
                                                     or self.settings.tool_call_parser == "openai")
        if harmony or (tool_parser is not None and tool_mode == "auto"
                       and TOOL_PARSERS[self.settings.tool_call_parser].needs_special_tokens):
            # The format's markers are special tokens: keep them in the text the parser reads (as vLLM does).
            req = req.model_copy(update={"skip_special_tokens": False})
        prompts = [await self.run_blocking(self.chat_request_prompt, req, template, template_kwargs, structured,
                                           heavy=self.heavy_chat(req))]
        k = prompts[0].params.logprobs
        if reasoning == HARMONY_REASONING:
            reasoning = None

        def choice_parser() -> ChoiceParser:
            tools = tool_parser() if tool_parser is not None else None
            if harmony and not isinstance(tools, HarmonyToolParser):
                tools = HarmonyToolParser(calls=False)
            return ChoiceParser(ReasoningParser(reasoning) if reasoning and not harmony else None, tools,
                                max_calls=1 if req.parallel_tool_calls is False else None)

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start(request_id, prompts, arrival)
        created = int(time.time())
        if req.stream:
            return self.chat_events(req, model, request_id, created, prompts, streams, include_usage, choice_parser,
                                    tool_mode)
        finals = await self.collect(request, streams)
        if finals is None:
            return Response(status_code=499)
        args = (req, model, request_id, created, prompts, finals, choice_parser, tool_mode, k)
        if logprob_entries(finals, k) > LARGE_RESPONSE_ENTRIES:  # (seconds of Python: off the loop)
            return await self.run_blocking(self.chat_response, *args)
        return self.chat_response(*args)

    def chat_response(self, req: P.ChatCompletionRequest, model: str, request_id: str, created: int,
                      prompts: list[PromptInfo], finals: list[RequestOutput], choice_parser: Callable[[], ChoiceParser],
                      tool_mode: str, k: int | None) -> P.ChatCompletionResponse:
        role, echoed = self.chat_reply(req)
        choices = []
        for c in finals[0].outputs:
            _raise_if_failed(c)
            parser = choice_parser()
            parsed = parser.parse(c.text, final=True)
            calls = [call for call in parsed.calls if call.name is not None]
            tool_calls = [P.ToolCall(id=call_id, function=P.FunctionCall(name=call.name, arguments=call.arguments))
                          for call_id, call in zip(parser.call_ids(len(calls)), calls, strict=True)]
            content = echoed + (parsed.content or "") if echoed else parsed.content
            choices.append(P.ChatChoice(
                index=c.index,
                message=P.ChatResponseMessage(role=role, content=content, reasoning_content=parsed.reasoning,
                                              tool_calls=tool_calls),
                logprobs=(self.chat_logprobs(c.token_ids, c.logprobs, k)
                          if k is not None and c.logprobs is not None else None),
                finish_reason=_finish_reason(c.finish_reason, bool(tool_calls), tool_mode), stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None))
        return P.ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                        usage=self.usage(prompts, finals),
                                        prompt_token_ids=prompts[0].token_ids if req.return_token_ids else None,
                                        prompt_logprobs=(prompt_logprobs_of(finals[0])
                                                         if req.prompt_logprobs is not None else None))

    async def chat_events(self, req: P.ChatCompletionRequest, model: str, request_id: str, created: int,
                          prompts: list[PromptInfo], streams: list[RequestStream], include_usage: bool,
                          choice_parser: Callable[[], ChoiceParser] = lambda: ChoiceParser(None, None),
                          tool_mode: str = "none") -> AsyncIterator[str]:
        k = (req.top_logprobs or 0) if req.logprobs else None

        def chunk(choices: list[P.ChatStreamChoice], usage: P.UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            body = P.ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage,
                                         prompt_token_ids=prompt_token_ids)
            return f"data: {body.model_dump_json()}\n\n"

        writer = ChunkWriter("chat.completion.chunk", request_id, created, model)
        states: dict[int, ChoiceState] = {}
        parsers: dict[int, ChoiceParser] = {}
        called: set[int] = set()  # choices that streamed tool calls
        final: RequestOutput | None = None
        role, echoed = self.chat_reply(req)
        try:
            yield chunk([P.ChatStreamChoice(index=j, delta=P.DeltaMessage(role=role, content=""),
                                            token_ids=[] if req.return_token_ids else None) for j in range(req.n)],
                        prompt_token_ids=prompts[0].token_ids if req.return_token_ids else None)
            if echoed:  # (the echoed message: each choice's first content delta, as vLLM streams it)
                yield "".join(chunk([P.ChatStreamChoice(index=j, delta=P.DeltaMessage(content=echoed))])
                              for j in range(req.n))
            async for _, out in merge_streams(streams):
                if out.finished:
                    final = out
                events = []  # one write per engine output
                for c in out.outputs:
                    _raise_if_failed(c)
                    delta = self._deltas(states, c.index, c)
                    if delta is None:
                        continue
                    state, _, tokens = delta
                    parser = parsers.get(c.index) or parsers.setdefault(c.index, choice_parser())
                    reasoning, text, calls = parser.delta(c.text, final=state.done)
                    if calls:
                        called.add(c.index)
                    new_tokens = tokens.stop > tokens.start
                    if (not (text or reasoning or calls) and not ((k is not None or req.return_token_ids) and new_tokens)
                            and not state.done):
                        continue
                    logprobs = None
                    if k is not None and c.logprobs is not None:
                        logprobs = self.chat_logprobs(c.token_ids[tokens], c.logprobs[tokens], k)
                    finish = _finish_reason(c.finish_reason, c.index in called, tool_mode)
                    if logprobs is None and not reasoning and not calls and not req.return_token_ids:
                        events.append(writer.text(c.index, text, finish, c.stop_reason))
                        continue
                    message = P.DeltaMessage(content=text, reasoning_content=reasoning,
                                             tool_calls=[P.DeltaToolCall(**d) for d in calls] or None)
                    events.append(chunk([P.ChatStreamChoice(
                        index=c.index, delta=message, logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids[tokens]) if req.return_token_ids else None)]))
                if events:
                    yield "".join(events)
            if include_usage and final is not None:
                yield chunk([], self.usage(prompts, [final]))
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream
            yield _error_event(exc)
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ small routes
    def model_cards(self) -> list[P.ModelCard]:
        # root is the primary served name: the checkpoint's path on this machine is nobody's business.
        return [P.ModelCard(id=name, root=self.model_name, max_model_len=self.info.max_model_len)
                for name in self.names]

    def models(self) -> P.ModelList:
        return P.ModelList(data=self.model_cards())

    def model(self, model_id: str) -> P.ModelCard:
        for card in self.model_cards():
            if card.id == model_id:
                return card
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {', '.join(self.names)}",
                       param="model", code="model_not_found")

    def tokenize_ids(self, req: P.TokenizeRequest, template: str | None, template_kwargs: dict[str, Any]) -> list[int]:
        if req.messages is not None:
            return self.chat_prompt_ids(req.messages, req.add_generation_prompt, template, template_kwargs, req.tools,
                                        req.continue_final_message)
        return self.need_tokenizer("prompt").encode(req.prompt, add_special_tokens=req.add_special_tokens)

    async def tokenize(self, request: Request) -> P.TokenizeResponse:
        req: P.TokenizeRequest = await self.parse_body(request, P.TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        self.check_sizes(req, must_fit=False)
        self.check_continue_final_message(req)
        template, template_kwargs = self.template_and_kwargs(req.chat_template, req.chat_template_kwargs)
        heavy = (self.heavy_chat(req) if req.messages is not None else len(req.prompt) > HEAVY_CHARS)
        ids = await self.run_blocking(self.tokenize_ids, req, template, template_kwargs, heavy=heavy)
        return P.TokenizeResponse(count=len(ids), max_model_len=self.info.max_model_len, tokens=ids)

    async def detokenize(self, request: Request) -> P.DetokenizeResponse:
        req: P.DetokenizeRequest = await self.parse_body(request, P.DetokenizeRequest)
        self.check_model(req.model)
        self.need_tokenizer("tokens")
        cap = max(self.settings.max_request_list_items, 4 * self.info.max_model_len)
        if len(req.tokens) > cap:
            raise APIError(400, f"tokens: {len(req.tokens):,} ids; this server detokenizes at most {cap:,} at once "
                                "(4 x --max-model-len, or --max-request-list-items)", param="tokens")
        vocab = self.info.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        heavy = len(req.tokens) > HEAVY_CHARS // 4
        text = await self.run_blocking(lambda: self.need_tokenizer("tokens").decode(req.tokens, skip_special_tokens=False),
                                       heavy=heavy)
        return P.DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> P.TokenizerInfoResponse:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError(404, "this server runs without a tokenizer (--skip-tokenizer-init)", code="no_tokenizer")
        return P.TokenizerInfoResponse(**tokenizer.info())


# ---------------------------------------------------------------------------------- the app
_ERRORS = {
    400: "Invalid request (OpenAI error body)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    403: "A web page's Origin that --allowed-origins does not allow",
    408: "The request body stopped arriving (--body-timeout)",
    413: "Request body over --max-request-body-bytes",
    415: "A request body that is not application/json",
    421: "A Host header this server does not answer for (--allowed-hosts)",
    429: "At capacity (--max-waiting-requests); retry after Retry-After seconds",
    500: "Server fault",
    503: "Engine not running, or the server shutting down",
}
# What every route can answer before its handler runs (atlas/server/browsers.py), and what every POST route can.
_ANY_ROUTE = (403, 421)
_POST_ROUTE = (*_ANY_ROUTE, 408, 413, 415)


def _error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": P.ErrorResponse, "description": _ERRORS[code]} for code in codes}


# Request bodies of the POST routes, for /openapi.json (the routes read and check the body themselves).
_REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": P.CompletionRequest,
    "/v1/chat/completions": P.ChatCompletionRequest,
    "/tokenize": P.TokenizeRequest,
    "/detokenize": P.DetokenizeRequest,
    "/v1/responses": R.ResponsesRequest,
}


def _openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies (our routes parse them themselves, so it cannot see them)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, description=app.description,
                         routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in _REQUEST_BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in body.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = schema
    return schema


class DrainGuard:
    """Counts the HTTP requests in flight (/health aside) for the drain at shutdown, and once the drain has begun
    answers new requests 503 (`server_shutting_down`, with Connection: close) instead of starting them."""

    def __init__(self, app: Any, server: OpenAIServer):
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        if self.server.shutting_down:
            error = APIError(503, "the server is shutting down and takes no new requests: send this one to another "
                                  "replica, or again once the server is back", type="server_error",
                             code="server_shutting_down")
            await error.response(headers={"Connection": "close"})(scope, receive, send)
            return
        self.server.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.server.in_flight -= 1


def _add_browser_checks(app: FastAPI, settings: ServerSettings) -> None:
    """Host (421), Origin (403) and Content-Type (415) checks, and CORS when --allowed-origins is given
    (atlas/server/browsers.py). The last middleware added runs first."""
    def error(status: int, message: str, code: str) -> JSONResponse:
        return APIError(status, message, code=code).response()

    hosts = settings.allowed_hosts if settings.allowed_hosts is not None else default_allowed_hosts(settings.bind_host)
    guard = dict(allowed_hosts=hosts, allowed_origins=settings.allowed_origins, error=error,
                 max_drain_bytes=MAX_DRAIN_BYTES)
    if not settings.allowed_origins:
        app.add_middleware(BrowserGuard, **guard)
        return
    app.add_middleware(BrowserGuard, **guard, hosts_and_origins=False)
    app.add_middleware(CORSMiddleware, **cors_options(settings.allowed_origins, settings.allowed_methods,
                                                      settings.allowed_headers, settings.allow_credentials))
    app.add_middleware(BrowserGuard, **guard, content_type=False)


def build_app(engine: AsyncEngine, served_model_names: list[str] | None = None, api_key: str | None = None,
              tokenizer: Tokenizer | None = None, shutdown_engine: bool = True,
              settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app over a started (or startable) AsyncEngine.

    `tokenizer` should be an instance of its own (the engine thread uses the engine's); by default
    one is loaded from the engine's tokenizer path. The engine thread is started on app start-up
    and, with `shutdown_engine`, stopped on app shutdown. `api_key`, if given, overrides settings.api_key.
    """
    settings = settings or ServerSettings()
    if api_key is not None:
        settings = dataclasses.replace(settings, api_key=api_key)
    info = engine.info
    if tokenizer is None and info.tokenizer_path is not None:
        tokenizer = Tokenizer(info.tokenizer_path, chat_template=info.chat_template)
    names = served_model_names or [info.model or "atlas-default"]
    server = OpenAIServer(engine, names, settings, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop = asyncio.get_running_loop()
        engine.start()
        if server.workers is not None and settings.start_preprocess_workers:
            server.workers.start()  # (its start-up runs on in the worker while the server serves)
        yield
        server.close()
        if shutdown_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="Atlas", summary="OpenAI-compatible API of the Atlas engine", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    _add_browser_checks(app, settings)
    app.add_middleware(DrainGuard, server=server)  # (outermost: it counts every request)
    app.openapi = functools.partial(_openapi_schema, app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return APIError(exc.status_code, message, type=kind).response(headers=exc.headers)  # 405 keeps Allow

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

    open_routes = settings.public_metrics_and_docs

    async def respond(request: Request, handler: Callable[[], Awaitable[Any]], auth: bool) -> Response:
        try:
            if auth:
                server.check_auth(request)
            result = await handler()
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            error = to_api_error(exc)
            if error.status < 500:  # (the client's mistake: its reason, for whoever reads the log; 5xx log above)
                logger.info("%s %s -> %d: %s", request.method, request.url.path, error.status, error.message[:500])
            return error.response()
        return json_response(result) if isinstance(result, BaseModel) else result

    def route(handler: Callable[[Request], Awaitable[Any]], auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await respond(request, lambda: handler(request), auth)
        endpoint.__name__ = handler.__name__
        endpoint.__doc__ = handler.__doc__
        return endpoint

    async def completions(request: Request) -> Response:
        """Text completion (OpenAI legacy completions), streamed as server-sent events with `stream: true`."""
        return await server.completions(request)

    async def chat_completions(request: Request) -> Response:
        """Chat completion through the model's chat template, streamed with `stream: true`."""
        return await server.chat_completions(request)

    async def create_response(request: Request) -> Response:
        """OpenAI Responses API: input items, instructions, function tools, text.format, previous_response_id;
        streamed as Responses events with `stream: true`."""
        return await server.responses(request)

    async def list_models(request: Request) -> P.ModelList:
        """The served model names."""
        return server.models()

    async def get_model(request: Request, model_id: str) -> Response:
        """One served model."""
        async def card() -> P.ModelCard:
            return server.model(model_id)
        return await respond(request, card, auth=True)

    async def embeddings(request: Request) -> Response:
        """Embeddings of the inputs (a server started with --runner pooling on an embedding checkpoint)."""
        return await server.embeddings(request)

    async def tokenize(request: Request) -> P.TokenizeResponse:
        """Token ids of a prompt, or of messages through the chat template."""
        return await server.tokenize(request)

    async def detokenize(request: Request) -> P.DetokenizeResponse:
        """Text of token ids."""
        return await server.detokenize(request)

    async def tokenizer_info(request: Request) -> P.TokenizerInfoResponse:
        """The tokenizer's settings, class and chat template (as vLLM's /tokenizer_info)."""
        return server.tokenizer_info()

    async def health(request: Request) -> P.HealthResponse:
        """200 while the engine runs and the server is not shutting down, 503 otherwise."""
        if server.shutting_down:  # (from the drain's start until the listener closes: Server.shutdown in cli.py)
            raise ServerShutdownError("the server is shutting down")
        if not engine.healthy:
            raise EngineDeadError(engine.dead_reason or "the engine is not running")
        return P.HealthResponse()

    async def version(request: Request) -> P.VersionResponse:
        """Atlas's version (as vLLM's /version)."""
        import atlas

        return P.VersionResponse(version=atlas.__version__)

    async def metrics(request: Request) -> Response:
        """Prometheus metrics."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request: Request) -> Response:
        return JSONResponse(app.openapi())

    async def docs(request: Request) -> HTMLResponse:
        return HTMLResponse(docs_page("/openapi.json", "Atlas API"))

    sse = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events ending in "
                                                                              "`data: [DONE]`"}}}
    app.add_api_route("/v1/completions", route(completions), methods=["POST"], response_model=P.CompletionResponse,
                      responses={200: {"content": sse}, **_error_responses(400, 401, 404, *_POST_ROUTE, 429, 500, 503)})
    app.add_api_route("/v1/chat/completions", route(chat_completions), methods=["POST"],
                      response_model=P.ChatCompletionResponse,
                      responses={200: {"content": sse}, **_error_responses(400, 401, 404, *_POST_ROUTE, 429, 500, 503)})
    app.add_api_route("/v1/responses", route(create_response), methods=["POST"],
                      responses={200: {"content": {"application/json": {"schema": {"type": "object"}}, **sse}},
                                 **_error_responses(400, 401, 404, *_POST_ROUTE, 429, 500, 503)})
    app.add_api_route("/v1/embeddings", route(embeddings), methods=["POST"], response_model=P.EmbeddingResponse,
                      responses=_error_responses(400, 401, 404, *_POST_ROUTE, 429, 500, 503))
    app.add_api_route("/v1/models", route(list_models), methods=["GET"], response_model=P.ModelList,
                      responses=_error_responses(401, *_ANY_ROUTE))
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"], response_model=P.ModelCard,
                      responses=_error_responses(401, 404, *_ANY_ROUTE))
    app.add_api_route("/tokenize", route(tokenize), methods=["POST"], response_model=P.TokenizeResponse,
                      responses=_error_responses(400, 401, 404, *_POST_ROUTE))
    app.add_api_route("/detokenize", route(detokenize), methods=["POST"], response_model=P.DetokenizeResponse,
                      responses=_error_responses(400, 401, 404, *_POST_ROUTE))
    app.add_api_route("/tokenizer_info", route(tokenizer_info), methods=["GET"],
                      response_model=P.TokenizerInfoResponse, responses=_error_responses(401, 404, *_ANY_ROUTE))
    app.add_api_route("/health", route(health, auth=False), methods=["GET"], response_model=P.HealthResponse,
                      responses=_error_responses(503, *_ANY_ROUTE))
    app.add_api_route("/health", route(health, auth=False), methods=["HEAD"], operation_id="health_head",
                      response_model=P.HealthResponse, responses=_error_responses(503, *_ANY_ROUTE))  # (load balancers)
    app.add_api_route("/version", route(version, auth=False), methods=["GET"], response_model=P.VersionResponse)
    app.add_api_route("/metrics", route(metrics, auth=not open_routes), methods=["GET"],
                      responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                                 **_error_responses(401, *_ANY_ROUTE)})
    app.add_api_route("/openapi.json", route(openapi, auth=not open_routes), methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/docs", route(docs, auth=not open_routes), methods=["GET"], include_in_schema=False)
    return app
