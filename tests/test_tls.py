"""HTTPS with vLLM's flags (--ssl-keyfile, --ssl-certfile; mutual TLS with --ssl-ca-certs and --ssl-cert-reqs 2),
over real TLS with certificates a test CA (trustme) signed."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest
import trustme
from serving import start_server

from atlas.cli import build_parser, parse_args
from atlas.errors import ConfigError
from atlas.server.cli import settings_from_args

ENGINE = dict(kv_cache_memory="4MiB", max_model_len=128)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the server's certificate for 127.0.0.1 and a client's, as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@example.com")
    files = {"ca": root / "ca.pem", "key": root / "key.pem", "cert": root / "cert.pem", "client": root / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    return {k: str(v) for k, v in files.items()}


def test_https_serves_the_openai_client(qwen3_dir, pki):
    server = start_server(str(qwen3_dir), settings={"ssl_keyfile": pki["key"], "ssl_certfile": pki["cert"]}, **ENGINE)
    try:
        url = server.url.replace("http://", "https://")
        trusted = ssl.create_default_context(cafile=pki["ca"])
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", http_client=httpx.Client(verify=trusted))
        reply = client.completions.create(model=str(qwen3_dir), prompt="hi", max_tokens=3,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        client.close()
        with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
            httpx.get(server.url + "/health", timeout=10)  # (plain HTTP on the TLS port: no answer)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # (a client without the CA)
            httpx.get(url + "/health", timeout=10)
    finally:
        server.stop()


def test_mutual_tls_requires_a_client_certificate(qwen3_dir, pki):
    settings = {"ssl_keyfile": pki["key"], "ssl_certfile": pki["cert"], "ssl_ca_certs": pki["ca"],
                "ssl_cert_reqs": ssl.CERT_REQUIRED}
    server = start_server(str(qwen3_dir), settings=settings, **ENGINE)
    try:
        url = server.url.replace("http://", "https://")
        context = ssl.create_default_context(cafile=pki["ca"])
        context.load_cert_chain(pki["client"])
        assert httpx.get(url + "/health", verify=context, timeout=10).status_code == 200
        with pytest.raises((httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError)):
            httpx.get(url + "/health", verify=ssl.create_default_context(cafile=pki["ca"]), timeout=10)
    finally:
        server.stop()


def test_tls_flags_are_checked_at_start(pki, tmp_path):
    def settings(*flags: str):
        return settings_from_args(parse_args(build_parser(), ["serve", *flags]))

    assert settings("--ssl-keyfile", pki["key"], "--ssl-certfile", pki["cert"]).tls
    for flags, words in ((["--ssl-keyfile", pki["key"]], "needs both"),
                         (["--ssl-ca-certs", pki["ca"]], "need --ssl-keyfile"),
                         (["--ssl-keyfile", pki["key"], "--ssl-certfile", pki["cert"], "--ssl-cert-reqs", "2"],
                          "needs --ssl-ca-certs"),
                         (["--ssl-keyfile", pki["cert"], "--ssl-certfile", pki["cert"]], "cannot load them"),
                         (["--ssl-keyfile", str(tmp_path / "none.pem"), "--ssl-certfile", pki["cert"]],
                          "No such file")):
        with pytest.raises(ConfigError, match=words):
            settings(*flags)
