"""POST /v1/responses with the official openai client: plain, streamed, tools, structured output,
previous_response_id; what Atlas cannot do is a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import start_server

ENGINE = dict(kv_cache_memory="8MiB", max_model_len=256)


@pytest.fixture(scope="module")
def client(qwen3_dir):
    server = start_server(str(qwen3_dir), served_model_names=["m"], settings={"trust_request_chat_template": True},
                          **ENGINE)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.stop()


def _chat(client, messages, **kwargs) -> str:
    out = client.chat.completions.create(model="m", messages=messages, temperature=0, **kwargs)
    return out.choices[0].message.content


def test_plain_and_instructions_equal_chat(client):
    resp = client.responses.create(model="m", input="hi", max_output_tokens=8, temperature=0)
    assert resp.object == "response" and resp.status == "incomplete"  # (8 tokens of a random model)
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == _chat(client, [{"role": "user", "content": "hi"}], max_tokens=8)
    assert resp.usage.output_tokens == 8 and resp.usage.input_tokens > 0
    resp = client.responses.create(model="m", instructions="be brief", max_output_tokens=6, temperature=0,
                                   input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    assert resp.output_text == _chat(client, [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi"}], max_tokens=6)


def test_streamed_events_carry_the_same_text(client):
    plain = client.responses.create(model="m", input="tell me", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model="m", input="tell me", max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    assert events[-1].response.output_text == plain.output_text
    assert events[-1].response.usage.output_tokens == 10


def test_forced_function_call_and_previous_response(client):
    tool = {"type": "function", "name": "get_weather", "description": "weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                           "required": ["city"], "additionalProperties": False}}
    resp = client.responses.create(model="m", input="weather in Paris?", tools=[tool], max_output_tokens=40,
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    # The tool's result, continuing the stored conversation.
    follow = client.responses.create(model="m", previous_response_id=resp.id, max_output_tokens=6, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny"}])
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": calls[0].call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}]
    assert follow.output_text == _chat(client, messages, max_tokens=6, tools=[
        {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")}}],
        tool_choice="none")
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        client.responses.create(model="m", previous_response_id="resp_nope", input="x")
    unstored = client.responses.create(model="m", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        client.responses.create(model="m", previous_response_id=unstored.id, input="x")


def test_json_schema_output(client):
    # (a digit: a random model's unbounded integer can run past any max_output_tokens)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    resp = client.responses.create(model="m", input="a number", max_output_tokens=30, temperature=0.8,
                                   text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert resp.status == "completed"
    assert isinstance(json.loads(resp.output_text)["n"], int)


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "web_search"}]), "tools[0]"),
    (dict(background=True), "background"),
    (dict(reasoning={"effort": "high"}), "reasoning_effort"),  # (this model's template does not read it)
    (dict(reasoning={"summary": "auto"}), "reasoning"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
     "input[0].content"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
])
def test_what_atlas_cannot_do_is_refused(client, kwargs, param):
    kwargs = {"input": "x", **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", max_output_tokens=2, **kwargs)
    assert err.value.body["param"] == param, err.value.body


def test_reasoning_effort_is_the_templates_variable(client):
    """reasoning_effort (chat; Responses' reasoning.effort) is the chat template's variable of that name, as gpt-oss's
    template reads it; a 400 where the template does not read it (it would change nothing)."""
    template = ("{% if reasoning_effort is defined %}<effort:{{ reasoning_effort }}>{% endif %}{% for m in messages %}"
                "<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    ids = {"return_token_ids": True}
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                         reasoning_effort="low", extra_body={"chat_template": template, **ids})
    want = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize", timeout=30,
                      json={"prompt": "<effort:low><user>hi>", "add_special_tokens": False}).json()["tokens"]
    assert out.model_dump()["prompt_token_ids"] == want
    for kwargs in (dict(extra_body=ids), dict(extra_body={"chat_template": template, "chat_template_kwargs": {
            "reasoning_effort": "high"}})):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           reasoning_effort="low", **kwargs)
        assert err.value.body["param"] == "reasoning_effort", err.value.body
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"reasoning_effort": "extreme"})
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=1, extra_body={"reasoning_effort": "low"})
    assert err.value.body["param"] == "reasoning_effort"


def test_the_response_store_is_bounded():
    """previous_response_id's store keeps the newest conversations within its count and size, oldest dropped first
    (one read makes a conversation the newest); one larger than the whole store is not kept."""
    from atlas.engine.response_store import ResponseStore

    store = ResponseStore(max_responses=2, max_chars=210)
    message = [{"role": "user", "content": "x" * 40}]  # (73 characters as JSON)
    for rid in ("a", "b", "c"):
        store.put(rid, message)
    assert store.get("a") is None and store.get("b") == message and store.get("c") == message
    store.put("d", [{"role": "user", "content": "y" * 100}])  # (a third: b, the least recently read, goes)
    assert store.get("b") is None and store.get("c") == message and store.get("d") is not None
    store.put("huge", [{"role": "user", "content": "z" * 500}])
    assert store.get("huge") is None and store.get("c") == message
