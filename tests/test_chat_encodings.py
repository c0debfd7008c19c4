"""DeepSeek-V3.2's chat format (engine/chat_encodings.py), which ships as code rather than a chat template: the text
of chats in chat and thinking mode, with tools, tool calls and their results (written out by hand from the published
format); --tokenizer-mode deepseek_v32 over HTTP (/tokenize, and a chat reply through it); and a deepseek_v32
checkpoint without a chat template taking the format by itself."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from conftest import _build, _correction_bias
from serving import start_server

from atlas import LLM
from atlas.engine.chat_encodings import render_deepseek_v32
from atlas.errors import InvalidRequestError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
D = "｜DSML｜"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}


def test_chat_mode_closes_thinking_after_every_user_turn():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "dropped"},
                {"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}]}]
    assert render_deepseek_v32(messages) == (
        f"{BOS}Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}<｜User｜>Two\nparts<｜Assistant｜></think>")


def test_thinking_mode_opens_thinking_after_the_last_user_turn_only():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r0"},
                {"role": "user", "content": "c"}]
    assert render_deepseek_v32(messages, thinking=True) == (
        f"{BOS}<｜User｜>a<｜Assistant｜></think>b{EOS}<｜User｜>c<｜Assistant｜><think>")
    # (a developer message is a user turn with its text introduced)
    assert render_deepseek_v32([{"role": "developer", "content": "x"}]) == (
        f"{BOS}<｜User｜>\n\n# The user's message is: x<｜Assistant｜></think>")


def test_tools_tool_calls_and_their_results():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {
                     "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = render_deepseek_v32(messages, [WEATHER], thinking=True)
    tools_block = text[len(BOS): text.index("<｜User｜>")]
    assert tools_block.startswith("\n\n## Tools\n\nYou have access to a set of tools")
    assert f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>' in tools_block
    assert tools_block.endswith("<functions>\n" + json.dumps(WEATHER["function"]) + "\n</functions>\n")
    assert text[text.index("<｜User｜>"):] == (
        "<｜User｜>Weather in Paris?<｜Assistant｜><think>"
        f"Need the tool.</think>\n\n<{D}function_calls>\n<{D}invoke name=\"get_weather\">\n"
        f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
        f"<{D}parameter name=\"days\" string=\"false\">2</{D}parameter>\n</{D}invoke>\n</{D}function_calls>{EOS}"
        "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n<think>")
    # in chat mode the same turns carry no reasoning and close thinking after the results
    chat = render_deepseek_v32(messages, [WEATHER])
    assert f"<｜Assistant｜></think>\n\n<{D}function_calls>" in chat
    assert "Need the tool." not in chat and chat.endswith("</function_results>\n\n</think>")
    with pytest.raises(InvalidRequestError, match="tool message must follow"):
        render_deepseek_v32([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_tokenizer_mode_deepseek_v32_renders_chats_over_http(qwen3_dir):
    server = start_server(str(qwen3_dir), kv_cache_memory="16MiB", max_model_len=512, tokenizer_mode="deepseek_v32")
    try:
        http = httpx.Client(base_url=server.url, timeout=60)
        messages = [{"role": "user", "content": "Hi"}]
        for kwargs, thinking in (({}, False), ({"thinking": True}, True), ({"enable_thinking": True}, True)):
            ids = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": kwargs}).json()["tokens"]
            text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
            assert text == render_deepseek_v32(messages, thinking=thinking)
        reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()
        assert reply["usage"]["prompt_tokens"] == len(http.post("/tokenize", json={"messages": messages}
                                                                ).json()["tokens"])
    finally:
        server.stop()


def test_a_deepseek_v32_checkpoint_without_a_chat_template_takes_its_format(tmp_path, tokenizer_dir):
    from test_dsa import V32

    bare = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    path = _build(tmp_path, "v32", V32, bare, 0, {}, randomize=_correction_bias)
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=8, max_model_len=256)
    assert llm.engine.tokenizer.chat_encoding == "deepseek_v32"
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, None)[0]
    want = llm.engine.tokenizer.encode(render_deepseek_v32(messages), add_special_tokens=False)
    assert out.prompt_token_ids == want
