"""Structured outputs, tool calling and reasoning output over HTTP with the official `openai` client,
langchain-openai and `beta.chat.completions.parse`, against `atlas serve` on the shipped model (one
server for the module; the tool-call and reasoning parsers are switched on its settings)."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import assert_error, start_server

MODEL = "atlas-default"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["module", "class", "function"]},
        "owner": {"type": "object", "properties": {"login": {"type": "string", "maxLength": 8},
                                                   "admin": {"type": "boolean"}},
                  "required": ["login", "admin"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["os", "sys", "re"]}, "maxItems": 3},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "kind", "owner", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    srv = start_server(None, kv_cache_memory="64MiB", max_model_len=512,
                       settings=dict(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                     reasoning_parser="qwen3", trust_request_chat_template=True))
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture()
def settings(server):
    """Switch the server's settings for one test (the parsers are read per request)."""
    state = server.state
    original = state.settings

    def switch(**changes):
        state.settings = dataclasses.replace(original, **changes)

    yield switch
    state.settings = original


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", USER), **kw)


def streamed(client, **kw) -> tuple[str | None, str | None, list[tuple[str, str]], str]:
    """(content, reasoning_content, [(tool name, arguments)], finish_reason) put together from a stream."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chat(client, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": "", "id": None})
            if call.id:
                assert entry["id"] is None, "a call's id comes once"
                entry["id"] = call.id
                assert call.function.name and call.type == "function"
                entry["name"] = call.function.name
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, reasoning or None, [(c["name"], c["arguments"]) for c in calls.values()], finish


# ---------------------------------------------------------------------------------- parsers, settings
PARSER_CASES = [
    # (reasoning parser, tool parser, text, (reasoning, content, [(name, arguments)]))
    (None, "hermes", 'Checking <b>.<tool_call>\n{"name": "f", "arguments": {"q": "a</tool_call"}}\n</tool_call>'
                     '<tool_call>{"arguments": {"n": [1, 2]}, "name": "g"}</tool_call>',
     (None, "Checking <b>.", [("f", '{"q": "a</tool_call"}'), ("g", '{"n": [1, 2]}')])),
    ("qwen3", "llama3_json", '<think>\nhm</think>\n\n<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
                             '{"name": "g", "parameters": {}}', ("\nhm", None, [("f", '{"x": 1}'), ("g", "{}")])),
    (None, "llama3_json", "<|not a tag", (None, "<|not a tag", [])),
    ("deepseek_r1", None, "step one</think>Four.", ("step one", "Four.", [])),
    # the opening tag written by the model itself (held back while it may still be the tag), and one that is not it
    ("deepseek_r1", None, "<think>step one</think>Four.", ("step one", "Four.", [])),
    ("deepseek_r1", None, "<b>step</b> one</think>Four.", ("<b>step</b> one", "Four.", [])),
    ("qwen3", None, "No <think> here.", (None, "No <think> here.", [])),
    ("qwen3", None, "<think>cut off", ("cut off", None, [])),
]


@pytest.mark.parametrize("reasoning,tools,text,expected", PARSER_CASES)
def test_parsers_stream_what_they_return_whole(reasoning, tools, text, expected):
    from atlas.server.output_parsers import TOOL_PARSERS, ChoiceParser, ReasoningParser

    def parser() -> ChoiceParser:
        return ChoiceParser(ReasoningParser(reasoning) if reasoning else None, TOOL_PARSERS[tools]() if tools else None)

    whole = parser().parse(text, final=True)
    assert (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.calls]) == expected
    streaming, reasoning_text, content, calls = parser(), "", "", {}
    for end in range(1, len(text) + 1):  # one character at a time
        r, c, deltas = streaming.delta(text[:end], final=end == len(text))
        reasoning_text += r or ""
        content += c or ""
        for d in deltas:
            call = calls.setdefault(d["index"], ["", ""])
            call[0] += d["function"].get("name", "")
            call[1] += d["function"].get("arguments", "")
    assert (reasoning_text or None, content or None, [tuple(c) for c in calls.values()]) == expected


def test_server_settings_check_the_parser_flags():
    from atlas.server.settings import ServerSettings

    for bad in (dict(enable_auto_tool_choice=True), dict(tool_call_parser="xml"), dict(reasoning_parser="o1")):
        with pytest.raises(ValueError):
            ServerSettings(**bad)


# ---------------------------------------------------------------------------------- structured outputs
def test_json_schema_responses_validate_greedy_and_sampled(client):
    prompts = ["def f(x):\n", "import os\n", "class A:\n", "# The end\n", "x = ", "Hello"]
    greedy = client.completions.create(model=MODEL, prompt=prompts, max_tokens=150, temperature=0,
                                       extra_body={"response_format": RESPONSE_FORMAT})
    sampled = chat(client, n=6, max_tokens=150, temperature=1.0, seed=7, response_format=RESPONSE_FORMAT)
    texts = [c.text for c in greedy.choices] + [c.message.content for c in sampled.choices]
    for choice, text in zip(greedy.choices + sampled.choices, texts, strict=True):
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts[len(prompts):])) > 1  # the seeds sampled different documents
    whole = chat(client, max_tokens=150, temperature=0, response_format=RESPONSE_FORMAT).choices[0]
    assert streamed(client, max_tokens=150, temperature=0, response_format=RESPONSE_FORMAT) == (
        whole.message.content, None, [], "stop")


def test_other_constraints_and_their_fields(client):
    obj = chat(client, max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    cases = [({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
             ({"structured_outputs": {"regex": r"[0-9]{2}:[0-9]{2}"}}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
             ({"structured_outputs": {"grammar": 'root ::= "ok" | "no"'}}, lambda t: t in ("ok", "no")),
             ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
              lambda t: isinstance(json.loads(t), list))]
    for body, check in cases:
        out = client.completions.create(model=MODEL, prompt="x = ", max_tokens=30, temperature=0.7, seed=3,
                                        extra_body=body)
        assert check(out.choices[0].text), (body, out.choices[0].text)


def test_parse_with_pydantic_model(client):
    class Record(BaseModel):
        name: str = Field(max_length=10)
        kind: str = Field(pattern="^(module|class)$")
        admin: bool

    completion = client.beta.chat.completions.parse(model=MODEL, messages=USER, response_format=Record,
                                                    max_tokens=80, temperature=0)
    assert isinstance(completion.choices[0].message.parsed, Record)


# ---------------------------------------------------------------------------------- tools
def test_forced_tool_calls_have_valid_arguments_streamed_or_not(client):
    required = chat(client, tools=TOOLS, tool_choice="required", n=3, temperature=1.0, seed=5, max_tokens=80)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            schema = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice_kw in ({"tool_choice": named}, {"tool_choice": "required", "parallel_tool_calls": False}):
        whole = chat(client, tools=TOOLS, temperature=0, max_tokens=80, **choice_kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0][1]), WEATHER if calls[0][0] == "get_weather" else {})
        content, _, stream_calls, finish = streamed(client, tools=TOOLS, temperature=0, max_tokens=80, **choice_kw)
        assert (content, stream_calls, finish) == (whole.message.content, calls, whole.finish_reason)
    assert whole.finish_reason == "tool_calls"


# Tools whose parameters refer to their own parts: "#/$defs/..." and "#" (the parameters themselves).
UNIT_TOOL = {"type": "object", "$defs": {"unit": {"enum": ["C", "F"]}},
             "properties": {"unit": {"$ref": "#/$defs/unit"}}, "required": ["unit"], "additionalProperties": False}
TREE_TOOL = {"type": "object", "properties": {"leaf": {"type": "boolean"},
                                              "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["leaf", "child"], "additionalProperties": False}


def test_required_tool_calls_keep_each_tools_own_references(client):
    """Under tool_choice "required" the tools' schemas sit inside one array schema; each one's local
    references still resolve inside its own parameters (they were refused, or resolved against the array)."""
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": UNIT_TOOL}},
             {"type": "function", "function": {"name": "grow", "parameters": TREE_TOOL}}]
    schemas = {"set_unit": UNIT_TOOL, "grow": TREE_TOOL}
    checked = 0
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 4}):
        for choice in chat(client, tools=tools, tool_choice="required", max_tokens=120, **kw).choices:
            if choice.finish_reason != "tool_calls":
                continue  # (cut by max_tokens)
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                checked += 1
    assert checked >= 2


def test_auto_tool_calls_are_parsed_from_text_in_each_format(client, settings):
    city = r'"city": "[a-z]{2,8}", "unit": "C"'
    hermes = rf'I will check\. <tool_call>\n\{{"name": "get_weather", "arguments": \{{{city}\}}\}}\n</tool_call>'
    llama = rf'\{{"name": "get_weather", "parameters": \{{{city}\}}\}}; \{{"name": "get_time", "parameters": \{{\}}\}}'
    for parser, regex, names, content in (("hermes", hermes, ["get_weather"], "I will check. "),
                                          ("llama3_json", llama, ["get_weather", "get_time"], None)):
        settings(tool_call_parser=parser)
        kw = dict(tools=TOOLS, max_tokens=200, temperature=0.8, seed=2,
                  extra_body={"structured_outputs": {"regex": regex}})  # the model writes the format
        whole = chat(client, **kw).choices[0]
        assert whole.finish_reason == "tool_calls"
        assert whole.message.content == content
        assert [c.function.name for c in whole.message.tool_calls] == names
        jsonschema.validate(json.loads(whole.message.tool_calls[0].function.arguments), WEATHER)
        s_content, _, s_calls, finish = streamed(client, **kw)
        assert (s_content, finish) == (content, "tool_calls")
        assert s_calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    first_only = chat(client, parallel_tool_calls=False, **kw).choices[0].message.tool_calls  # (llama3_json, 2 calls)
    assert [c.function.name for c in first_only] == ["get_weather"]
    settings(tool_call_parser="hermes")
    plain = chat(client, tools=TOOLS, max_tokens=8, temperature=0).choices[0]  # no call in the text: content
    assert plain.message.tool_calls == [] and plain.message.content and plain.finish_reason != "tool_calls"


def test_tool_messages_render_through_the_template(server):
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}{% else %}{{ m.content }}"
                "{% endif %}<|im_end|>\n{% endfor %}{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}")
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"messages": messages, "chat_template": template, "add_generation_prompt": False, "tools": TOOLS}
        ids = http.post("/tokenize", json=body).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert "CALL get_weather Paris" in text and "<|im_start|>tool\nsunny" in text
        assert "TOOL get_weather\nTOOL get_time" in text
        reply = http.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "tool_choice": "none",
                                                        "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        # chat_template_kwargs reach the template (enable_thinking, as Qwen3's reads it)
        thinking = "{{ 'THINK' if enable_thinking is not defined or enable_thinking else 'NOTHINK' }}"
        for kwargs, word in (({}, "THINK"), ({"enable_thinking": False}, "NOTHINK")):
            got = http.post("/tokenize", json={"messages": USER, "chat_template": thinking,
                                               "chat_template_kwargs": kwargs}).json()["tokens"]
            assert http.post("/detokenize", json={"tokens": got}).json()["prompt"] == word


def test_default_chat_template_kwargs_sit_under_the_requests_own(server, settings):
    """--default-chat-template-kwargs (vLLM's): variables every chat renders with, which the request's own
    chat_template_kwargs override, in /tokenize and the chat route alike; names the server sets per request are
    refused when the server starts."""
    thinking = "{{ 'THINK' if enable_thinking is not defined or enable_thinking else 'NOTHINK' }}{{ style }}"
    settings(default_chat_template_kwargs={"enable_thinking": False, "style": "-terse"})
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for kwargs, text in (({}, "NOTHINK-terse"), ({"enable_thinking": True}, "THINK-terse"),
                             ({"style": ""}, "NOTHINK")):
            got = http.post("/tokenize", json={"messages": USER, "chat_template": thinking,
                                               "chat_template_kwargs": kwargs}).json()["tokens"]
            assert http.post("/detokenize", json={"tokens": got}).json()["prompt"] == text
        reply = http.post("/v1/chat/completions", json={"messages": USER, "chat_template": thinking, "max_tokens": 1,
                                                        "temperature": 0}).json()
        want = len(http.post("/tokenize", json={"prompt": "NOTHINK-terse", "add_special_tokens": False}
                             ).json()["tokens"])
        assert reply["usage"]["prompt_tokens"] == want
    from atlas.server.settings import ServerSettings

    for bad in ({"messages": []}, {"chat_template": "x"}, ["enable_thinking"]):
        with pytest.raises(ValueError, match="default-chat-template-kwargs"):
            ServerSettings(default_chat_template_kwargs=bad)


def test_exclude_tools_when_tool_choice_none(server, settings):
    """--exclude-tools-when-tool-choice-none (vLLM's): with tool_choice "none" the chat renders without its tools;
    by default (and with any other tool_choice) the tools are rendered."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% for t in tools or [] %}|{{ t.function.name }}{% endfor %}"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        def prompt_tokens(tool_choice: str) -> int:
            reply = http.post("/v1/chat/completions", json={
                "messages": USER, "chat_template": template, "tools": TOOLS, "tool_choice": tool_choice,
                "max_tokens": 1, "temperature": 0})
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens"]

        def tokens(text: str) -> int:
            return len(http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"])

        content = USER[-1]["content"]
        with_tools = tokens(content + "|get_weather|get_time")
        assert prompt_tokens("none") == prompt_tokens("auto") == with_tools
        settings(exclude_tools_when_tool_choice_none=True)
        assert prompt_tokens("none") == tokens(content) < with_tools
        assert prompt_tokens("auto") == with_tools


# ---------------------------------------------------------------------------------- reasoning
def test_reasoning_content_is_split_streamed_or_not(client, settings):
    for parser, regex, answer_re in (("qwen3", r"<think>[a-z ]{5,20}</think>\n\nThe answer is [0-9]\.", "The answer"),
                                     ("deepseek_r1", r"[a-z ]{5,20}</think>Done [0-9]\.", "Done")):
        settings(reasoning_parser=parser)
        kw = dict(max_tokens=60, temperature=0.9, seed=4, extra_body={"structured_outputs": {"regex": regex}})
        message = chat(client, **kw).choices[0].message
        assert re.fullmatch(r"[a-z ]{5,20}", message.reasoning_content), message
        assert message.content.startswith(answer_re) and "think>" not in message.content
        content, reasoning, _, _ = streamed(client, **kw)
        assert (content, reasoning) == (message.content, message.reasoning_content)
    unfinished = chat(client, max_tokens=6, temperature=0).choices[0].message  # deepseek_r1: still thinking
    assert unfinished.reasoning_content and unfinished.content is None
    settings(reasoning_parser="qwen3")
    plain = chat(client, max_tokens=6, temperature=0).choices[0].message  # qwen3: no <think>, all content
    assert plain.content == unfinished.reasoning_content and getattr(plain, "reasoning_content", None) is None


# ---------------------------------------------------------------------------------- bad input
def test_bad_constraints_and_tools_are_400(server, client, settings):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param in (
                ({"response_format": bad}, "response_format"),
                ({"response_format": {"type": "json_schema"}}, "response_format"),
                ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
                ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                ({"tools": bad_tool, "tool_choice": "required"}, "tools[0].function.parameters"),
                ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                ({"tools": TOOLS, "tool_choice": "required", "response_format": RESPONSE_FORMAT}, "response_format"),
                ({"tool_choice": "required"}, "tool_choice"),
                ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages")):
            resp = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
            assert_error(resp, 400, param=param)
        settings(enable_auto_tool_choice=False)
        assert_error(http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS}), 400,
                     param="tool_choice")
    settings()
    assert chat(client, max_tokens=3, temperature=0).choices[0].message.content  # the server goes on


# ---------------------------------------------------------------------------------- langchain
def test_langchain_bind_tools_and_structured_output(server):
    import langchain_openai  # (a test dependency: pip install -e ".[test]")

    class Weather(BaseModel):
        city: str = Field(max_length=10)
        unit: str = Field(pattern="^(C|F)$")

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0,
                                      max_tokens=80, max_retries=0)
    tool_message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    assert [c["name"] for c in tool_message.tool_calls] == ["Weather"]
    Weather(**tool_message.tool_calls[0]["args"])
    assert isinstance(llm.with_structured_output(Weather).invoke("Weather in Paris?"), Weather)


def test_a_grammar_that_dead_ends_fails_the_request_not_the_server(qwen3_dir, monkeypatch):
    """xgrammar compiles a[^\\s\\S]b and allows "a", then nothing: the request is a 400 naming the constraint
    (an error event then [DONE] when streamed), never a 200 with "a" as if it had finished; a constraint past
    --structured-outputs-compile-timeout is a 400 naming the flag; the server goes on."""
    from atlas.structured import grammar as grammar_module

    srv = start_server(str(qwen3_dir), kv_cache_memory="32MiB", max_model_len=256,
                       structured_outputs_backend="xgrammar", structured_outputs_compile_timeout=0.5,
                       structured_outputs_compile_memory="0")  # (no trial worker: its start-up is not 0.5 s)
    real = grammar_module.StructuredOutputManager._compile_now

    def slow_for_choices(self, spec):
        if spec.choice is not None:
            time.sleep(3)
        return real(self, spec)

    monkeypatch.setattr(grammar_module.StructuredOutputManager, "_compile_now", slow_for_choices)
    try:
        body = {"model": str(qwen3_dir), "prompt": "x", "max_tokens": 8, "temperature": 1.0, "seed": 1,
                "structured_outputs": {"regex": r"a[^\s\S]b"}}
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            err = assert_error(http.post("/v1/completions", json=body), 400, param="structured_outputs")
            assert "allows no token" in err["message"]
            events = http.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
            assert '"error"' in events[-3] and "allows no token" in events[-3] and events[-2] == "data: [DONE]"
            ok = http.post("/v1/completions", json={**body, "structured_outputs": {"regex": "[0-9]{2}"}})
            assert ok.status_code == 200 and re.fullmatch("[0-9]{2}", ok.json()["choices"][0]["text"])
            err = assert_error(http.post("/v1/completions", json={**body, "structured_outputs": {"choice": ["y"]}}),
                               400, param="structured_outputs")
            assert "--structured-outputs-compile-timeout" in err["message"]
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------- structural tags
TAG_WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                "degrees": {"type": "integer", "minimum": -50, "maximum": 50}},
               "required": ["city", "degrees"]}  # (additionalProperties left out: other properties are allowed)


