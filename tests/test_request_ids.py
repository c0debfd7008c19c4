"""A client's X-Request-Id names its request (vLLM's): the response's id carries it, streamed and whole, on the
completion, chat and embedding routes; with --enable-request-id-headers every response carries the header (the
client's, else a new one); a malformed one is a 400; and a second request in flight under the same id is refused
without disturbing the first."""

from __future__ import annotations

import httpx
import pytest
from serving import start_server

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server():
    srv = start_server(None, kv_cache_memory="32MiB", max_model_len=256, settings=dict(request_id_headers=True))
    yield srv
    srv.stop()


def test_the_clients_id_names_the_request_and_comes_back(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        reply = http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-42"})
        assert reply.json()["id"] == "chatcmpl-trace-42" and reply.headers["x-request-id"] == "trace-42"
        text = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True},
                         headers={"X-Request-Id": "s-1"})
        assert text.headers["x-request-id"] == "s-1" and '"id":"cmpl-s-1"' in text.text.replace(" ", "")
        plain = http.post("/v1/chat/completions", json=CHAT)
        assert len(plain.headers["x-request-id"]) == 32 and plain.json()["id"].startswith("chatcmpl-")
        assert http.get("/health").headers["x-request-id"]
        bad = http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "x" * 300})
        assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]


def test_one_id_in_flight_at_a_time(server):
    """The second request under an id still running gets a 400 naming it; the first finishes."""
    body = {"prompt": "a", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "same"}) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # (the first is running)
        second = http.post("/v1/completions", json={"prompt": "b", "max_tokens": 1}, headers={"X-Request-Id": "same"})
        rest = [line for line in lines if line.startswith("data: ")]
    assert second.status_code == 400 and "already in use" in second.json()["error"]["message"]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2].replace(" ", "")
