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
        assert wait_closed_then_ok(capped.url)  # (the 7th was closed; a new one once the others are gone)
    finally:
        capped.stop()
    total = start_server(str(qwen3_dir), settings={"max_connections": 4}, **ENGINE)
    try:
        idle = [_connect(total.url) for _ in range(4)]
        try:
            time.sleep(0.05)
            # Past the total cap the oldest idle connection makes room: the new client is served.
            with httpx.Client(base_url=total.url, timeout=10) as http:
                assert http.get("/health").status_code == 200
            assert _closed_within(idle[0], 3)
        finally:
            for sock in idle:
                sock.close()
    finally:
        total.stop()


def test_an_idle_flood_under_a_1024_descriptor_limit_does_not_shut_out_a_new_client(qwen3_dir):
    """1,100 idle connections to `atlas serve` running under a 1,024-descriptor limit: a new client is served at once
    (the cap follows the limit, and idle connections make room)."""
    import re
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip("this process cannot open 1,100 connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    proc = subprocess.Popen([sys.executable, "-m", "atlas.cli", "serve", "--model", str(qwen3_dir), "--port", "0",
                             "--kv-cache-memory", "4MiB", "--max-model-len", "128", "--no-access-log"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limited)
    idle: list[socket.socket] = []
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None
        import threading

        threading.Thread(target=proc.stdout.read, daemon=True).start()  # (a full pipe would block the server)
        deadline = time.monotonic() + 60
        while not _healthy(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(1100):
            idle.append(_connect(url))
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - t0 < 5
    finally:
        for sock in idle:
            sock.close()
        proc.terminate()
        proc.wait(30)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


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


def test_the_web_stack_names_what_the_front_ends_run_on(monkeypatch):
    """uvloop and httptools where installed (the server extra brings both; uvicorn picks them), else asyncio and h11,
    which `atlas serve` warns about; guarded_protocol takes the same protocol."""
    import importlib.util

    from atlas.server.connections import ConnectionLimits, guarded_protocol, web_stack

    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    assert web_stack() == ("uvloop", "httptools")
    limits = ConnectionLimits(5.0, 100, 10)
    assert "HttpTools" in guarded_protocol(limits).__mro__[1].__name__
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("uvloop", "httptools") else real(name, *a))
    assert web_stack() == ("asyncio", "h11")
