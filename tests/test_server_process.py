"""`atlas serve`'s process layout: the engine in a process of its own, N HTTP front ends, and the faults
between them (issue: the engine core in its own process). Each test runs the real command."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from openai import AsyncOpenAI
from serving import Serve, wait_until

from atlas import LLM, SamplingParams


@pytest.fixture(scope="module", params=[1, 2], ids=["1-front-end", "2-front-ends"])
def served(request, qwen3_dir):
    server = Serve(str(qwen3_dir), "--api-server-count", str(request.param))
    yield server
    server.close()


def _children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


def test_engine_and_front_ends_are_separate_processes(served):
    """The engine runs in a process of its own, a child of `atlas serve` beside the front ends (not one of them).
    `atlas serve` itself, which forks every front end (a restarted one later), holds the front ends' imports
    (transformers' tokenizers, the web app) and runs one OS thread, so that each fork is a safe copy."""
    assert len(served.front_end_pids) == served.count
    pids = {served.proc.pid, served.engine_pid, *served.front_end_pids}
    assert len(pids) == 2 + served.count
    children = _children(served.proc.pid)
    assert {served.engine_pid, *served.front_end_pids} <= children
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    assert os.listdir(f"/proc/{served.proc.pid}/task") == [str(served.proc.pid)]
    with open(f"/proc/{served.proc.pid}/maps") as f:
        assert "tokenizers" in f.read()  # (the tokenizers library's shared object, loaded before the forks)


def _accepted_connections(pids: list[int], port: int) -> dict[int, int]:
    """pid -> established connections to `port` that the process holds (from /proc: socket inodes)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].split(":")[1], 16), fields[3], fields[9]
            if local_port == port and state == "01":  # (TCP_ESTABLISHED)
                inodes.add(f"socket:[{inode}]")
    counts = {}
    for pid in pids:
        fds = os.listdir(f"/proc/{pid}/fd")
        counts[pid] = sum(1 for fd in fds if _readlink(f"/proc/{pid}/fd/{fd}") in inodes)
    return counts


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def test_connections_made_at_once_spread_over_the_front_ends(served):
    """64 connections opened in a burst: each front end accepts a fair share (a shared listening socket gave one
    front end all of them, or 51 of 64)."""
    port = int(served.url.rsplit(":", 1)[1])
    conns = []
    try:
        for _ in range(64):
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
            conn.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            conns.append(conn)
        for conn in conns:
            assert conn.recv(64).startswith(b"HTTP/1.1 200")  # (accepted and answered: it has its front end)
        counts = _accepted_connections(served.front_end_pids, port)
        assert sum(counts.values()) == 64, counts
        assert min(counts.values()) >= 64 // (2 * served.count), counts
    finally:
        for conn in conns:
            conn.close()


def test_concurrent_greedy_streams_equal_offline(served, qwen3_dir):
    """Concurrent streams (spread over every front end) produce exactly the offline engine's greedy tokens."""
    prompts = [[5 + i, 6, 7, 8 + i, 9] for i in range(8)]
    expected = LLM(str(qwen3_dir), kv_cache_memory="4MiB", max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))

    async def one(client: AsyncOpenAI, prompt: list[int]) -> tuple[str, int]:
        stream = await client.completions.create(model=str(qwen3_dir), prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        text, tokens = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens

    async def main():
        # (a client per request: each its own connection, so the kernel spreads them over the front ends)
        clients = [AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0) for _ in prompts]
        try:
            return await asyncio.gather(*(one(c, p) for c, p in zip(clients, prompts, strict=True)))
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    for (text, tokens), ref in zip(results, expected, strict=True):
        assert tokens == 12
        assert text == ref.outputs[0].text
    assert wait_until(lambda: served.metric("atlas_kv_cache_pages_free") == served.metric(
        "atlas_kv_cache_pages_total"), timeout=10)


