"""What keeps web pages from driving the server: Host, Origin and Content-Type checks, and CORS.

A server on 127.0.0.1 without an API key is reachable by every web page its user opens: a page can send a
POST that needs no CORS preflight (a "simple request": Content-Type text/plain, form-encoded or none), and
with DNS rebinding (a name the attacker controls, re-pointed at 127.0.0.1) the browser even lets the page
read the replies, since it thinks it talks to the page's own origin. Three checks close this, in order:

1. Host (421): the request's Host must be one the server answers for. A rebinding page's requests carry
   the attacker's name, so they are refused. Default: the bound address, localhost and the loopback
   addresses; every Host when bound to all interfaces (the operator exposed the server to the network,
   and proxies and cluster DNS reach it under names we cannot guess); `--allowed-hosts` overrides.
2. Origin (403): a request that carries an Origin (browsers send it on every cross-origin request and every
   POST) is served only if that origin is allowed by `--allowed-origins`, or is the server's own origin under
   a Host that is named (not only let in by a wildcard) or an IP address. Non-browser clients send no Origin.
3. Content-Type (415): a POST body must be application/json. A missing Content-Type is read as JSON (as
   FastAPI does; `requests.post(data=json.dumps(...))` sends none); a browser cannot send one cross-site
   without an Origin, which check 2 refuses.

CORS itself (Starlette's CORSMiddleware) is off unless `--allowed-origins` is given (vLLM's flag names).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ALL_INTERFACES = ("0.0.0.0", "::", "")
# Methods whose body is read as the request's JSON.
BODY_METHODS = ("POST", "PUT", "PATCH")


def parse_list(values: str | Iterable[str] | None, flag: str) -> tuple[str, ...] | None:
    """A list flag's values: each a JSON list (vLLM's form, e.g. '["https://a.example"]'), a JSON string, or
    comma-separated; the flag may be repeated. None stays None (the flag was not given)."""
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        value = value.strip()
        if value.startswith(("[", '"')):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{flag}: {value!r} is not a JSON list ({exc.msg})") from None
            items = [parsed] if isinstance(parsed, str) else parsed
            if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
                raise ValueError(f"{flag}: expected a JSON list of strings, got {value!r}")
        else:
            items = value.split(",")
        out.extend(item.strip() for item in items if item.strip())
    return tuple(out)


def host_name(host: str) -> str:
    """A Host header (or an address) without its port and IPv6 brackets, lower-case."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """The Host names a server bound to `bind_host` answers for when --allowed-hosts is not given."""
    if host_name(bind_host) in ALL_INTERFACES:
        return ("*",)
    return tuple(dict.fromkeys((host_name(bind_host), *LOOPBACK_NAMES)))


class BrowserGuard:
    """ASGI middleware: the Host (421), Origin (403) and Content-Type (415) checks of this module's docstring.
    `error(status, message, code)` builds the (ASGI) error response."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str], allowed_origins: Iterable[str],
                 error, max_drain_bytes: int = 64 * 2**20, hosts_and_origins: bool = True,
                 content_type: bool = True) -> None:
        self.app = app
        # With CORS on, two instances: Host and Origin outside CORSMiddleware, Content-Type inside it (so that
        # an allowed page can read its 415).
        self.check_hosts_and_origins, self.check_content_type = hosts_and_origins, content_type
        hosts = {host_name(h) for h in allowed_hosts}
        self.any_host = "*" in hosts
        self.hosts = hosts - {"*"}
        origins = {o.rstrip("/") for o in allowed_origins}
        self.any_origin = "*" in origins
        self.origins = origins - {"*"}
        self.error = error
        self.max_drain_bytes = max_drain_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
        response = self.check(scope["method"], headers)
        if response is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] in BODY_METHODS:  # read what the client sends, so that it reads the answer
            await self._drain(receive)
        await response(scope, receive, send)

    def check(self, method: str, headers: dict[str, str]):
        if self.check_hosts_and_origins:
            response = self.check_host_and_origin(headers)
            if response is not None:
                return response
        if self.check_content_type and method in BODY_METHODS:
            content_type = headers.get("content-type")
            if content_type is not None and content_type.partition(";")[0].strip().lower() != "application/json":
                return self.error(415, f"the request body must be JSON: send the header 'Content-Type: "
                                       f"application/json' (got {content_type!r})", "unsupported_media_type")
        return None

    def check_host_and_origin(self, headers: dict[str, str]):
        host = headers.get("host")
        name = host_name(host) if host is not None else None
        if name is not None and not self.any_host and name not in self.hosts:
            return self.error(421, f"this server does not answer for the host {name!r} (the request's Host "
                                   "header); the operator can allow it with --allowed-hosts", "misdirected_request")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin.strip(), host, name):
            return self.error(403, f"requests from the web origin {origin!r} are not allowed (browsers send the "
                                   "Origin header); the operator can allow it with --allowed-origins",
                              "origin_not_allowed")
        return None

    def origin_allowed(self, origin: str, host: str | None, name: str | None) -> bool:
        if self.any_origin or origin.rstrip("/") in self.origins:
            return True
        # The server's own origin (a page it served, e.g. /docs), under a Host that is named or an address:
        # never a rebinding attacker's name let in by a wildcard.
        parts = urlsplit(origin)
        if host is None or name is None or parts.scheme not in ("http", "https"):
            return False
        return parts.netloc.lower() == host.strip().lower() and (name in self.hosts or _is_ip(name))

    async def _drain(self, receive: Receive) -> None:
        drained = 0
        while drained <= self.max_drain_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def cors_options(allowed_origins: Iterable[str], allowed_methods: Iterable[str], allowed_headers: Iterable[str],
                 allow_credentials: bool) -> dict:
    """CORSMiddleware's keyword arguments."""
    return dict(allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                allow_headers=list(allowed_headers), allow_credentials=allow_credentials)


__all__ = ["BrowserGuard", "CORSMiddleware", "cors_options", "default_allowed_hosts", "host_name", "parse_list"]
