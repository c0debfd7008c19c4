"""SageMaker's routes, as vLLM serves them: GET/POST /ping is /health, and POST /invocations answers a body as the
route its fields name would (chat, completion, embedding; an unknown shape is a 400), streaming included."""

from __future__ import annotations

import httpx
import pytest
from serving import start_server

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": "def f(", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    srv = start_server(None, kv_cache_memory="32MiB", max_model_len=256)
    yield srv
    srv.stop()


def test_ping_and_invocations_answer_as_their_routes(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
        for body, route in ((CHAT, "/v1/chat/completions"), (COMPLETION, "/v1/completions")):
            via, direct = http.post("/invocations", json=body).json(), http.post(route, json=body).json()
            assert via["object"] == direct["object"] and via["choices"] == direct["choices"]
        streamed = http.post("/invocations", json={**COMPLETION, "stream": True}).text
        assert streamed.rstrip().endswith("data: [DONE]")
        refused = http.post("/invocations", json={"input": "x"})  # (embeddings on a generating server)
        assert refused.status_code == 400 and "--runner pooling" in refused.json()["error"]["message"]
        unknown = http.post("/invocations", json={"hello": 1})
        assert unknown.status_code == 400 and "messages" in unknown.json()["error"]["message"]