def test_a_stalled_client_does_not_slow_another(served):
    """A client that stops reading its stream holds nothing up: another client's stream runs to its end."""
    body = json.dumps({"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    stalled = socket.create_connection((host, int(port)))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_until(lambda: served.metric("atlas_num_requests_running") >= 1, timeout=20)
        # (never read from `stalled` again)
        with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                          json={"prompt": "x = ", "max_tokens": 100, "ignore_eos": True, "stream": True}) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        stalled.close()
    assert wait_until(lambda: served.metric("atlas_num_requests_running") == 0, timeout=20)


def test_health_stays_fast_while_a_large_prompt_is_prepared(served):
    """/health answers fast while another request's prompt (near the size limit) is tokenized and refused."""
    prompt = "word " * (256 * 64 // 5 - 10)  # just under --max-prompt-chars-per-token x --max-model-len
    done = threading.Event()
    result = {}

    def big() -> None:
        try:
            result["status"] = httpx.post(served.url + "/v1/completions", timeout=60,
                                          json={"prompt": prompt, "max_tokens": 4}).status_code
        finally:
            done.set()

    thread = threading.Thread(target=big)
    times = []
    with httpx.Client(base_url=served.url, timeout=10) as http:
        http.get("/health")
        thread.start()
        while not done.is_set() or not times:
            t0 = time.perf_counter()
            assert http.get("/health").status_code == 200
            times.append(time.perf_counter() - t0)
            time.sleep(0.005)
    thread.join()
    assert result["status"] == 400  # (too long for the context once tokenized)
    times.sort()
    assert times[len(times) // 2] < 0.1, times


def test_killing_the_engine_ends_open_streams_and_the_server(qwen3_dir):
    """The engine process killed mid-stream: every open stream ends with an error event and [DONE], /health
    turns 503 and `atlas serve` exits with status 1 within seconds."""
    server = Serve(str(qwen3_dir), "--api-server-count", "2", step_seconds=0.05)
    try:
        events: list[list[str]] = [[], []]
        started = [threading.Event(), threading.Event()]

        def stream(i: int) -> None:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True,
                                    "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line[6:])
                        started[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(s.wait(30) for s in started)
        os.kill(server.engine_pid, signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        for ev in events:
            assert ev[-1] == "[DONE]", ev[-3:]
            assert json.loads(ev[-2])["error"]["code"] == "engine_unavailable", ev[-2]
        assert server.wait(15) == 1, server.log
        assert time.monotonic() - t0 < 15
        assert "Traceback" not in server.log, server.log
    finally:
        server.close()


def test_killing_a_front_end_frees_its_pages(qwen3_dir):
    """A front end killed mid-stream: the engine aborts its requests and frees their pages (seen in /metrics of
    the front end that takes its place)."""
    server = Serve(str(qwen3_dir), step_seconds=0.05)
    try:
        started = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                                  json={"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "n": 2,
                                        "stream": True}) as resp:
                    for _ in resp.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass  # (its front end is gone)

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        assert started.wait(30)
        total = server.metric("atlas_kv_cache_pages_total")
        assert server.metric("atlas_num_requests_running") == 2
        assert server.metric("atlas_kv_cache_pages_free") < total
        os.kill(server.front_end_pids[0], signal.SIGKILL)
        assert wait_until(lambda: len(server.front_end_pids) == 2, timeout=30), server.log  # a new one started

        def freed() -> bool:
            try:
                return (server.metric("atlas_num_requests_running") == 0
                        and server.metric("atlas_kv_cache_pages_free") == total)
            except httpx.HTTPError:
                return False

        assert wait_until(freed, timeout=20), server.log
        thread.join(10)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.close()
    assert server.proc.returncode == 0, server.log


def _comparable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_outputs_equal_the_in_process_server(served, qwen3_dir):
    """What crosses the process boundary is complete: n > 1, logprobs, stop strings, echo with prompt logprobs and
    chat replies come out exactly as from the server with the engine in its own thread."""
    from serving import start_server

    requests = [
        ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "n": 2, "logprobs": 2,
                             "ignore_eos": True}),
        ("/v1/completions", {"prompt": "import os", "max_tokens": 24, "temperature": 0, "stop": ["\n", "re"]}),
        ("/v1/completions", {"prompt": "x = 1", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}),
        ("/v1/completions", {"prompt": "a", "max_tokens": 12, "temperature": 0.8, "seed": 7, "n": 3,
                             "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                                  "temperature": 0, "logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {"prompt": "{", "max_tokens": 30, "temperature": 1.0, "seed": 3,
                             "structured_outputs": {"regex": "[a-z]{3,8}( [0-9]+)?"}}),
    ]
    local = start_server(str(qwen3_dir), kv_cache_memory="4MiB", max_model_len=256,
                         served_model_names=[str(qwen3_dir)])
    try:
        for path, body in requests:
            for stream in (False, True):
                answers = []
                for url in (served.url, local.url):
                    payload = {**body, "model": str(qwen3_dir), "stream": stream}
                    if stream:
                        with httpx.stream("POST", url + path, json=payload, timeout=60) as resp:
                            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
                        assert events[-1] == "[DONE]"
                        answers.append(_joined(events[:-1]))
                    else:
                        resp = httpx.post(url + path, json=payload, timeout=60)
                        assert resp.status_code == 200, resp.text
                        answers.append(_comparable(resp.json()))
                assert answers[0] == answers[1], (path, body, stream)
        bad = {"prompt": "a", "max_tokens": 4, "structured_outputs": {"regex": "(unclosed"}}
        answers = [httpx.post(url + "/v1/completions", json=bad, timeout=60) for url in (served.url, local.url)]
        assert [a.status_code for a in answers] == [400, 400]
        assert answers[0].json() == answers[1].json()
    finally:
        local.stop()


def _joined(events: list[str]) -> dict:
    """A stream's text, logprobs and finish reason per choice (chunk boundaries may differ: slow readers get
    several tokens in one chunk)."""
    choices: dict[int, dict] = {}
    for event in events:
        for c in json.loads(event)["choices"]:
            got = choices.setdefault(c["index"], {"text": "", "finish_reason": None})
            delta = c.get("delta")
            got["text"] += (delta or {}).get("content") or "" if delta is not None else c.get("text") or ""
            lp = c.get("logprobs")
            if lp:  # (flattened: completions' token lists, chat's content entries)
                for key, value in lp.items():
                    got.setdefault(key, []).extend(value or [])
            if c.get("finish_reason"):
                got["finish_reason"] = c["finish_reason"]
    return choices


def test_a_second_signal_cuts_streams_with_an_answer(qwen3_dir):
    """SIGTERM starts the drain (a long --shutdown-timeout), SIGINT during it cuts now: the open stream still
    ends with an error event and [DONE], and the exit status is 1."""
    server = Serve(str(qwen3_dir), "--shutdown-timeout", "60", step_seconds=0.05)
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert started.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert thread.is_alive()  # (draining: the stream goes on)
        server.proc.send_signal(signal.SIGINT)
        thread.join(20)
        assert not thread.is_alive()
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down", events[-2]
        assert server.wait(30) == 1, server.log
        assert "Traceback" not in server.log, server.log
    finally:
        server.close()


def test_previous_response_id_reaches_every_front_end(served, qwen3_dir):
    """Responses are stored where the engine runs: a follow-up finds its conversation whichever front end gets it."""
    import openai

    ids = []
    for _ in range(4):  # (a new client, a new connection, each time)
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
        resp = client.responses.create(model=str(qwen3_dir), input="hi", max_output_tokens=2,
                                       previous_response_id=ids[-1] if ids else None)
        assert resp.status in ("completed", "incomplete")
        ids.append(resp.id)
        client.close()


def test_plain_chunks_written_without_models_equal_the_models():
    """The stream's fast path writes the same JSON as the pydantic models it skips."""
    from atlas.server import protocol as P
    from atlas.server.streaming import ChunkWriter

    texts = ["", "plain", 'quote " and \\\\ backslash', "line\nbreak\ttab\x01", "naïve 漢字 🚀", "\u2028"]
    for text in texts:
        for finish, stop in ((None, None), ("stop", 7), ("stop", "END"), ("length", None)):
            got = ChunkWriter("text_completion", "cmpl-1", 5, "m/odel").text(2, text, finish, stop)
            want = P.CompletionChunk(id="cmpl-1", created=5, model="m/odel", choices=[P.CompletionChoice(
                index=2, text=text, finish_reason=finish, stop_reason=stop)]).model_dump_json()
            assert got.startswith("data: ") and got.endswith("\n\n")
            assert json.loads(got[6:]) == json.loads(want)
            for content in (text, None):
                got = ChunkWriter("chat.completion.chunk", "c-1", 5, "m").text(0, content, finish, stop)
                want = P.ChatCompletionChunk(id="c-1", created=5, model="m", choices=[P.ChatStreamChoice(
                    index=0, delta=P.DeltaMessage(content=content), finish_reason=finish,
                    stop_reason=stop)]).model_dump_json()
                assert json.loads(got[6:]) == json.loads(want)
            # return_token_ids: this chunk's ids (and a completion's first chunk, the prompt's)
            for ids, prompt_ids in (([], None), ([7], [1, 2, 3]), ([151935, 0, 42], None)):
                got = ChunkWriter("text_completion", "cmpl-1", 5, "m").text(0, text, finish, stop, ids, prompt_ids)
                want = P.CompletionChunk(id="cmpl-1", created=5, model="m", choices=[P.CompletionChoice(
                    index=0, text=text, finish_reason=finish, stop_reason=stop, prompt_token_ids=prompt_ids,
                    token_ids=ids)]).model_dump_json()
                assert json.loads(got[6:]) == json.loads(want)
                got = ChunkWriter("chat.completion.chunk", "c-1", 5, "m").text(0, text, finish, stop, ids)
                want = P.ChatCompletionChunk(id="c-1", created=5, model="m", choices=[P.ChatStreamChoice(
                    index=0, delta=P.DeltaMessage(content=text), finish_reason=finish, stop_reason=stop,
                    token_ids=ids)]).model_dump_json()
                assert json.loads(got[6:]) == json.loads(want)
            # continuous_usage_stats: the usage so far in the chunk
            running = P.UsageInfo(prompt_tokens=9, completion_tokens=4, total_tokens=13)
            got = ChunkWriter("text_completion", "cmpl-1", 5, "m").text(0, text, finish, stop, usage=running)
            want = P.CompletionChunk(id="cmpl-1", created=5, model="m", choices=[P.CompletionChoice(
                index=0, text=text, finish_reason=finish, stop_reason=stop)], usage=running).model_dump_json()
            assert json.loads(got[6:]) == json.loads(want)
