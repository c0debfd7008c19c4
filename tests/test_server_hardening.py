"""The server under hostile and careless clients: one request never stalls the others (measured as /health
latency while a hostile request runs), every malformed input is a 4xx with an OpenAI error body, the caps
(body, sequences, chat templates) hold, nothing private leaks to unauthenticated clients, the API
describes itself, and a shutdown past its timeout answers every request it cuts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import CHATML
from openapi_spec_validator import validate as validate_openapi
from serving import assert_error, slow_atlas_command, start_server, wait_until

from atlas import LLM, SamplingParams

API_KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NAME = "tiny"
ENGINE = dict(kv_cache_memory="16MiB", max_model_len=256)
BODY_CAP = 4 * 2**20
SEQUENCE_CAP = 8
TEMPLATE_TIMEOUT = 1.0
# The internals a client must never read about in an error.
INTERNAL_NAMES = ("transformers", "render_jinja_template", "apply_chat_template", "Traceback", "site-packages")


@pytest.fixture(scope="module")
def server(qwen3_dir):
    """Tight caps, client chat templates trusted (so their limits can be shown), /metrics and /docs open."""
    srv = start_server(str(qwen3_dir), api_key=API_KEY, served_model_names=[NAME], settings=dict(
        max_request_body_bytes=BODY_CAP, max_sequences_per_request=SEQUENCE_CAP, trust_request_chat_template=True,
        chat_template_timeout=TEMPLATE_TIMEOUT), **ENGINE)
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=300) as http:
        _wait_for_a_worker(http)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def default_server(qwen3_dir):
    """Out-of-the-box settings, except that the API key also guards /metrics and /docs."""
    srv = start_server(str(qwen3_dir), api_key=API_KEY, served_model_names=[NAME],
                       settings=dict(public_metrics_and_docs=False), **ENGINE)
    yield srv
    srv.stop()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(qwen3_dir):
    return LLM(str(qwen3_dir), **ENGINE)


def _wait_for_a_worker(http: httpx.Client) -> None:
    """A client template is large work: the first one starts the preprocessing worker process, and a task that ran
    long leaves its worker replaced by one still starting (seconds on a busy machine), which the tests' time bounds
    must not count. A template that renders at once returns when a worker is ready."""
    assert http.post("/tokenize", timeout=300, json={
        "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}).status_code == 200


def post_raw(http: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def assert_client_error(resp: httpx.Response, status: int = 400, param: str | None = None,
                        code: str | None = None) -> dict:
    err = assert_error(resp, status, param, code)
    assert not any(name in err["message"] for name in INTERNAL_NAMES), err
    return err


# ---------------------------------------------------------------------------------- request isolation
def _health_probe(url: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            resp = c.get(url + "/health")
            latencies.append(time.perf_counter() - t0)
            assert resp.status_code == 200
            time.sleep(0.02)


def _while_probing_health(url: str, hostile) -> tuple[httpx.Response, float, list[float]]:
    """Run hostile() (one slow request) while another client polls /health: (its response, how long it
    took, the /health latencies seen meanwhile)."""
    stop, latencies = threading.Event(), []
    probe = threading.Thread(target=_health_probe, args=(url, stop, latencies))
    probe.start()
    try:
        assert wait_until(lambda: len(latencies) >= 3, timeout=10)
        t0 = time.perf_counter()
        resp = hostile()
        took = time.perf_counter() - t0
    finally:
        stop.set()
        probe.join()
    return resp, took, latencies


def _slow_prompt(qwen3_dir: Path, seconds: float, max_bytes: int) -> str:
    """Text that takes the tokenizer about `seconds` to encode here (measured), within max_bytes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    import textwrap

    unit = Path(textwrap.__file__).read_text()
    sample = unit * 20
    t0 = time.perf_counter()
    tok.encode(sample)
    rate = len(sample) / max(time.perf_counter() - t0, 1e-3)
    return (unit * (int(rate * seconds) // len(unit) + 1))[:max_bytes - 1000]


def test_health_answers_while_a_huge_prompt_is_tokenized(server, http, qwen3_dir):
    """Tokenization runs off the event loop: /health stays fast while a multi-megabyte prompt is tokenized
    (before, it waited for the whole tokenization)."""
    prompt = _slow_prompt(qwen3_dir, seconds=1.5, max_bytes=BODY_CAP)
    _wait_for_a_worker(http)
    resp, took, latencies = _while_probing_health(server.url, lambda: http.post("/tokenize", json={"prompt": prompt}))
    assert resp.status_code == 200 and resp.json()["count"] > 10_000, resp.text[:200]
    assert took > 0.5, f"the hostile request took only {took:.2f}s: nothing was measured"
    assert len(latencies) >= 5
    assert max(latencies) < took / 2, (f"/health took up to {max(latencies):.2f}s while a {took:.2f}s "
                                       "tokenization ran")


def test_health_answers_while_a_heavy_template_renders(server, http):
    """A client template with nested loops renders off the event loop and stops at --chat-template-timeout."""
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template": bomb}
    _wait_for_a_worker(http)  # (else `took` counted a replacement worker's start: 6.6 s once on 2 busy cores)
    resp, took, latencies = _while_probing_health(server.url, lambda: http.post("/v1/chat/completions", json=body))
    err = assert_client_error(resp, 400, "chat_template")
    assert "ran for more than" in err["message"]
    # (Unstopped, the template would run for hours; the margin is for a loaded machine.)
    assert TEMPLATE_TIMEOUT * 0.9 < took < TEMPLATE_TIMEOUT + 15
    assert max(latencies) < took / 2, f"/health took up to {max(latencies):.2f}s while a template rendered"


def test_template_bombs_are_stopped_before_they_build(server, http):
    """Size limits act before the value is built: a billion-character repeat is refused at once."""
    for bomb in ("{{ 'a' * 10**9 }}", "{{ '{:>999999999}'.format(1) }}", "{{ 'a'|center(999999999) }}",
                 "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "{{ ''.__class__.__mro__ }}"):
        t0 = time.perf_counter()
        resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "chat_template": bomb})
        assert_client_error(resp, 400, "chat_template")
        # (Built, the first would take a gigabyte and the fourth a terabyte; a busy machine may still be slow
        # to answer, hence the margin.)
        assert time.perf_counter() - t0 < 5 * TEMPLATE_TIMEOUT, bomb
    assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------------- caps
def test_request_body_cap(server, http, default_server):
    big = json.dumps({"prompt": "x" * (BODY_CAP + 10)}).encode()
    assert_client_error(post_raw(http, "/v1/completions", big), 413, code="request_too_large")

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    assert_client_error(http.post("/v1/completions", content=chunked()), 413, code="request_too_large")
    # The default cap (8 MiB) refuses the 20 MB prompt that used to stall the server.
    with httpx.Client(base_url=default_server.url, headers=AUTH, timeout=60) as c:
        assert_client_error(c.post("/v1/completions", json={"prompt": "def f():\n" * 2_000_000}), 413,
                            code="request_too_large")
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_sequence_cap(http):
    assert_client_error(http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3}), 400, "n")
    assert_client_error(http.post("/v1/completions", json={"prompt": [f"p{i}" for i in range(9)]}), 400, "prompt")
    assert_client_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "n": SEQUENCE_CAP + 1}), 400, "n")
    ok = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 4, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == SEQUENCE_CAP, ok.text


