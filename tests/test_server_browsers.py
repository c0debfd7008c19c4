"""No web page can drive the server (over real HTTP on 127.0.0.1): a foreign Host is refused (DNS
rebinding), a POST body must be application/json (no CORS "simple request" gets through), CORS is off unless
--allowed-origins says otherwise and a foreign Origin is refused; and the API key's small print (spaces
around a configured key, two Authorization headers), HEAD /health, and that real clients still work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from serving import ENGINE_FLAGS, assert_error, start_server

from atlas.cli import build_parser
from atlas.errors import ConfigError
from atlas.server.browsers import default_allowed_hosts, host_name, parse_list
from atlas.server.cli import settings_from_args
from atlas.server.settings import ServerSettings

NAME = "tiny"
ENGINE = dict(kv_cache_memory="16MiB", max_model_len=256)
KEY = "browsers-key"
APP = "https://app.example"
COMPLETION = {"model": NAME, "prompt": "def f(x):", "max_tokens": 2}


@pytest.fixture(scope="module")
def open_server(qwen3_dir):
    """Out of the box, as `atlas serve` on a workstation: no key, bound to 127.0.0.1, CORS off."""
    srv = start_server(str(qwen3_dir), served_model_names=[NAME], **ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cors_server(qwen3_dir):
    """A key configured with spaces around it (as read from a secret file), a named extra host, and CORS for
    one origin given in vLLM's JSON form."""
    srv = start_server(str(qwen3_dir), api_key=f"  {KEY}\n", served_model_names=[NAME], settings=dict(
        allowed_hosts=("127.0.0.1", "llm.internal"), allowed_origins=json.dumps([APP])), **ENGINE)
    yield srv
    srv.stop()


def port(srv) -> str:
    return srv.url.rsplit(":", 1)[1]


# ---------------------------------------------------------------------------------- Host (DNS rebinding)
def test_a_foreign_host_is_refused(open_server):
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        for host in ("evil.example", f"evil.example:{port(open_server)}", "127.0.0.1.nip.io", "[::2]:80"):
            err = assert_error(c.post("/v1/completions", json=COMPLETION, headers={"Host": host}), 421,
                               code="misdirected_request")
            assert "--allowed-hosts" in err["message"]
        assert_error(c.get("/v1/models", headers={"Host": "evil.example"}), 421)  # GETs too: nothing to read
        for host in (f"localhost:{port(open_server)}", f"127.0.0.1:{port(open_server)}", "LOCALHOST",
                     f"[::1]:{port(open_server)}", "localhost."):
            assert c.post("/v1/completions", json=COMPLETION, headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_names_the_hosts(cors_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=cors_server.url, timeout=30, headers=auth) as c:
        assert c.get("/v1/models", headers={"Host": f"llm.internal:{port(cors_server)}"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "127.0.0.1"}).status_code == 200
        # localhost is in the default list only: the operator's list replaces it
        assert_error(c.get("/v1/models", headers={"Host": "localhost"}), 421)
        assert_error(c.get("/health", headers={"Host": "evil.example"}), 421)


def test_default_hosts_follow_the_bound_address():
    assert set(default_allowed_hosts("127.0.0.1")) == {"127.0.0.1", "localhost", "::1"}
    assert set(default_allowed_hosts("10.1.2.3")) == {"10.1.2.3", "127.0.0.1", "localhost", "::1"}
    assert default_allowed_hosts("0.0.0.0") == ("*",) and default_allowed_hosts("::") == ("*",)
    assert [host_name(h) for h in ("Example.COM:80", "[::1]:8000", "::1", "a.example.")] == \
        ["example.com", "::1", "::1", "a.example"]


# ---------------------------------------------------------------------------------- Content-Type
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_post_body_must_be_json(open_server, content_type):
    """The content types a page may send cross-site without a preflight (a CORS "simple request")."""
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            resp = c.post(path, content=json.dumps(COMPLETION), headers={"Content-Type": content_type})
            err = assert_error(resp, 415, code="unsupported_media_type")
            assert "Content-Type: application/json" in err["message"]


def test_json_content_types_pass(open_server):
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON", None):
            headers = {"Content-Type": content_type} if content_type else {}
            resp = c.post("/v1/completions", content=json.dumps(COMPLETION), headers=headers)
            assert resp.status_code == 200, (content_type, resp.text)


# ---------------------------------------------------------------------------------- Origin and CORS
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}


def test_cors_is_off_by_default_and_foreign_origins_are_refused(open_server):
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        resp = c.options("/v1/completions", headers={"Origin": APP, **PREFLIGHT})
        assert "access-control-allow-origin" not in resp.headers and resp.status_code >= 400
        # a simple request (no preflight) from a page: refused before it runs, whatever its content type
        for headers in ({"Origin": "https://evil.example", "Content-Type": "text/plain"},
                        {"Origin": "https://evil.example"}, {"Origin": "null"}):
            resp = c.post("/v1/completions", content=json.dumps(COMPLETION), headers=headers)
            assert_error(resp, 403, code="origin_not_allowed")
            assert "access-control-allow-origin" not in resp.headers
        # the server's own pages (e.g. /docs' "Try it out") are same-origin
        own = {"Origin": open_server.url}
        assert c.post("/v1/completions", json=COMPLETION, headers=own).status_code == 200
        # a rebinding page is "same-origin" under its own name: the Host check refuses it
        rebound = {"Host": f"evil.example:{port(open_server)}", "Origin": f"http://evil.example:{port(open_server)}"}
        assert_error(c.post("/v1/completions", json=COMPLETION, headers=rebound), 421)


