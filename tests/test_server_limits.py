"""Per-request work is bounded before it is done: lists past --max-request-list-items and prompts that could
not fit in the context are 400s naming the limit, and the tokenizer never sees them."""

from __future__ import annotations

import time

import httpx
import pytest
from serving import assert_error, start_server

CAP = 8


@pytest.fixture(scope="module")
def server():
    srv = start_server(None, kv_cache_memory="16MiB", max_model_len=64,
                       settings=dict(max_request_list_items=CAP, max_prompt_chars_per_token=64))
    yield srv
    srv.stop()


@pytest.fixture()
def encodes(server, monkeypatch):
    """The texts Atlas's tokenizers (the server's and the engine's) were asked to encode during the test."""
    from atlas.engine.tokenizer import Tokenizer

    seen: list[str] = []
    real = Tokenizer.encode

    def counting(self, text, *args, **kwargs):
        seen.append(text)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", counting)
    return seen


def test_lists_past_the_limit_are_refused_naming_the_flag(server, encodes):
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(CAP + 1)]
    user = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, param in (
                ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(CAP + 1))}, "stop_token_ids"),
                ("/v1/completions", {"prompt": "x", "stop": ["a"] * (CAP + 1)}, "stop"),
                ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(CAP + 1)}}, "logit_bias"),
                ("/v1/completions", {"prompt": ["x"] * (CAP + 1)}, "prompt"),
                ("/v1/chat/completions", {"messages": user * (CAP + 1)}, "messages"),
                ("/v1/chat/completions", {"messages": user, "tools": tools, "tool_choice": "none"}, "tools"),
                ("/tokenize", {"messages": user * (CAP + 1)}, "messages")):
            err = assert_error(http.post(path, json={"max_tokens": 2, **body}), 400, param=param)
            assert "--max-request-list-items" in err["message"]
        err = assert_error(http.post("/detokenize", json={"tokens": [1] * (4 * 64 + 1)}), 400, param="tokens")
        assert "at most 256" in err["message"]
        assert http.post("/detokenize", json={"tokens": [1] * (4 * 64)}).status_code == 200
        ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop_token_ids": list(range(CAP))})
        assert ok.status_code == 200
    assert encodes == ["x"]  # (only the request within its limits was tokenized)


def test_a_prompt_that_could_not_fit_is_refused_before_it_is_tokenized(server, encodes):
    huge = "word " * (64 * 64 // 5 + 1)  # more than 64 characters per token of a 64-token context
    with httpx.Client(base_url=server.url, timeout=60) as http:
        err = assert_error(http.post("/v1/completions", json={"prompt": huge, "max_tokens": 2}), 400, param="prompt")
        assert "--max-model-len" in err["message"] and "--max-prompt-chars-per-token" in err["message"]
        err = assert_error(http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": huge}], "max_tokens": 2}), 400, param="messages")
        assert_error(http.post("/v1/completions", json={"prompt": [1] * 65, "max_tokens": 2}), 400, param="prompt")
        assert http.post("/v1/completions", json={"prompt": "word " * 20, "max_tokens": 2}).status_code == 200
    assert encodes == ["word " * 20]


def test_past_the_waiting_bound_new_requests_get_429_with_retry_after():
    """--max-num-seqs 1 and --max-waiting-requests 1: with one request running and one waiting, a third gets 429
    and Retry-After at once; once they end, requests are served again."""
    import threading

    srv = start_server(None, kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=1,
                       settings=dict(max_waiting_requests=1))
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            # (the running request is long, so that it still runs when the third comes; the waiting one, once its
            # turn comes, need not be)
            long = {"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
            short = {**long, "max_tokens": 2}
            codes: list[int] = []
            busy = [threading.Thread(target=lambda b=body: codes.append(http.post("/v1/completions", json=b).status_code))
                    for body in (long, short)]
            deadline = time.monotonic() + 30
            for n, t in enumerate(busy, 1):
                t.start()
                while srv.engine.num_streams < n and time.monotonic() < deadline:
                    time.sleep(0.01)
            resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            err = assert_error(resp, 429, code="too_many_requests")
            assert resp.headers["Retry-After"] == "1" and "--max-waiting-requests" in err["message"]
            for t in busy:
                t.join()
            assert codes == [200, 200]
            assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()