def tagged_json(text: str, begin: str, end: str, schema: dict, finished: bool) -> int:
    """Check every `begin` in text is followed by JSON valid against schema and then `end` (the last one may be
    cut off when the reply ran out of tokens); the number of complete tags."""
    complete, at = 0, text.find(begin)
    while at >= 0:
        rest = text[at + len(begin):]
        body = rest.lstrip()
        try:
            value, used = json.JSONDecoder().raw_decode(body)
        except ValueError:
            assert not finished, text  # (an unfinished document is only allowed at the end of a cut-off reply)
            return complete
        jsonschema.validate(value, schema)
        after = body[used:].lstrip()
        if not after.startswith(end):
            assert not finished and end.startswith(after), repr(text)
            return complete
        complete += 1
        next_text = after[len(end):]
        at = text.find(begin, len(text) - len(next_text))
    return complete


def test_structural_tags_enforce_their_json_wherever_a_trigger_starts_one(server, client):
    """vLLM's first form: free text, and each "<" (the trigger) starts <weather>JSON</weather>. The "<" token is
    pushed up so that the sampled replies open tags."""
    (lt,) = server.core.tokenizer.encode("<", add_special_tokens=False)
    tag = {"type": "structural_tag", "structures": [{"begin": "<weather>", "schema": TAG_WEATHER, "end": "</weather>"}],
           "triggers": ["<"]}
    out = chat(client, n=6, max_tokens=150, temperature=1.0, seed=11, response_format=tag, logit_bias={str(lt): 6})
    complete = 0
    for c in out.choices:
        text = c.message.content
        complete += tagged_json(text, "<weather>", "</weather>", TAG_WEATHER, c.finish_reason == "stop")
        # outside the tags, no "<": a trigger always starts a tag
        assert "<" not in re.sub(r"<weather>.*?</weather>", "", text, flags=re.S).rpartition("<weather>")[0], text
    assert complete >= 2, [c.message.content for c in out.choices]


