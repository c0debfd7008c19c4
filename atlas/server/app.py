"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI): the app, its middleware and its routes.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending in `data: [DONE]`), POST /v1/responses, POST /v1/embeddings, POST /classify, POST /pooling,
GET /v1/models, GET /v1/models/{id},
GET /health, GET /version, GET /metrics, POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /openapi.json
and GET /docs (not with --disable-fastapi-docs), GET /load (with --enable-server-load-tracking).

Every error a client can cause is answered with OpenAI's body {"error": {"message", "type", "param",
"code"}} and a 4xx status; a server fault is a 5xx with the same body, never a traceback (errors.py). A client
that goes away has its requests aborted (their KV pages are freed at the next step).

One request never holds up the others: the event loop only moves bytes. Decoding the JSON body,
tokenizing and rendering the chat template run in a thread pool (the tokenizer releases the GIL), the
body is capped (413), a request's sequences are capped (prompts x n), and chat templates render in a
sandbox with limits on size and time (atlas/engine/chat_template.py); templates sent by clients are
refused unless the operator trusts them.

Where the rest lives: frontend.py (the state every endpoint shares, its checks, shutdown), settings.py,
bodies.py (request bodies), streaming.py (server-sent events), completions.py, chat.py (with chat_prompts.py,
tool_choice.py, sampling.py, logprobs.py), responses.py, embeddings.py, tokenization.py, docs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from atlas.engine.async_engine import AsyncEngine, EngineDeadError
from atlas.engine.tokenizer import Tokenizer
from atlas.server import protocol as P
from atlas.server.anthropic_messages import Messages, error_body
from atlas.server.bodies import MAX_DRAIN_BYTES, json_response, read_body
from atlas.server.browsers import BrowserGuard, CORSMiddleware, cors_options, default_allowed_hosts
from atlas.server.chat import Chat
from atlas.server.completions import Completions
from atlas.server.docs import ANY_ROUTE, POST_ROUTE, docs_page, error_responses, openapi_schema
from atlas.server.embeddings import Embeddings
from atlas.server.errors import APIError, ServerShutdownError, to_api_error
from atlas.server.frontend import FrontEnd
from atlas.server.responses import ResponseObject, Responses
from atlas.server.scores import Scores
from atlas.server.settings import ServerSettings
from atlas.server.tokenization import Tokenization

logger = logging.getLogger(__name__)


class DrainGuard:
    """Counts the HTTP requests in flight (/health aside) for the drain at shutdown, and once the drain has begun
    answers new requests 503 (`server_shutting_down`, with Connection: close) instead of starting them."""

    def __init__(self, app: Any, server: FrontEnd):
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/ping"):
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


class DirectRoutes:
    """The innermost middleware: the hottest routes (the generation endpoints) go straight to their endpoint function
    from here, past FastAPI's router, dependency solving and exception and telemetry layers: 11 % less front-end CPU
    a short stream (0.81 -> 0.72 ms on a 2-core host), which a burst of new requests waits on in a front end.
    Everything the middleware above does (the drain count, host, origin and content-type checks, CORS) applies as to
    any route; the endpoints answer every error themselves (`respond`), as they do through the router. Their routes
    stay registered with the app, for its OpenAPI schema and for anything this does not take (another method, an
    ASGI server's root_path; --root-path's prefix is taken off the path before this, by RootPath)."""

    def __init__(self, app: Any, routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]]):
        self.app, self.routes = app, routes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        endpoint = (self.routes.get((scope["method"], scope["path"]))
                    if scope["type"] == "http" and not scope.get("root_path") else None)
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)


class RootPath:
    """--root-path (vLLM's, for a server behind a proxy that routes a path prefix to it): the prefix a request's path
    may start with is taken off before anything else reads the path, so that a proxy that strips it and one that
    passes it on both reach the routes; /docs and /openapi.json name the prefixed URLs."""

    def __init__(self, app: Any, root_path: str):
        self.app, self.root = app, root_path

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == self.root or path.startswith(self.root + "/"):
                scope = {**scope, "path": path[len(self.root):] or "/"}
        await self.app(scope, receive, send)


