"""--runner pooling: embeddings equal transformers' (AutoModel hidden states, pooled and normalized), through
LLM.embed and POST /v1/embeddings (the official openai client), and the errors around them."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from conftest import assert_pages_returned, build_checkpoint
from serving import assert_error, start_server

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError, InvalidRequestError, ModelLoadError

ENGINE = dict(kv_cache_memory="16MiB", max_model_len=128)
TEXTS = ["def wrap(text, width=70):", "The TextWrapper instance", "import re", "class TextWrapper:",
         "    # Hardcode the recognized whitespace characters, and a rather longer line of text to embed"]


def _reference(ckpt, prompts: list[list[int]], mode: str = "last", normalize: bool = True) -> list[torch.Tensor]:
    """transformers: AutoModel's last hidden state (final-normed), pooled, L2-normalized, float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            v = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[mode]
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tokenizer_dir):
    """A tiny random Qwen3 checkpoint with sentence-transformers files: last-token pooling + Normalize."""
    root = tmp_path_factory.mktemp("embed")
    ckpt = build_checkpoint(root, "Qwen3ForCausalLM", tokenizer_dir, seed=3)
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (ckpt / "1_Pooling").mkdir()
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}))
    return ckpt


@pytest.fixture(scope="module")
def llm(embed_dir):
    return LLM(str(embed_dir), runner="pooling", **ENGINE)


def _ids(llm, texts):
    return [llm.get_tokenizer().encode(t) for t in texts]


def _assert_close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4)


def test_embed_equals_transformers_in_one_batch(embed_dir, llm):
    prompts = _ids(llm, TEXTS)
    outs = llm.embed(TEXTS)
    assert [o.prompt_token_ids for o in outs] == prompts
    for out, want in zip(outs, _reference(embed_dir, prompts), strict=True):
        assert out.finished and out.outputs.hidden_size == 64
        _assert_close(out.outputs.embedding, want)
        assert abs(torch.tensor(out.outputs.embedding).norm().item() - 1.0) < 1e-5
    assert_pages_returned(llm)
    assert llm.engine.stats.num_generation_tokens == 0


def test_chunked_prompts_equal_transformers(embed_dir, tokenizer_dir):
    """A budget of 8 tokens a step: every prompt is computed in several chunks, batched with the others."""
    small = LLM(str(embed_dir), runner="pooling", max_num_batched_tokens=8, **ENGINE)
    prompts = _ids(small, TEXTS)
    assert max(map(len, prompts)) > 8
    outs = small.embed([{"prompt_token_ids": p} for p in prompts])
    assert small.engine.stats.num_steps >= sum(map(len, prompts)) // 8
    for out, want in zip(outs, _reference(embed_dir, prompts), strict=True):
        _assert_close(out.outputs.embedding, want)
    assert_pages_returned(small)


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_mean_and_cls_pooling_chunked(embed_dir, tmp_path, mode):
    ckpt = tmp_path / mode
    shutil.copytree(embed_dir, ckpt)
    keys = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
    cfg = json.loads((ckpt / "1_Pooling" / "config.json").read_text())
    cfg["pooling_mode_lasttoken"] = False
    cfg[keys[mode]] = True
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    engine = LLM(str(ckpt), runner="pooling", max_num_batched_tokens=8, **ENGINE)
    assert not engine.engine.kv.enable_prefix_caching  # (every prompt row counts)
    prompts = _ids(engine, TEXTS)
    outs = engine.embed(prompts)
    for out, want in zip(outs, _reference(ckpt, prompts, mode), strict=True):
        _assert_close(out.outputs.embedding, want)
    assert_pages_returned(engine)


