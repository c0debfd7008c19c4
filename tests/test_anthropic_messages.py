"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official `anthropic` client:
the same greedy text as the chat endpoint for the same conversation, streamed and whole; tool_use blocks from the
tool-call parser (the model made to write the hermes format by a regex), stop reasons, a conversation with tool
results counted as its chat equivalent, and the refusals in Anthropic's error form."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import start_server

anthropic = pytest.importorskip("anthropic")

KEY = "test-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
HERMES = r'Checking\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    srv = start_server(None, api_key=KEY, kv_cache_memory="64MiB", max_model_len=512,
                       settings=dict(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as c:
        yield c


def test_a_message_is_the_chat_endpoints_reply(server, client):
    user = [{"role": "user", "content": "Say something."}]
    greedy = {"temperature": 0}  # (this client has no sampling arguments: they travel as extra fields, as to vLLM)
    msg = client.messages.create(model="atlas-default", max_tokens=12, messages=user, system="Be brief.",
                                 extra_body=greedy)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as oa:
        chat = oa.chat.completions.create(model="atlas-default", max_tokens=12, temperature=0,
                                          messages=[{"role": "system", "content": "Be brief."}, *user])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 12
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model="atlas-default", messages=user, system="Be brief.")
    assert counted.input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(model="atlas-default", max_tokens=12, messages=user, system="Be brief.",
                                extra_body=greedy) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds


def test_tool_use_blocks_and_stop_reasons(client):
    kw = dict(model="atlas-default", max_tokens=80, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=TOOLS, extra_body={"temperature": 0.8, "seed": 3, "structured_outputs": {"regex": HERMES}})
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.content[0].text == "Checking. "
    call = msg.content[1]
    assert call.name == "get_weather" and set(call.input) == {"city"} and call.id
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].input == call.input
    # a stop sequence the reply reaches
    stopped = client.messages.create(model="atlas-default", max_tokens=20, stop_sequences=["world"],
                                     messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"structured_outputs": {"regex": "hello world again"}})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "world")
    assert stopped.content[0].text == "hello "
    # output_config's JSON schema format constrains the text
    shaped = client.messages.create(model="atlas-default", max_tokens=60, messages=[{"role": "user", "content": "Hi"}],
                                    output_config={"format": {"type": "json_schema", "schema": {
                                        **WEATHER, "additionalProperties": False}}})
    value = json.loads(shaped.content[0].text)
    assert set(value) == {"city"} and isinstance(value["city"], str) and len(value["city"]) <= 10


def test_a_conversation_with_tool_results_counts_as_its_chat(server, client):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"}]}]
    counted = client.messages.count_tokens(model="atlas-default", messages=messages, tools=TOOLS)
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "user", "content": "And tomorrow?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": WEATHER}}]
    want = httpx.post(server.url + "/tokenize", json={"messages": chat, "tools": tools},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["count"]
    assert counted.input_tokens == want
    reply = client.messages.create(model="atlas-default", max_tokens=3, messages=messages, tools=TOOLS)
    assert reply.usage.input_tokens == want


@pytest.mark.parametrize("body,words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                                                                             "image/png", "data": "AA=="}}]}]},
     "image block"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "budget"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"container": "container_1"}, "container"),
    ({"output_config": {"effort": "max"}}, "effort"),
])
def test_what_is_not_supported_is_refused_in_anthropics_form(server, body, words):
    request = {"model": "atlas-default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **body}
    reply = httpx.post(server.url + "/v1/messages", json=request, headers={"x-api-key": KEY}, timeout=30)
    assert reply.status_code == 400
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]
    assert httpx.post(server.url + "/v1/messages", json=request, timeout=30).json()["error"]["type"] == (
        "authentication_error")
