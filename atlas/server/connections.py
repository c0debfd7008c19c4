"""Connections that cannot hold the server: a deadline for each request's headers, caps on open connections in
all and per client address, and the process's file-descriptor limit raised to what the system allows.

uvicorn closes idle keep-alive connections (--timeout-keep-alive) but lets a connection that sends its headers a
byte at a time stay forever, and accepts connections until the process runs out of descriptors, which shuts
every other client out. The protocol class here (uvicorn's httptools or h11 protocol with a few additions) closes a
connection whose request headers are not complete within --header-timeout; past --max-connections (lowered to
what the open-file limit leaves) the oldest idle connection makes room for a new one, and past
--max-connections-per-client the new one is closed; all quietly (a debug line, not a warning per connection). Bodies get their own deadline
between chunks in the app (--body-timeout).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass
class ConnectionLimits:
    header_timeout: float = 10.0  # seconds from a connection (or the end of its last response) to complete headers
    max_connections: int = 4096  # open connections in all (0: no cap)
    max_connections_per_client: int = 0  # from one client address (0: no cap; a proxy in front is one address)


def connection_cap(configured: int, reserve: int = 128) -> int:
    """--max-connections, lowered to what the open-file limit leaves (less `reserve` for the process's own
    files), so that the cap, not a failing accept(), decides; 0 stays 0 (no cap)."""
    try:
        import resource
    except ImportError:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    room = max(16, soft - reserve)
    return min(configured, room) if configured else room


def raise_open_file_limit() -> tuple[int, int] | None:
    """Soft RLIMIT_NOFILE up to the hard limit (as vLLM does). -> (old, new), or None where there is none."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return None
        return soft, target
    return soft, soft


def web_stack() -> tuple[str, str]:
    """(event loop, HTTP protocol) the front ends run on: uvloop and httptools where installed (uvicorn's own
    choice with loop="auto", and guarded_protocol's), else asyncio's loop and h11."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return loop, http


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the header deadline and the connection caps of `limits`: its httptools protocol
    where httptools is installed (as uvicorn itself prefers; `uvicorn[standard]` brings it), else its h11 protocol.
    (A streamed token cost a front end about 52 us of CPU with httptools against 76-79 us with h11: BENCHMARKS.md
    section 4.)"""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # (httptools missing)
        return _guarded(limits, _H11Guards)
    return _guarded(limits, type("HttpToolsGuards", (_HttpToolsGuards, HttpToolsProtocol), {}))


class _H11Guards(H11Protocol):
    """What the guards ask of a connection, in h11's terms: h11 is IDLE until a request's headers are complete."""

    def _awaiting_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE


class _HttpToolsGuards:
    """The same from httptools' callbacks: headers complete, and the response that ends the request."""

    _headers_in = False

    def _awaiting_headers(self) -> bool:
        return not self._headers_in

    def on_headers_complete(self) -> None:
        self._headers_in = True
        super().on_headers_complete()  # type: ignore[misc]

    def on_response_complete(self) -> None:
        self._headers_in = False
        super().on_response_complete()  # type: ignore[misc]


def _guarded(limits: ConnectionLimits, base: type) -> type[asyncio.Protocol]:
    per_client: Counter = Counter()
    # The order connections opened in (a count: uvloop's clock moves once a loop iteration, in milliseconds, so
    # connections accepted together would share a time and "the oldest" would be any of them)
    opened = itertools.count()

    class GuardedProtocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._opened = next(opened)
            self._address = self.client[0] if self.client else None
            per_client[self._address] += 1
            over_client = (limits.max_connections_per_client and self._address is not None
                           and per_client[self._address] > limits.max_connections_per_client)
            over_total = limits.max_connections and len(self.connections) > limits.max_connections
            # Past the total cap an idle connection (no request under way) makes room, the oldest first: a flood of
            # idle connections cannot shut a new client out. Past a client's own cap, its new connection goes.
            if over_client or (over_total and not self._evict_idle()):
                logger.debug("connection from %s closed: %s", self._address,
                             "--max-connections-per-client" if over_client else "--max-connections")
                transport.close()
                return
            self._arm()

        def _evict_idle(self) -> bool:
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedProtocol)
                    and c._awaiting_headers() and not c.transport.is_closing()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c._opened)
            logger.debug("idle connection from %s closed to make room (--max-connections)", oldest._address)
            oldest.transport.close()
            return True

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            per_client[self._address] -= 1
            if per_client[self._address] <= 0:
                del per_client[self._address]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._awaiting_headers():  # (the request's headers are in)
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # (the next request on this connection has its own deadline)

        def _arm(self) -> None:
            self._disarm()
            if limits.header_timeout > 0:
                self._header_timer = self.loop.call_later(limits.header_timeout, self._headers_late)

        def _disarm(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._awaiting_headers() and not self.transport.is_closing():
                logger.debug("connection from %s closed: no complete request headers within %g s (--header-timeout)",
                             self._address, limits.header_timeout)
                self.transport.close()

    return GuardedProtocol