def test_defaults_without_sentence_transformers_files_and_a_bare_base_model(tmp_path, tokenizer_dir):
    """A bare Qwen3Model checkpoint (keys without `model.`, no lm_head) and no modules.json: last token,
    normalized (vLLM's default for decoder embedding models)."""
    from transformers import AutoModel

    full = build_checkpoint(tmp_path, "Qwen3ForCausalLM", tokenizer_dir, seed=5)
    bare = tmp_path / "bare"
    AutoModel.from_pretrained(full, dtype=torch.float32).save_pretrained(bare)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, bare / f.name)
    from safetensors import safe_open

    with safe_open(str(bare / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not any(k.startswith(("model.", "lm_head")) for k in keys)
    assert json.loads((bare / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    engine = LLM(str(bare), runner="pooling", **ENGINE)
    prompts = _ids(engine, TEXTS[:3])
    for out, want in zip(engine.embed(prompts), _reference(full, prompts), strict=True):
        _assert_close(out.outputs.embedding, want)
    with pytest.raises(ModelLoadError, match="lm_head.*--runner pooling"):  # (nothing to generate with)
        LLM(str(bare), **ENGINE)


def test_families_without_pooling_are_refused(tmp_path):
    from conftest import build_deepseek_checkpoint

    with pytest.raises(ConfigError, match="does not pool DeepseekV3ForCausalLM"):
        LLM(str(build_deepseek_checkpoint(tmp_path, "v3")), runner="pooling", skip_tokenizer_init=True, **ENGINE)


def test_prefix_cache_hits_keep_last_token_embeddings(embed_dir, llm):
    prompts = _ids(llm, [TEXTS[4]] * 2 + [TEXTS[4] + " more"])
    first = llm.embed(prompts[0])[0].outputs.embedding
    again = llm.embed(prompts)
    for out, want in zip(again, _reference(embed_dir, prompts), strict=True):
        _assert_close(out.outputs.embedding, want)
    _assert_close(again[0].outputs.embedding, torch.tensor(first))
    assert_pages_returned(llm)


def test_pooling_engine_errors(embed_dir, llm):
    with pytest.raises(InvalidRequestError, match="embed"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="context"):
        llm.embed([[1] * 129])
    assert len(llm.embed([[1] * 128])[0].outputs.embedding) == 64  # (a prompt may fill the context)
    plain = LLM(str(embed_dir), **ENGINE)
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        plain.embed("hello")
    with pytest.raises(ConfigError, match="speculative"):
        LLM(str(embed_dir), runner="pooling", speculative="ngram")
    with pytest.raises(ConfigError, match="--runner"):
        LLM(str(embed_dir), runner="embed")


def test_unsupported_modules_are_refused(embed_dir, tmp_path):
    ckpt = tmp_path / "dense"
    shutil.copytree(embed_dir, ckpt)
    modules = json.loads((ckpt / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (ckpt / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        LLM(str(ckpt), runner="pooling", **ENGINE)


def test_task_embed_is_an_alias_of_runner_pooling():
    import argparse

    from atlas.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args(["--task", "embed"]).runner == "pooling"
    assert parser.parse_args(["--runner", "pooling"]).runner == "pooling"
    assert parser.parse_args([]).runner == "generate"


# ---------------------------------------------------------------------------------- the HTTP API
@pytest.fixture(scope="module")
def server(embed_dir):
    srv = start_server(str(embed_dir), served_model_names=["embedder"], runner="pooling", **ENGINE)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_openai_client_embeddings(embed_dir, server, client, llm):
    prompts = _ids(llm, TEXTS)
    want = _reference(embed_dir, prompts)
    # (the client asks for base64 when not told, and decodes it; told base64, it hands the strings over)
    for fmt in ("float", "base64", None):
        kwargs = {"encoding_format": fmt} if fmt else {}
        resp = client.embeddings.create(model="embedder", input=TEXTS, **kwargs)
        assert resp.object == "list" and resp.model == "embedder"
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        for d, w in zip(resp.data, want, strict=True):
            _assert_close(_floats(d.embedding) if fmt == "base64" else d.embedding, w)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, prompts))
    one = client.embeddings.create(model="embedder", input=TEXTS[1])
    _assert_close(one.data[0].embedding, want[1])
    ids = client.embeddings.create(model="embedder", input=prompts[2])
    _assert_close(ids.data[0].embedding, want[2])
    lists = client.embeddings.create(model="embedder", input=prompts[:2])
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])
    # vLLM's truncate_prompt_tokens: an input longer than the context, embedded as its last k tokens
    long = (prompts[0] * 200)[:300]
    cut = client.embeddings.create(model="embedder", input=long, extra_body={"truncate_prompt_tokens": 9})
    _assert_close(cut.data[0].embedding, _reference(embed_dir, [long[-9:]])[0])
    assert cut.usage.prompt_tokens == 9
    assert_pages_returned(server.core)


def test_embeddings_equal_sentence_transformers(embed_dir, client, tmp_path):
    """The vectors sentence-transformers computes from the same folder (its modules.json, 1_Pooling and Normalize
    read by sentence-transformers itself): last-token pooling over HTTP, mean pooling offline."""
    st = pytest.importorskip("sentence_transformers")

    def reference(path) -> list[torch.Tensor]:
        model = st.SentenceTransformer(str(path), device="cpu")
        # One text a batch: sentence-transformers pads a batch and this tokenizer pads on the right.
        return [model.encode(t, convert_to_tensor=True).float() for t in TEXTS]

    got = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    for d, w in zip(got.data, reference(embed_dir), strict=True):
        _assert_close(d.embedding, w)
    mean = tmp_path / "mean"
    shutil.copytree(embed_dir, mean)
    cfg = json.loads((mean / "1_Pooling" / "config.json").read_text())
    (mean / "1_Pooling" / "config.json").write_text(json.dumps(
        {**cfg, "pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}))
    outs = LLM(str(mean), runner="pooling", **ENGINE).embed(TEXTS)
    for out, w in zip(outs, reference(mean), strict=True):
        _assert_close(out.outputs.embedding, w)


def _floats(text: str) -> list[float]:
    """base64 of little-endian float32 values (OpenAI's encoding) -> the values."""
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def test_base64_is_little_endian_float32(embed_dir, server, llm):
    resp = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"] == {"prompt_tokens": len(_ids(llm, TEXTS[:1])[0]),
                             "total_tokens": len(_ids(llm, TEXTS[:1])[0])}
    _assert_close(_floats(body["data"][0]["embedding"]), _reference(embed_dir, _ids(llm, TEXTS[:1]))[0])


def test_embedding_errors(server):
    url = server.url
    for body, param in [({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[]]}, "input"),
                        ({"input": 3}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "dimensions": 16}, "dimensions"),
                        ({"input": [[1] * 129]}, "input"), ({"input": [[1, 384]]}, "input")]:
        err = assert_error(httpx.post(url + "/v1/embeddings", json=body), 400, param)
        if param == "dimensions":
            assert "matryoshka" in err["message"]
    for route, body in [("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                        ("/v1/responses", {"input": "x"})]:
        err = assert_error(httpx.post(url + route, json=body), 400)
        assert "--runner pooling" in err["message"] and "/v1/embeddings" in err["message"]
    assert httpx.post(url + "/v1/embeddings", json={"input": [[1] * 128]}).status_code == 200


def test_score_and_rerank_are_cosine_similarities_of_the_embeddings(embed_dir, server, llm):
    """vLLM's /score (one text against each of a list; two lists pair by index) and /rerank (best first, top_n,
    documents returned or not) against the cosine similarity of transformers' pooled vectors."""
    want = _reference(embed_dir, _ids(llm, TEXTS))

    def cos(i: int, j: int) -> float:
        return float(torch.nn.functional.cosine_similarity(want[i].double(), want[j].double(), dim=0))

    url = server.url
    one = httpx.post(url + "/score", json={"model": "embedder", "text_1": TEXTS[0], "text_2": TEXTS[1:4]}).json()
    assert one["object"] == "list" and [d["index"] for d in one["data"]] == [0, 1, 2]
    assert [d["score"] for d in one["data"]] == pytest.approx([cos(0, 1), cos(0, 2), cos(0, 3)], abs=2e-3)
    assert one["usage"]["prompt_tokens"] == sum(map(len, _ids(llm, TEXTS[:4])))
    pairs = httpx.post(url + "/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:4]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([cos(0, 2), cos(1, 3)], abs=2e-3)
    assert_error(httpx.post(url + "/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[:3]}), 400, "text_2")
    assert_error(httpx.post(url + "/score", json={"text_1": "", "text_2": "x"}), 400, "text_1")
    scores = [cos(0, j) for j in range(1, 5)]
    order = sorted(range(4), key=lambda i: -scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(url + path, json={"query": TEXTS[0], "documents": TEXTS[1:5], "top_n": 3}).json()
        assert [r["index"] for r in body["results"]] == order[:3]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in order[:3]],
                                                                              abs=2e-3)
        assert [r["document"]["text"] for r in body["results"]] == [TEXTS[1 + i] for i in order[:3]]
    bare = httpx.post(url + "/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:3],
                                             "return_documents": False}).json()
    assert len(bare["results"]) == 2 and all(r["document"] is None for r in bare["results"])
    assert_error(httpx.post(url + "/rerank", json={"query": "x", "documents": []}), 400, "documents")


def test_score_on_a_generating_server_names_the_runner(qwen3_dir):
    srv = start_server(str(qwen3_dir), **ENGINE)
    try:
        err = assert_error(httpx.post(srv.url + "/score", json={"text_1": "a", "text_2": "b"}), 400)
        assert "--runner pooling" in err["message"]
    finally:
        srv.stop()


def test_matryoshka_dimensions(embed_dir, tmp_path, llm):
    ckpt = tmp_path / "mrl"
    shutil.copytree(embed_dir, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [16, 32, 64]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    srv = start_server(str(ckpt), runner="pooling", **ENGINE)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as c:
            resp = c.embeddings.create(model=str(ckpt), input=TEXTS[0], dimensions=16)
        full = _reference(embed_dir, _ids(llm, TEXTS[:1]))[0]
        _assert_close(resp.data[0].embedding, torch.nn.functional.normalize(full[:16], dim=-1))
        assert_error(httpx.post(srv.url + "/v1/embeddings", json={"input": "x", "dimensions": 20}), 400, "dimensions")
    finally:
        srv.stop()


def test_generation_server_refuses_embeddings(qwen3_dir):
    srv = start_server(str(qwen3_dir), **ENGINE)
    try:
        err = assert_error(httpx.post(srv.url + "/v1/embeddings", json={"input": "x"}), 400)
        assert "--runner pooling" in err["message"]
    finally:
        srv.stop()


def test_atlas_serve_runner_pooling_command(embed_dir, llm):
    """`atlas serve MODEL --task embed` (vLLM's older flag): the engine in its own process, its vectors over the
    ZeroMQ link to the front end."""
    cmd = [sys.executable, "-m", "atlas.cli", "serve", str(embed_dir), "--task", "embed", "--port", "0",
           "--kv-cache-memory", "4MiB", "--max-model-len", "128", "--served-model-name", "emb", "--no-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "ATLAS_API_KEY": ""})
    lines = []
    try:
        url = None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        assert "--runner pooling: embeddings only, pooling: last token, L2-normalized" in "".join(lines)
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
            resp = c.embeddings.create(model="emb", input=TEXTS[:2])
        for d, w in zip(resp.data, _reference(embed_dir, _ids(llm, TEXTS[:2])), strict=True):
            _assert_close(d.embedding, w)
        err = assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x"}), 400)
        assert "--runner pooling" in err["message"]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
