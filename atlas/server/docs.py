"""What GET /docs and GET /openapi.json show: the pinned, hash-checked Swagger UI page, and FastAPI's schema
completed with the request bodies and the error answers of each route."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from atlas.engine.chat_template import RESERVED_KWARGS
from atlas.server import protocol as P
from atlas.server import responses as R

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


# The answers other than 200 a route may give, for /openapi.json.
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
ANY_ROUTE = (403, 421)
POST_ROUTE = (*ANY_ROUTE, 408, 413, 415)


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": P.ErrorResponse, "description": _ERRORS[code]} for code in codes}


# Request bodies of the POST routes, for /openapi.json (the routes read and check the body themselves).
_REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": P.CompletionRequest,
    "/v1/chat/completions": P.ChatCompletionRequest,
    "/tokenize": P.TokenizeRequest,
    "/detokenize": P.DetokenizeRequest,
    "/v1/responses": R.ResponsesRequest,
    "/v1/embeddings": P.EmbeddingRequest,
    "/classify": P.ClassificationRequest,
    "/pooling": P.PoolingRequest,
}

# What each event of a stream holds (`data: ` and this JSON; the stream ends with `data: [DONE]`): a chunk, or the
# error that ended the stream. /openapi.json gives it as the text/event-stream content's x-event-schema.
_STREAM_CHUNKS: dict[str, type[BaseModel]] = {
    "/v1/completions": P.CompletionChunk,
    "/v1/chat/completions": P.ChatCompletionChunk,
}


def _this_server(components: dict[str, Any], server: Any) -> None:
    """What the request schemas say that depends on this server: token ids below its model's vocabulary, the fields
    it does not implement (their empty values only, where the request model does not declare them), n (at most
    --max-sequences-per-request), logprobs (at most --max-logprobs), priority (only with --scheduling-policy priority), chat templates from requests
    (only with --trust-request-chat-template), reasoning_effort (only where the model's chat template reads it) and
    tool_choice "auto", the default with tools (only with --enable-auto-tool-choice)."""
    vocab = server.info.vocab_size if server is not None else None

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.pop(P.TOKEN_ID_MARK, False) and vocab:
                node["maximum"] = vocab - 1
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(components)
    for model in _REQUEST_BODIES.values():
        properties = components[model.__name__]["properties"]
        if model.model_config.get("extra") != "forbid":
            for name, harmless in P.UNSUPPORTED_FIELD_SCHEMAS.items():
                properties.setdefault(name, harmless)
    if server is None:
        return
    settings = server.settings
    for model in (P.CompletionRequest, P.ChatCompletionRequest):  # (n: at most --max-sequences-per-request)
        for name in ("n", "best_of"):
            field = components[model.__name__]["properties"][name]
            field["maximum"] = min(field["maximum"], settings.max_sequences_per_request)
    limit = server.info.max_logprobs  # (--max-logprobs)
    for model, names in ((P.CompletionRequest, ("logprobs", "prompt_logprobs")),
                         (P.ChatCompletionRequest, ("top_logprobs", "prompt_logprobs"))):
        for name in names:
            components[model.__name__]["properties"][name]["maximum"] = limit
    if not server.info.priority_scheduling:
        for model in (P.CompletionRequest, P.ChatCompletionRequest):
            components[model.__name__]["properties"]["priority"] = {
                "enum": [0, None], "description": "0: this engine schedules first come, first served (a priority "
                                                  "needs --scheduling-policy priority)"}
    for model in (P.ChatCompletionRequest, P.TokenizeRequest):
        properties = components[model.__name__]["properties"]
        reserved, kwargs = list(RESERVED_KWARGS), {"type": ["object", "null"]}
        if settings.trust_request_chat_template:  # (a template in chat_template_kwargs: the same as the field)
            kwargs["properties"] = {"chat_template": {"type": "string"}}
        else:
            properties["chat_template"] = {"type": "null", "description": "this server renders the model's own chat "
                                           "template (--trust-request-chat-template allows one in the request)"}
            reserved.append("chat_template")
        properties["chat_template_kwargs"] = {**kwargs, "propertyNames": {"not": {"enum": reserved}}}
    template = server.tokenizer.chat_template if server.tokenizer is not None else None
    chat = components[P.ChatCompletionRequest.__name__]
    responses = components[R.ResponsesRequest.__name__]
    if template is None or "reasoning_effort" not in template:
        chat["properties"]["reasoning_effort"] = {"type": "null", "description": "this model's chat template does "
                                                 "not read reasoning_effort"}
        responses["properties"]["reasoning"]["properties"]["effort"] = {"type": "null"}
    if not settings.enable_auto_tool_choice:  # with tools, tool_choice must be given, and not "auto"
        chat["allOf"] = P.chat_rules(auto_tool_choice=False)
        responses["allOf"] = R.request_rules(auto_tool_choice=False)


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies (our routes parse them themselves, so it cannot see them), with
    what this server takes (_this_server)."""
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
    for path, chunk in _STREAM_CHUNKS.items():
        body = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in body.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components[chunk.__name__] = body
        events = schema["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
        events["x-event-schema"] = {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                              {"$ref": "#/components/schemas/ErrorResponse"}]}
    server = getattr(app.state, "server", None)
    _this_server(components, server)
    if server is not None and server.settings.root_path:  # (--root-path: the URLs clients reach the routes at)
        schema["servers"] = [{"url": server.settings.root_path}]
    schema = json.loads(json.dumps(schema))  # (its own copy of the module-level schemas it names)
    app.openapi_schema = schema
    return schema
