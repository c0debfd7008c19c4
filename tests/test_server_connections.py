"""Connections cannot hold the server: a deadline for request headers and between body chunks, caps on open
connections (atlas/server/connections.py), over real sockets."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from serving import start_server

ENGINE = dict(kv_cache_memory="4MiB", max_model_len=128)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Does the server close the connection (EOF) within `seconds`?"""
    sock.settimeout(seconds)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.fixture(scope="module")
def server(qwen3_dir):
    srv = start_server(str(qwen3_dir), settings={"header_timeout": 0.5, "body_timeout": 0.5, "max_connections": 8},
                       **ENGINE)
    yield srv
    srv.stop()


def test_slow_headers_are_cut(server):
    sock = _connect(server.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # (and nothing more)
    t0 = time.monotonic()
    assert _closed_within(sock, 5)
    assert time.monotonic() - t0 < 3
    sock.close()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_stalled_body_gets_408(server):
    sock = _connect(server.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    sock.settimeout(5)
    answer = b""
    while b"--body-timeout" not in answer:
        try:
            piece = sock.recv(4096)
        except TimeoutError:
            break
        if not piece:
            break
        answer += piece
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--body-timeout" in answer


def test_connections_past_the_caps_are_closed(qwen3_dir):
    capped = start_server(str(qwen3_dir), settings={"max_connections": 8, "max_connections_per_client": 6}, **ENGINE)
    try:
        idle = [_connect(capped.url) for _ in range(6)]
        try:
            extra = _connect(capped.url)
            assert _closed_within(extra, 3)  # (the 7th from this address: closed at once, header deadline 10 s)
            extra.close()
        finally:
            for sock in idle:
                sock.close()
        assert wait_closed_then_ok(capped.url)
    finally:
        capped.stop()
    total = start_server(str(qwen3_dir), settings={"max_connections": 4}, **ENGINE)
    try:
        idle = [_connect(total.url) for _ in range(4)]
        try:
            extra = _connect(total.url)
            assert _closed_within(extra, 3)
            extra.close()
        finally:
            for sock in idle:
                sock.close()
        assert wait_closed_then_ok(total.url)
    finally:
        total.stop()


def wait_closed_then_ok(url: str) -> bool:
    """Once the idle connections are gone, a new client is served."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            time.sleep(0.1)
    return False


def test_keep_alive_requests_each_get_a_header_deadline(server):
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for _ in range(3):  # (one connection, several requests, each well inside the deadline)
            assert http.get("/health").status_code == 200
            time.sleep(0.2)