def test_allowed_origins_turn_cors_on(cors_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=cors_server.url, timeout=30) as c:
        pre = c.options("/v1/completions", headers={"Origin": APP, **PREFLIGHT})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == APP
        resp = c.post("/v1/completions", json=COMPLETION, headers={"Origin": APP, **auth})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == APP
        # an allowed page can read why its request failed
        resp = c.post("/v1/completions", content=b"{}", headers={"Origin": APP, "Content-Type": "text/plain", **auth})
        assert_error(resp, 415)
        assert resp.headers["access-control-allow-origin"] == APP
        # another origin: no preflight, no request
        pre = c.options("/v1/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
        assert "access-control-allow-origin" not in pre.headers and pre.status_code >= 400
        resp = c.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://evil.example", **auth})
        assert_error(resp, 403, code="origin_not_allowed")
        assert "access-control-allow-origin" not in resp.headers


def test_cors_flags_take_vllms_json_lists_and_commas():
    parser = build_parser()
    args = parser.parse_args(["serve", "--allowed-origins", '["https://a.example", "https://b.example"]',
                              "--allowed-origins", "https://c.example,https://d.example",
                              "--allowed-methods", '["GET","POST"]', "--allowed-headers", "authorization",
                              "--allow-credentials", "--allowed-hosts", "llm.internal", "--allowed-hosts",
                              "a.example,b.example", "--api-key", " k \n"])
    settings = settings_from_args(args)
    assert settings.allowed_origins == ("https://a.example", "https://b.example", "https://c.example",
                                        "https://d.example")
    assert settings.allowed_methods == ("GET", "POST") and settings.allowed_headers == ("authorization",)
    assert settings.allow_credentials and settings.allowed_hosts == ("llm.internal", "a.example", "b.example")
    assert settings.api_key == "k"
    defaults = settings_from_args(parser.parse_args(["serve"]))
    assert defaults.allowed_origins == () and defaults.allowed_hosts is None and defaults.bind_host == "127.0.0.1"
    assert parse_list('"*"', "--allowed-origins") == ("*",)
    for bad in (["serve", "--allowed-origins", "[1]"], ["serve", "--allowed-origins", "[oops"],
                ["serve", "--allowed-origins", "*", "--allow-credentials"], ["serve", "--api-key", "   "],
                ["serve", "--allowed-hosts", ","]):
        with pytest.raises(ConfigError):
            settings_from_args(parser.parse_args(bad))


# ---------------------------------------------------------------------------------- API key, /health
def test_api_key_with_spaces_is_stripped(cors_server):
    assert cors_server.state.settings.api_key == KEY
    assert ServerSettings(api_key="\tk ").api_key == "k"
    with httpx.Client(base_url=cors_server.url, timeout=30) as c:
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)


def test_a_non_ascii_api_key_is_refused_at_start_up(qwen3_dir):
    """Clients send the Authorization header as ASCII (the openai library can send nothing else), so a key beyond
    printable ASCII could never be sent as written: `atlas serve` stops at once and says what to use."""
    cmd = [sys.executable, "-m", "atlas.cli", "serve", "--model", str(qwen3_dir), "--port", "0", *ENGINE_FLAGS,
           "--api-key", "clé-ключ"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "ATLAS_API_KEY": ""})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "printable ASCII" in out and "openssl rand" in out, out
    assert "Traceback" not in out and "ключ" not in out, out  # (the key itself is not logged)
    for key in ("café", "k\x00ey", "k\u00a0ey"):
        with pytest.raises(ValueError, match="printable ASCII"):
            ServerSettings(api_key=key)


def test_the_key_is_compared_with_the_headers_own_bytes(cors_server):
    """Only spaces and tabs around the token are dropped; any other byte, non-ASCII ones included, is part of it."""
    with httpx.Client(base_url=cors_server.url, timeout=30) as c:
        assert c.get("/v1/models", headers={"Authorization": f"Bearer \t{KEY}".encode()}).status_code == 200
        for token in (KEY.encode() + b"\xa0", KEY.encode() + b"\x85", "ключ".encode(), b"\xff"):
            err = assert_error(c.get("/v1/models", headers={"Authorization": b"Bearer " + token}), 401,
                               code="invalid_api_key")
            assert "Bearer <key>" in err["message"]


def test_two_authorization_headers_are_refused(cors_server):
    with httpx.Client(base_url=cors_server.url, timeout=30) as c:
        for pair in ([f"Bearer {KEY}", "Bearer wrong"], ["Bearer wrong", f"Bearer {KEY}"],
                     [f"Bearer {KEY}", f"Bearer {KEY}"]):
            headers = [("Authorization", value) for value in pair]
            err = assert_error(c.get("/v1/models", headers=headers), 401, code="invalid_api_key")
            assert "several Authorization headers" in err["message"]


def test_head_health(open_server, cors_server):
    for srv in (open_server, cors_server):
        resp = httpx.head(srv.url + "/health", timeout=30)
        assert resp.status_code == 200 and resp.content == b""
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------------------- real clients still work
def test_real_clients_send_json(cors_server):
    with openai.OpenAI(base_url=cors_server.url + "/v1", api_key=KEY, max_retries=0) as client:
        out = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=2)
        assert out.choices[0].text is not None
        chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.choices[0].message is not None
        stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, stream=True)
        assert list(stream)
    request = httpx.Request("POST", cors_server.url + "/v1/completions", json=COMPLETION)
    assert request.headers["content-type"] == "application/json"


def test_langchain_sends_json(cors_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=cors_server.url + "/v1", api_key=KEY, model=NAME, max_tokens=2,
                                      max_retries=0)
    assert llm.invoke("hi").content is not None