# ---------------------------------------------------------------------------------- client mistakes are 4xx
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


MALFORMED = [
    # (path, raw JSON body, status, param)
    ("/v1/completions", r'{"prompt": "abc\ud800", "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", r'{"prompt": ["ok", "\udfff"], "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", r'{"prompt": "x", "stop": ["\ud800"]}', 400, "stop"),
    ("/v1/completions", r'{"prompt": "x", "\ud800": 1}', 400, None),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \ud83d"}]}', 400, "messages"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
     400, "messages"),
    ("/tokenize", r'{"prompt": "\ud800"}', 400, "prompt"),
    ("/tokenize", r'{"messages": [{"role": "user", "content": "\ud800"}]}', 400, "messages"),
    ("/v1/completions", '{"prompt": "x", "metadata": ' + _nested(1000) + "}", 400, None),
    ("/v1/completions", '{"prompt": "x", "metadata": ' + _nested(100) + "}", 400, "metadata"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
     + _nested(100) + "}}", 400, "chat_template_kwargs"),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', 400, None),  # a surrogate as raw UTF-8 bytes
    ("/v1/completions", b'{"prompt": "\xff"}', 400, None),
]
MALFORMED_JSON = [
    # (path, body, param): a chat_template_kwargs that repeats what the server sets
    ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/tokenize", {"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs"),
    # roles: unknown, empty, the deprecated functions API's; content missing; tool calls without a name
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": "42", "name": "f"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"arguments": "{}"}}]}]}, "messages"),
    # tools and constraints this server cannot honour as asked (tool_choice "auto", the default with tools,
    # needs --enable-auto-tool-choice), or that do not compile
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/completions", {"guided_json": {"type": "objec"}}, "guided_json"),
    ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/completions", {"suffix": "return x"}, "suffix"),
    ("/v1/completions", {"use_beam_search": True, "stream": True}, "stream"),
    # fields vLLM honours that Atlas does not: refused, never ignored
    ("/v1/completions", {"priority": 5}, "priority"),
    ("/v1/chat/completions", {"cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"return_token_ids": "yes"}, "return_token_ids"),
    ("/v1/chat/completions", {"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
    ("/v1/chat/completions", {"echo": "yes"}, "echo"),
    # sampling parameters that float32 cannot carry
    ("/v1/completions", {"repetition_penalty": 1e-46}, "repetition_penalty"),
    ("/v1/completions", {"temperature": 1e300}, "temperature"),
    ("/v1/chat/completions", {"repetition_penalty": 1e30}, "repetition_penalty"),
]


@pytest.mark.parametrize("path,raw,status,param", MALFORMED)
def test_malformed_bodies_are_4xx(http, path, raw, status, param):
    assert_client_error(post_raw(http, path, raw if isinstance(raw, bytes) else raw.encode()), status, param)


@pytest.mark.parametrize("path,body,param", MALFORMED_JSON)
def test_client_mistakes_are_4xx(http, path, body, param):
    base = {"/v1/completions": {"prompt": "x"}, "/tokenize": {"messages": [{"role": "user", "content": "x"}]},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]}}[path]
    assert_client_error(http.post(path, json={**base, **body}), 400, param)


def test_version_is_open_like_health(http):
    import atlas

    assert http.get("/version").json() == {"version": atlas.__version__}


def test_harmless_values_of_unsupported_fields_pass(http):
    """Values that ask for nothing (as clients send by default) are not refused."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": False, "logit_bias": None, "modalities": ["text"],
            "priority": 0, "echo": False, "return_token_ids": False}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    with_refusal = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "refusal": None,
                                                       "tool_calls": None}, {"role": "user", "content": "go"}]
    assert http.post("/v1/chat/completions", json={"messages": with_refusal, "max_tokens": 2}).status_code == 200


def test_surrogate_pairs_are_fine(http, server):
    """A correct pair (an emoji written as \\ud83d\\ude00) is text like any other."""
    resp = post_raw(http, "/tokenize", rb'{"prompt": "smile \ud83d\ude00"}')
    assert resp.status_code == 200
    assert resp.json()["tokens"] == server.core.tokenizer.encode("smile \U0001f600")


# ---------------------------------------------------------------------------------- never fluent and wrong
def test_underflowing_top_p_keeps_the_most_likely_token(http, offline):
    """top_p = 1e-46 is 0 in float32: the most likely token still survives (it was an empty 200)."""
    prompt = "def wrap(text):"
    greedy = offline.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    for top_p in (1e-46, 5e-324):
        resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 1.0,
                                                  "top_p": top_p, "ignore_eos": True, "seed": 3})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["text"] == greedy.text and choice["finish_reason"] == "length"
    resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "min_p": 1.0,
                                              "top_k": 1, "ignore_eos": True})
    assert resp.json()["choices"][0]["text"] == greedy.text


# ---------------------------------------------------------------------------------- chat template policy
def test_chat_templates_from_requests_need_the_operators_trust(default_server, server, http):
    messages = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}{{ m['content'] }}!{% endfor %}"
    with httpx.Client(base_url=default_server.url, headers=AUTH, timeout=30) as c:
        for path, body in (("/v1/chat/completions", {"chat_template": template}),
                           ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": template}}),
                           ("/tokenize", {"chat_template": template})):
            err = assert_client_error(c.post(path, json={"messages": messages, **body}), 400, "chat_template")
            assert "--trust-request-chat-template" in err["message"]
    # Trusted: the request's template is the one rendered.
    resp = http.post("/tokenize", json={"messages": messages, "chat_template": template})
    assert resp.json()["tokens"] == server.core.tokenizer.encode("hi!", add_special_tokens=False)
    resp = http.post("/tokenize", json={"messages": messages, "chat_template": "{{ who }} says {{ messages[0].content }}",
                                        "chat_template_kwargs": {"who": "Ann"}})
    assert resp.json()["tokens"] == server.core.tokenizer.encode("Ann says hi", add_special_tokens=False)


# ---------------------------------------------------------------------------------- what clients see
def test_a_template_failing_in_its_own_code_names_no_python_internals(http):
    """A chat template whose code fails (a string plus a number) is a 400 on chat_template saying what to check,
    without Python's exception type or its words."""
    for path in ("/tokenize", "/v1/chat/completions"):
        resp = http.post(path, json={"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                     "chat_template": "{{ messages[0]['content'] + 1 }}"})
        err = assert_client_error(resp, 400, "chat_template")
        assert "TypeError" not in err["message"] and "concatenate" not in err["message"], err
        assert err["message"].startswith("the chat template failed on these messages") and "send them" in \
            err["message"], err


def test_models_and_tokenizer_info_reveal_no_paths(server, http, qwen3_dir):
    models = http.get("/v1/models")
    assert [(m["id"], m["root"]) for m in models.json()["data"]] == [(NAME, NAME)]
    card = http.get(f"/v1/models/{NAME}")
    assert card.status_code == 200 and card.json()["id"] == NAME and card.json()["object"] == "model"
    assert_client_error(http.get("/v1/models/gpt-4"), 404, "model", "model_not_found")
    info = http.get("/tokenizer_info")
    assert info.status_code == 200
    body = info.json()
    tokenizer = server.core.tokenizer.hf
    assert body["eos_token"] == tokenizer.eos_token and body["pad_token"] == tokenizer.pad_token
    assert body["chat_template"] == CHATML and isinstance(body["tokenizer_class"], str)
    for resp in (models, card, info):
        assert str(qwen3_dir) not in resp.text and str(qwen3_dir.parent) not in resp.text


def test_what_is_open_without_the_key(server, default_server):
    guarded = [("GET", "/v1/models"), ("GET", f"/v1/models/{NAME}"), ("POST", "/v1/completions"),
               ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
               ("GET", "/tokenizer_info")]
    docs = [("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs")]
    for srv, docs_open in ((server, True), (default_server, False)):
        with httpx.Client(base_url=srv.url, timeout=30) as anon, \
                httpx.Client(base_url=srv.url, timeout=30, headers=AUTH) as keyed:
            assert anon.get("/health").status_code == 200
            for method, path in guarded:
                assert_client_error(anon.request(method, path, json={}), 401, code="invalid_api_key")
            for method, path in docs:
                if docs_open:
                    assert anon.request(method, path).status_code == 200, path
                else:
                    assert_client_error(anon.request(method, path), 401, code="invalid_api_key")
                    assert keyed.request(method, path).status_code == 200, path


def test_docs_load_one_pinned_release_checked_by_its_hashes(server):
    """/docs takes Swagger UI from the CDN at an exact version, each file with a subresource-integrity hash (a
    browser runs nothing else), and nothing from any other place."""
    page = httpx.get(server.url + "/docs", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    tags = re.findall(r"<(?:script|link)\b[^>]*>", page.text)
    external = [t for t in tags if re.search(r'(?:src|href)="https?://', t)]
    assert len(external) == 2, tags  # the stylesheet and the script
    for tag in external:
        url = re.search(r'(?:src|href)="([^"]+)"', tag).group(1)
        assert re.fullmatch(r"https://cdn\.jsdelivr\.net/npm/swagger-ui-dist@\d+\.\d+\.\d+/[\w.-]+", url), url
        assert re.search(r'integrity="sha384-[A-Za-z0-9+/]{64}"', tag) and 'crossorigin="anonymous"' in tag, tag
    assert not re.search(r'(?:src|href)="(?!https://cdn\.jsdelivr\.net/|data:)', page.text), page.text
    assert '"url": "/openapi.json"' in page.text


def test_openapi_describes_bodies_responses_and_errors(server, http):
    spec = http.get("/openapi.json").json()
    validate_openapi(spec)
    schemas = spec["components"]["schemas"]
    expected = {"/v1/completions": ("CompletionRequest", "CompletionResponse"),
                "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletionResponse"),
                "/tokenize": ("TokenizeRequest", "TokenizeResponse"),
                "/detokenize": ("DetokenizeRequest", "DetokenizeResponse")}
    for path, (request_model, response_model) in expected.items():
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{request_model}"
        assert schemas[request_model]["properties"], request_model
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(response_model)
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    for path in ("/v1/models", "/v1/models/{model_id}", "/tokenizer_info", "/health"):
        assert "$ref" in spec["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert spec["paths"]["/v1/models/{model_id}"]["get"]["parameters"][0]["name"] == "model_id"
    assert "text/event-stream" in spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]


def test_405_names_the_allowed_methods(http):
    for method, path, allowed in (("PUT", "/v1/models", "GET"), ("GET", "/v1/completions", "POST"),
                                  ("DELETE", "/tokenize", "POST")):
        resp = http.request(method, path)
        assert_client_error(resp, 405)
        assert resp.headers["allow"] == allowed


# ---------------------------------------------------------------------------------- prompt scoring
def test_max_tokens_zero_with_echo_scores_the_prompt(http, offline):
    prompt = "def wrap(text, width=70):"
    ref = offline.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    ids = ref.prompt_token_ids
    expected = [ref.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                             "prompt_tokens_details": None}
    lp = choice["logprobs"]["token_logprobs"]
    assert len(lp) == len(ids) and lp[0] is None and lp[1:] == pytest.approx(expected, abs=1e-4)

    with http.stream("POST", "/v1/completions", json={"prompt": [prompt, "import re"], "max_tokens": 0,
                                                      "echo": True, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: prompt, 1: "import re"}
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert_client_error(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0}), 400, "max_tokens")


# ---------------------------------------------------------------------------------- shutdown past the timeout
def test_shutdown_past_the_timeout_answers_every_cut_request(qwen3_dir):
    """Past --shutdown-timeout a stream gets an error event and [DONE], a plain request a 503 error body; one
    log line; exit status 1."""
    cmd = [*slow_atlas_command(0.05), "serve", "--model", str(qwen3_dir), "--port", "0", "--kv-cache-memory",
           "4MiB", "--max-model-len", "256", "--served-model-name", NAME, "--no-access-log", "--shutdown-timeout", "1"]
    env = {**os.environ, "ATLAS_API_KEY": ""}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        results: dict[str, object] = {}
        first_chunk = threading.Event()
        body = {"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
                events = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()
                results["stream"] = events

        def plain() -> None:
            results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert first_chunk.wait(30)
        assert wait_until(lambda: _running(url) >= 2, timeout=30)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        out, _ = proc.communicate(timeout=60)
        log = "".join(lines) + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = results["stream"]
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert_error(results["plain"], 503, code="server_shutting_down")
    assert proc.returncode == 1, log
    assert len([line for line in log.splitlines() if "were cut" in line]) == 1, log
    assert "Traceback" not in log and "Cancel" not in log, log


def _running(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "atlas_num_requests_running")


# ---------------------------------------------------------------------------------- the drain before the listener closes
def test_health_answers_503_while_the_server_drains(qwen3_dir):
    """From the moment shutdown begins until the last in-flight request is answered, the listener stays open:
    /health answers 503 and a new request gets a 503 (so a load balancer sees the drain); the request in flight
    is answered; then the server stops."""
    import socket

    srv = start_server(str(qwen3_dir), settings=dict(shutdown_timeout=20), **ENGINE)
    try:
        host, port = srv.sock.getsockname()[:2]
        body = json.dumps({"prompt": "def f(x):", "max_tokens": 4}).encode()
        # A request in flight: its body arrives in two parts, the second after shutdown has begun.
        conn = socket.create_connection((host, port), timeout=30)
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        assert wait_until(lambda: getattr(srv.state, "in_flight", 1) == 1)
        srv.server.should_exit = True  # (what SIGTERM does)
        assert wait_until(lambda: srv.state.shutting_down)
        time.sleep(0.2)  # (uvicorn would have closed the listener by now)
        assert_error(httpx.get(srv.url + "/health", timeout=10), 503, code="server_shutting_down")
        assert httpx.head(srv.url + "/health", timeout=10).status_code == 503
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
        assert_error(refused, 503, code="server_shutting_down")
        assert refused.headers["connection"] == "close"
        conn.sendall(body[10:])
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        conn.close()
        srv.thread.join(30)
        assert not srv.thread.is_alive()
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=5)
    finally:
        if srv.thread.is_alive():
            srv.stop()
        srv.sock.close()