def test_structural_tags_in_xgrammars_form(client):
    """The newer form (a format tree) through structured_outputs.structural_tag, as an object or its JSON text;
    an object schema without additionalProperties keeps other properties allowed, as JSON Schema has it."""
    fmt = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "tag", "begin": "<w>", "content": {"type": "json_schema", "json_schema": TAG_WEATHER,
                                                    "max_whitespace_cnt": 1}, "end": "</w>"}]}}
    for given in (fmt, json.dumps(fmt)):
        out = client.completions.create(model=MODEL, prompt="The weather:", max_tokens=80, temperature=1.0, n=4,
                                        seed=2, extra_body={"structured_outputs": {"structural_tag": given}})
        for c in out.choices:
            assert c.text.startswith("Answer: <w>"), c.text
            if c.finish_reason == "stop":
                assert c.text.endswith("</w>"), c.text
                jsonschema.validate(json.loads(c.text[len("Answer: <w>"):-len("</w>")]), TAG_WEATHER)
    from atlas.structured.structural_tag import normalize_structural_tag

    inner = normalize_structural_tag(fmt)["format"]["elements"][1]["content"]["json_schema"]
    assert inner["additionalProperties"] is True and "additionalProperties" not in TAG_WEATHER


def test_structural_tags_that_cannot_be_enforced_exactly_are_400(server):
    def legacy(schema, begin="<a>", triggers=("<",)):
        return {"type": "structural_tag", "structures": [{"begin": begin, "schema": schema, "end": "</a>"}],
                "triggers": list(triggers)}

    cases = [
        ({"response_format": legacy({"type": "string", "pattern": "^a+$"})}, "response_format", "'pattern'"),
        ({"response_format": legacy({"type": "object"}, begin="[a]")}, "response_format", "none of the triggers"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "token", "token": "<a>"}}},
         "response_format", "'token'"),
        ({"structured_outputs": {"structural_tag": {"format": {"type": "json_schema", "json_schema": {},
                                                               "style": "qwen_xml"}}}},
         "structured_outputs", "qwen_xml"),
        ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs", "not valid JSON"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "structures"),
        ({"structural_tag": json.dumps(legacy({}))}, "structural_tag", "response_format"),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param, words in cases:
            resp = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
            err = assert_error(resp, 400, param=param)
            assert words in err["message"], (body, err)


def test_llguidance_refuses_structural_tags_naming_them():
    from atlas.sampling_params import StructuredOutputsParams
    from atlas.structured.json_schema import GrammarCompileError
    from atlas.structured.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend.__new__(LLGuidanceBackend)
    with pytest.raises(GrammarCompileError) as info:
        backend.compile(StructuredOutputsParams(structural_tag={"structures": [], "triggers": []}))
    assert info.value.param == "structural_tag" and "xgrammar" in str(info.value)
