"""What GET /docs and GET /openapi.json show: the pinned, hash-checked Swagger UI page, and FastAPI's schema
completed with the request bodies and the error answers of each route."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

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
}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
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
