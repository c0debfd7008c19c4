"""--generation-config: the model's generation_config.json sampling defaults, applied as vLLM applies them."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from serving import start_server

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError

ENGINE = dict(kv_cache_memory="4MiB", max_model_len=128)


@pytest.fixture(scope="module")
def model_with_defaults(qwen3_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(qwen3_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.0, top_k=20, top_p=0.9, repetition_penalty=1.0, max_new_tokens=5)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_offline_defaults_come_from_the_model(model_with_defaults):
    llm = LLM(str(model_with_defaults), **ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.0, 20, 0.9, 5)
    out = llm.generate([[5, 6, 7]])[0].outputs[0]
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= 5
    ignored = LLM(str(model_with_defaults), generation_config="vllm", **ENGINE).get_default_sampling_params()
    assert (ignored.temperature, ignored.max_tokens) == (1.0, 16)


def test_server_applies_defaults_and_requests_override_them(model_with_defaults):
    server = start_server(str(model_with_defaults), **ENGINE)
    try:
        http = httpx.Client(base_url=server.url, timeout=60)
        body = {"prompt": [5, 6, 7], "ignore_eos": True}
        default = http.post("/v1/completions", json=body).json()
        assert default["usage"]["completion_tokens"] == 5  # max_new_tokens
        greedy = http.post("/v1/completions", json={**body, "temperature": 0, "max_tokens": 5}).json()
        assert default["choices"][0]["text"] == greedy["choices"][0]["text"]  # temperature 0.0
        longer = http.post("/v1/completions", json={**body, "max_tokens": 9}).json()
        assert longer["usage"]["completion_tokens"] == 9
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 5
        # A request's own temperature wins: sampled with a seed, differently from greedy over 20 tokens.
        texts = {http.post("/v1/completions", json={**body, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                    "seed": s, "max_tokens": 20}).json()["choices"][0]["text"]
                 for s in range(4)}
        assert len(texts) > 1
    finally:
        server.stop()


def test_generation_config_flag_values(model_with_defaults, tmp_path):
    with pytest.raises(ConfigError, match="no generation_config.json there"):
        LLM(str(model_with_defaults), generation_config=str(tmp_path), **ENGINE)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": "many"}))
    defaults = LLM(str(model_with_defaults), generation_config=str(tmp_path), **ENGINE).get_default_sampling_params()
    assert defaults.temperature == 0.3 and defaults.top_k == 0  # (a malformed value is left out, with a warning)


def test_chat_template_flag_replaces_the_tokenizers(qwen3_dir, tmp_path):
    """--chat-template takes a file or the template text (as vLLM's); chats render through it, offline and over
    HTTP; neither a file nor a template is refused."""
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    for value in (str(path), template):
        llm = LLM(str(qwen3_dir), chat_template=value, **ENGINE)
        out = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0))[0]
        assert out.prompt_token_ids == llm.engine.tokenizer.encode("<user>hi>", add_special_tokens=False)
    server = start_server(str(qwen3_dir), chat_template=str(path), **ENGINE)
    try:
        got = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_special_tokens": False},
                         timeout=30).json()
        assert got["tokens"] == llm.engine.tokenizer.encode("<user>hi>", add_special_tokens=False)
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="no such file, and not a Jinja template"):
        LLM(str(qwen3_dir), chat_template=str(tmp_path / "missing.jinja"), **ENGINE)