class RequestIdHeader:
    """--enable-request-id-headers (vLLM's): every response carries X-Request-Id, the request's own if it sent
    one, else a new one."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        value = given if given is not None else uuid.uuid4().hex.encode()

        async def with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, with_header)


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
    if tokenizer is None:
        tokenizer = info.load_tokenizer()
    names = served_model_names or [info.model or "atlas-default"]
    server = FrontEnd(engine, names, settings, tokenizer)
    # The endpoints, each over the shared front end (the Responses API answers through the chat endpoint).
    completion_api, chat_api = Completions(server), Chat(server)
    responses_api, embedding_api, tokens_api = Responses(chat_api), Embeddings(server), Tokenization(server)
    scores_api = Scores(embedding_api)
    messages_api = Messages(chat_api)  # (Anthropic's Messages API, through the chat endpoint too)

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
    direct: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]] = {}
    app.add_middleware(DirectRoutes, routes=direct)  # (the first added is the innermost; filled below)
    _add_browser_checks(app, settings)
    app.add_middleware(DrainGuard, server=server)  # (it counts every request)
    if settings.request_id_headers:
        app.add_middleware(RequestIdHeader)
    if settings.root_path:
        app.add_middleware(RootPath, root_path=settings.root_path)  # (outermost: every other reads the path)
    app.openapi = functools.partial(openapi_schema, app)  # type: ignore[method-assign]

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

    def anthropic_route(handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        """A route of Anthropic's API: its failures in Anthropic's error form (the API key also as x-api-key)."""
        async def endpoint(request: Request) -> Response:
            try:
                server.check_auth(request)
                result = await handler(request)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an Anthropic error body
                status, body = error_body(exc)
                if status < 500:
                    logger.info("%s %s -> %d: %s", request.method, request.url.path, status,
                                body["error"]["message"][:500])
                return JSONResponse(body, status_code=status)
            return result if isinstance(result, Response) else JSONResponse(result)
        endpoint.__name__ = handler.__name__
        endpoint.__doc__ = handler.__doc__
        return endpoint

    async def create_message(request: Request) -> Response:
        """Anthropic's Messages API (as vLLM serves it): system, messages with text, tool_use, tool_result and
        thinking blocks, custom tools and tool_choice; streamed as Anthropic's events with `stream: true`."""
        return await messages_api.create(request)

    async def count_message_tokens(request: Request) -> dict[str, int]:
        """Anthropic's messages.count_tokens: the prompt tokens of a Messages request."""
        return await messages_api.count_tokens(request)

    async def completions(request: Request) -> Response:
        """Text completion (OpenAI legacy completions), streamed as server-sent events with `stream: true`."""
        return await completion_api.create(request)

    async def chat_completions(request: Request) -> Response:
        """Chat completion through the model's chat template, streamed with `stream: true`."""
        return await chat_api.create(request)

    async def create_response(request: Request) -> Response:
        """OpenAI Responses API: input items, instructions, function tools, text.format, previous_response_id;
        streamed as Responses events with `stream: true`."""
        return await responses_api.create(request)

    async def list_models(request: Request) -> P.ModelList:
        """The served model names (and, with --enable-lora, the loaded LoRA adapters)."""
        return await server.models()

    async def get_model(request: Request, model_id: str) -> Response:
        """One served model."""
        async def card() -> P.ModelCard:
            return await server.model(model_id)
        return await respond(request, card, auth=True)

    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: serve a PEFT LoRA adapter under a new name (--enable-lora --allow-runtime-lora-updating)."""
        req = await server.parse_body(request, P.LoadLoRAAdapterRequest)
        await server.lora_update("load_lora_adapter", req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: stop serving a LoRA adapter (refused while requests of it are unfinished)."""
        req = await server.parse_body(request, P.UnloadLoRAAdapterRequest)
        await server.lora_update("unload_lora_adapter", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def embeddings(request: Request) -> Response:
        """Embeddings of the inputs (a server started with --runner pooling on an embedding checkpoint)."""
        return await embedding_api.create(request)

    async def classify(request: Request) -> Response:
        """vLLM's: the class probabilities of the inputs (--runner pooling on a *ForSequenceClassification
        checkpoint)."""
        return await embedding_api.classify(request)

    async def pooling(request: Request) -> Response:
        """vLLM's: the raw pooled output of the inputs (--runner pooling: an embedding, or a classifier's logits)."""
        return await embedding_api.pooling(request)

    async def score(request: Request) -> Response:
        """vLLM's: the cosine similarity of text_1's and text_2's embeddings (--runner pooling)."""
        return await scores_api.score(request)

    async def rerank(request: Request) -> Response:
        """vLLM's (Jina / Cohere style): the documents by their embeddings' cosine similarity to the query's
        (--runner pooling)."""
        return await scores_api.rerank(request)

    async def tokenize(request: Request) -> P.TokenizeResponse:
        """Token ids of a prompt, or of messages through the chat template."""
        return await tokens_api.tokenize(request)

    async def detokenize(request: Request) -> P.DetokenizeResponse:
        """Text of token ids."""
        return await tokens_api.detokenize(request)

    async def tokenizer_info(request: Request) -> P.TokenizerInfoResponse:
        """The tokenizer's settings, class and chat template (as vLLM's /tokenizer_info)."""
        return tokens_api.tokenizer_info()

    async def health(request: Request) -> P.HealthResponse:
        """200 while the engine runs and the server is not shutting down, 503 otherwise."""
        if server.shutting_down:  # (from the drain's start until the listener closes: Server.shutdown in cli.py)
            raise ServerShutdownError("the server is shutting down")
        if not engine.healthy:
            raise EngineDeadError(engine.dead_reason or "the engine is not running")
        return P.HealthResponse()

    async def invocations(request: Request) -> Response:
        """SageMaker's (as vLLM serves it): the body goes to the route its fields name: messages -> chat
        completions, prompt -> completions, input -> embeddings (a classifier's: /classify), text_1 and text_2 ->
        /score, query and documents -> /rerank."""
        raw = await read_body(request, settings.max_request_body_bytes, settings.body_timeout)
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        fields = set(body) if isinstance(body, dict) else set()
        if "messages" in fields:
            target = chat_api.create
        elif "prompt" in fields:
            target = completion_api.create
        elif "input" in fields:
            target = embedding_api.classify if info.class_labels is not None else embedding_api.create
        elif {"text_1", "text_2"} <= fields:
            target = scores_api.score
        elif {"query", "documents"} <= fields:
            target = scores_api.rerank
        else:
            raise APIError(400, "/invocations answers a chat (messages), completion (prompt), embedding or "
                                "classification (input), score (text_1, text_2) or rerank (query, documents) "
                                "request; this body has none of those fields")
        replayed = False

        async def receive() -> dict:  # (the body once more for the route; then the client's connection)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await request.receive()

        return await target(Request(request.scope, receive))

    async def load(request: Request) -> P.LoadResponse:
        """vLLM's /load (with --enable-server-load-tracking): the requests this front end is answering (streams until
        they end), this one aside."""
        return P.LoadResponse(server_load=server.in_flight - 1)

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
        return HTMLResponse(docs_page(settings.root_path + "/openapi.json", "Atlas API"))

    sse = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events ending in "
                                                                              "`data: [DONE]`"}}}
    direct[("POST", "/v1/completions")] = completions_endpoint = route(completions)
    direct[("POST", "/v1/chat/completions")] = chat_endpoint = route(chat_completions)
    app.add_api_route("/v1/completions", completions_endpoint, methods=["POST"], response_model=P.CompletionResponse,
                      responses={200: {"content": sse}, **error_responses(400, 401, 404, *POST_ROUTE, 429, 500, 503)})
    app.add_api_route("/v1/chat/completions", chat_endpoint, methods=["POST"], response_model=P.ChatCompletionResponse,
                      responses={200: {"content": sse}, **error_responses(400, 401, 404, *POST_ROUTE, 429, 500, 503)})
    response_events = {"text/event-stream": {"schema": {
        "type": "string", "description": "Responses streaming events (`event:` and `data:` lines, each JSON with its "
                                         "type and sequence_number), ending with response.completed, "
                                         "response.incomplete or response.failed"}}}
    app.add_api_route("/v1/messages", anthropic_route(create_message), methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/messages/count_tokens", anthropic_route(count_message_tokens), methods=["POST"],
                      include_in_schema=False)
    app.add_api_route("/v1/responses", route(create_response), methods=["POST"], response_model=ResponseObject,
                      responses={200: {"content": response_events},
                                 **error_responses(400, 401, 404, *POST_ROUTE, 429, 500, 503)})
    app.add_api_route("/v1/embeddings", route(embeddings), methods=["POST"], response_model=P.EmbeddingResponse,
                      responses=error_responses(400, 401, 404, *POST_ROUTE, 429, 500, 503))
    app.add_api_route("/classify", route(classify), methods=["POST"], response_model=P.ClassificationResponse,
                      responses=error_responses(400, 401, 404, *POST_ROUTE, 429, 500, 503))
    app.add_api_route("/pooling", route(pooling), methods=["POST"], response_model=P.PoolingResponse,
                      responses=error_responses(400, 401, 404, *POST_ROUTE, 429, 500, 503))
    app.add_api_route("/v1/models", route(list_models), methods=["GET"], response_model=P.ModelList,
                      responses=error_responses(401, *ANY_ROUTE))
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"], response_model=P.ModelCard,
                      responses=error_responses(401, 404, *ANY_ROUTE))
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, route(score), methods=["POST"], response_model=P.ScoreResponse,
                          responses=error_responses(400, 401, 404, *POST_ROUTE, 429, 500, 503),
                          operation_id=f"score_{path.strip('/').replace('/', '_')}")
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, route(rerank), methods=["POST"], response_model=P.RerankResponse,
                          responses=error_responses(400, 401, 404, *POST_ROUTE, 429, 500, 503),
                          operation_id=f"rerank_{path.strip('/').replace('/', '_')}")
    lora_ok = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
    app.add_api_route("/v1/load_lora_adapter", route(load_lora_adapter), methods=["POST"],
                      response_class=PlainTextResponse, responses={**lora_ok, **error_responses(400, 401, *POST_ROUTE)})
    app.add_api_route("/v1/unload_lora_adapter", route(unload_lora_adapter), methods=["POST"],
                      response_class=PlainTextResponse, responses={**lora_ok, **error_responses(400, 401, *POST_ROUTE)})
    app.add_api_route("/tokenize", route(tokenize), methods=["POST"], response_model=P.TokenizeResponse,
                      responses=error_responses(400, 401, 404, *POST_ROUTE))
    app.add_api_route("/detokenize", route(detokenize), methods=["POST"], response_model=P.DetokenizeResponse,
                      responses=error_responses(400, 401, 404, *POST_ROUTE))
    app.add_api_route("/tokenizer_info", route(tokenizer_info), methods=["GET"],
                      response_model=P.TokenizerInfoResponse, responses=error_responses(401, 404, *ANY_ROUTE))
    app.add_api_route("/ping", route(health, auth=False), methods=["GET", "POST"], include_in_schema=False)
    app.add_api_route("/invocations", route(invocations), methods=["POST"], include_in_schema=False)
    app.add_api_route("/health", route(health, auth=False), methods=["GET"], response_model=P.HealthResponse,
                      responses=error_responses(503, *ANY_ROUTE))
    app.add_api_route("/health", route(health, auth=False), methods=["HEAD"], operation_id="health_head",
                      response_model=P.HealthResponse, responses=error_responses(503, *ANY_ROUTE))  # (load balancers)
    app.add_api_route("/version", route(version, auth=False), methods=["GET"], response_model=P.VersionResponse)
    if server.settings.server_load_tracking:
        app.add_api_route("/load", route(load, auth=False), methods=["GET"], response_model=P.LoadResponse)
    app.add_api_route("/metrics", route(metrics, auth=not open_routes), methods=["GET"],
                      responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                                 **error_responses(401, *ANY_ROUTE)})
    if server.settings.docs:
        app.add_api_route("/openapi.json", route(openapi, auth=not open_routes), methods=["GET"],
                          include_in_schema=False)
        app.add_api_route("/docs", route(docs, auth=not open_routes), methods=["GET"], include_in_schema=False)
    return app
