"""The OpenAI-compatible server over real HTTP on 127.0.0.1: the official `openai` client for the
API, httpx for raw and malformed requests. Greedy outputs are compared with the offline LLM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import assert_pages_returned
from prometheus_client.parser import text_string_to_metric_families
from serving import assert_error, start_server, wait_until

from atlas import LLM, SamplingParams

API_KEY = "test-key"
MAX_MODEL_LEN = 256
ENGINE = dict(kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
PROMPTS = [
    "def wrap(text, width=70):",
    "The TextWrapper instance",
    "    # Hardcode the recognized whitespace characters",
    "import re",
    "class TextWrapper:",
    "Object for wrapping/filling text.",
    "def dedent(text):",
    "    return text",
]


@pytest.fixture(scope="module")
def server(qwen3_dir):
    srv = start_server(str(qwen3_dir), api_key=API_KEY, **ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(qwen3_dir):
    return LLM(str(qwen3_dir), **ENGINE)


@pytest.fixture(scope="module")
def model_name(qwen3_dir):
    return str(qwen3_dir)


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def pages_free(server) -> bool:
    kv = server.core.kv
    return kv.num_free_pages == kv.num_pages and not server.core.has_unfinished()


# ---------------------------------------------------------------------------------- completions
def test_completion_stream_and_plain_equal_offline(client, offline, model_name, server):
    prompt = PROMPTS[0]
    ref = offline.generate(prompt, greedy(24, ignore_eos=True))[0]
    resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == model_name
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 24
    assert resp.usage.total_tokens == len(ref.prompt_token_ids) + 24

    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk carries the usage so far, up to the final one's.
    options = {"include_usage": True, "continuous_usage_stats": True}
    steady = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in steady]
    assert all(c.usage.prompt_tokens == len(ref.prompt_token_ids) for c in steady)
    assert counts == sorted(counts) and counts[-1] == 24 and counts[0] > 0 and len(set(counts)) > 1
    assert "".join(c.choices[0].text for c in steady if c.choices) == ref.outputs[0].text
    chat = list(client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0, stream=True, stream_options=options,
                                               extra_body={"ignore_eos": True}))
    assert chat[0].usage.completion_tokens == 0 and chat[-1].usage.completion_tokens == 6
    assert all(c.usage is not None and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chat)
    assert wait_until(lambda: pages_free(server))


def test_completion_default_max_tokens_and_eos(client, offline, model_name):
    """Without max_tokens a completion gets OpenAI's 16; EOS ends it with finish_reason stop."""
    for prompt in PROMPTS:
        ref = offline.generate(prompt, greedy(16))[0].outputs[0]
        resp = client.completions.create(model=model_name, prompt=prompt, temperature=0)
        assert resp.choices[0].text == ref.text
        assert resp.choices[0].finish_reason == ref.finish_reason
        assert resp.usage.completion_tokens == len(ref.token_ids) <= 16


def test_prompt_lists_token_ids_n_and_echo(client, offline, model_name):
    refs = offline.generate(PROMPTS[:2], greedy(8, ignore_eos=True))
    resp = client.completions.create(model=model_name, prompt=PROMPTS[:2], n=2, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in sorted(resp.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.text == refs[c.index // 2].outputs[0].text
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert resp.usage.completion_tokens == 4 * 8

    ids = [r.prompt_token_ids for r in refs]
    one = client.completions.create(model=model_name, prompt=ids[0], max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == refs[0].outputs[0].text
    both = client.completions.create(model=model_name, prompt=ids, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in refs]

    echoed = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPTS[0] + refs[0].outputs[0].text
    streamed = client.completions.create(model=model_name, prompt=PROMPTS[:2], max_tokens=8, temperature=0,
                                         echo=True, stream=True, extra_body={"ignore_eos": True})
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [p + r.outputs[0].text for p, r in zip(PROMPTS[:2], refs, strict=True)]


def test_stop_strings_and_seeded_sampling(client, offline, model_name):
    full = offline.generate(PROMPTS[2], greedy(40, ignore_eos=True))[0].outputs[0].text
    stop = full[10:13]
    expected = full[: full.index(stop)]
    resp = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                     stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                       stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected

    kw = dict(model=model_name, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, top_p=0.9, seed=1234,
              presence_penalty=0.5, frequency_penalty=0.2, extra_body={"top_k": 50, "repetition_penalty": 1.1})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.5,
                            frequency_penalty=0.2, top_k=50, repetition_penalty=1.1)
    assert a == b == offline.generate(PROMPTS[3], params)[0].outputs[0].text


def test_logprobs(client, offline, model_name):
    ref = offline.generate(PROMPTS[1], greedy(6, ignore_eos=True, logprobs=2))[0].outputs[0]
    resp = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for k, (token, entries) in enumerate(zip(ref.token_ids, ref.logprobs, strict=True)):
        assert lp.token_logprobs[k] == pytest.approx(entries[token].logprob, abs=1e-4)
        assert len(lp.top_logprobs[k]) <= 3
        assert max(lp.top_logprobs[k].values()) == pytest.approx(lp.token_logprobs[k], abs=1e-4)  # greedy
    assert lp.text_offset[0] == 0

    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                            max_completion_tokens=5, temperature=0, logprobs=True, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content])


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(client, offline, model_name):
    """vLLM's return_tokens_as_token_ids: 'token_id:N' for every logprob entry (completions, chat, streamed), the
    values and the text offsets those of the plain response."""
    ref = offline.generate(PROMPTS[1], greedy(6, ignore_eos=True, logprobs=2))[0].outputs[0]
    kw = dict(model=model_name, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs
    named = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}
                                      ).choices[0].logprobs
    assert named.tokens == [f"token_id:{t}" for t in ref.token_ids]
    assert named.token_logprobs == plain.token_logprobs and named.text_offset == plain.text_offset
    for k, entries in enumerate(ref.logprobs):
        assert set(named.top_logprobs[k]) == {f"token_id:{t}" for t in entries}
    messages = [{"role": "user", "content": "hi"}]
    ckw = dict(model=model_name, messages=messages, max_completion_tokens=5, temperature=0, logprobs=True,
               top_logprobs=2, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                           "return_token_ids": True})
    chat = client.chat.completions.create(**ckw).choices[0]
    content = chat.logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.token_ids]
    assert all(c.bytes == list(c.token.encode()) and all(t.token.startswith("token_id:") for t in c.top_logprobs)
               for c in content)
    streamed = [t.token for c in client.chat.completions.create(**ckw, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [c.token for c in content]


def test_echo_with_logprobs_scores_the_prompt(client, offline, model_name):
    """The legacy-completions pattern of evaluation harnesses: echo the prompt with its logprobs."""
    prompt_ids = offline.get_tokenizer().encode(PROMPTS[0])
    ref = offline.generate(PROMPTS[0], greedy(4, ignore_eos=True, logprobs=1, prompt_logprobs=1))[0]
    for stream in (False, True):
        resp = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                         logprobs=1, stream=stream, extra_body={"ignore_eos": True})
        chunks = list(resp) if stream else [resp]
        text = "".join(c.choices[0].text for c in chunks)
        lp_tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
        offsets = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset]
        assert text == PROMPTS[0] + ref.outputs[0].text
        assert len(lp_tokens) == len(prompt_ids) + 4
        assert lp_tokens[0] is None  # nothing predicts the first prompt token
        expected = [ref.prompt_logprobs[p][prompt_ids[p]].logprob for p in range(1, len(prompt_ids))]
        expected += [e[t].logprob for t, e in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs, strict=True)]
        assert lp_tokens[1:] == pytest.approx(expected, abs=1e-4)
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert offsets[len(prompt_ids)] == len(PROMPTS[0])  # the completion starts after the echoed prompt


# ---------------------------------------------------------------------------------- chat
def test_chat_stream_and_plain_equal_offline(client, offline, model_name, server):
    messages = [{"role": "system", "content": "You wrap text."}, {"role": "user", "content": "Wrap this line."}]
    ref = offline.chat(messages, greedy(20, ignore_eos=True))[0]
    resp = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=20,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ref.prompt_token_ids), 20)
    assert resp.usage.total_tokens == len(ref.prompt_token_ids) + 20

    chunks = list(client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)

    # Content given as text parts is the same conversation; n=2 greedy gives two equal choices.
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    two = client.chat.completions.create(model=model_name, messages=parts, max_tokens=20, temperature=0, n=2,
                                         extra_body={"ignore_eos": True})
    assert [c.message.content for c in two.choices] == [ref.outputs[0].text] * 2
    assert wait_until(lambda: pages_free(server))


def test_json_schema_and_forced_tool_call_on_a_tiny_checkpoint(client, model_name):
    """A random model writes nothing sensible: the grammar alone makes its replies valid (a tokenizer of 376
    tokens under a 384-row LM head: the rows past the tokenizer are never allowed)."""
    import jsonschema

    schema = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 6}, "n": {"enum": [1, 2, 3]},
                                               "ok": {"type": "boolean"}},
              "required": ["w", "n", "ok"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "x"}], max_tokens=100, temperature=1.0, seed=1, n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    call = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "x"}], max_tokens=100, temperature=0, tools=tools,
        tool_choice={"type": "function", "function": {"name": "f"}}).choices[0].message.tool_calls[0]
    assert call.function.name == "f"
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_chat_default_max_tokens_is_the_context(client, offline, model_name):
    messages = [{"role": "user", "content": "Go on forever."}]
    ref = offline.chat(messages, greedy(None, ignore_eos=True))[0]
    resp = client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.total_tokens == MAX_MODEL_LEN
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content == ref.outputs[0].text


# ---------------------------------------------------------------------------------- concurrency
def test_64_concurrent_streams(server, offline, model_name):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    max_tokens = [8 + i % 17 for i in range(64)]
    refs = offline.generate(prompts, [greedy(m, ignore_eos=True) for m in max_tokens])

    async def one(client, i):
        stream = await client.completions.create(model=model_name, prompt=prompts[i], max_tokens=max_tokens[i],
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return text, usage.completion_tokens, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    for (text, n_tokens, finish), ref, m in zip(results, refs, max_tokens, strict=True):
        assert text == ref.outputs[0].text
        assert n_tokens == m and finish == "length"
    assert wait_until(lambda: pages_free(server), timeout=5)
    assert_pages_returned(server.core)


def test_stream_disconnect_aborts_and_frees_pages(server, http):
    core = server.core
    before = core.stats.num_generation_tokens
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True, "n": 3}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert got and core.kv.num_free_pages < core.kv.num_pages  # running, holding pages
    # The client is gone: the request is aborted long before 3 x 200 tokens.
    assert wait_until(lambda: pages_free(server), timeout=10)
    assert core.stats.num_generation_tokens - before < 3 * 200
    assert_pages_returned(core)


def test_plain_request_disconnect_aborts(server):
    core = server.core
    before = core.stats.num_generation_tokens
    body = {"prompt": PROMPTS[1], "max_tokens": 220, "temperature": 0, "ignore_eos": True, "n": 16}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=0.3) as c:
        c.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert wait_until(lambda: pages_free(server), timeout=10)
    assert core.stats.num_generation_tokens - before < 16 * 220


# ---------------------------------------------------------------------------------- bad input
BAD_COMPLETIONS = [
    # (body, status, param, code)
    ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", None),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", None),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ({"prompt": {"text": "x"}}, 400, "prompt", None),
    ({"prompt": [1, "a"]}, 400, "prompt", None),
    ({"prompt": []}, 400, "prompt", None),
    ({"max_tokens": 4}, 400, "prompt", None),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": list(range(1, 300))}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens", None),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "x", "n": 0}, 400, "n", None),
    ({"prompt": "x", "n": 1000}, 400, "n", None),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", None),
    ({"prompt": "x", "stop": 5}, 400, "stop", None),
    ({"prompt": "x", "stop": [""]}, 400, "stop", None),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None),
    ({"prompt": "x", "seed": 2**70}, 400, "seed", None),
    ({"prompt": [5, 999999]}, 400, "prompt", None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
]
BAD_CHATS = [
    ({"messages": []}, 400, "messages", None),
    ({"messages": "hi"}, 400, "messages", None),
    ({}, 400, "messages", None),
    ({"messages": [{"content": "hi"}]}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages", None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens", None),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs", None),
    ({"messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature", None),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("body,status,param,code", BAD_COMPLETIONS)
def test_bad_completion_requests(http, body, status, param, code):
    assert_error(http.post("/v1/completions", json=body), status, param, code)


@pytest.mark.parametrize("body,status,param,code", BAD_CHATS)
def test_bad_chat_requests(http, body, status, param, code):
    assert_error(http.post("/v1/chat/completions", json=body), status, param, code)


def test_context_errors_name_the_limit(http):
    from atlas.errors import PromptTooLongError
    from atlas.sampling_params import resolve_max_tokens

    err = assert_error(http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1000}), 400,
                       "max_tokens")
    with pytest.raises(PromptTooLongError) as info:  # the rule `atlas generate` applies to --max-tokens too
        resolve_max_tokens(1000, 16, 3, MAX_MODEL_LEN, "max_tokens")
    assert err["message"] == str(info.value) and str(MAX_MODEL_LEN) in err["message"]
    err = assert_error(http.post("/v1/completions", json={"prompt": [5] * 399}), 400, "prompt")
    assert str(MAX_MODEL_LEN) in err["message"] and "399" in err["message"]


def test_malformed_bodies_and_routes(http, server):
    for raw in (b"{not json", b"[1, 2]", b'{"prompt": "x", "temperature": NaN}', b"\xff\xfe", b""):
        assert_error(http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}), 400)
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)
    # Unknown fields that OpenAI clients send are ignored.
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "metadata": {"a": 1}, "store": False,
                                            "user": "u1", "frequency_penalty": None})
    assert ok.status_code == 200, ok.text
    # So are explicit nulls for OpenAI's optional fields.
    nulls = dict.fromkeys(["n", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "user",
                           "max_tokens", "presence_penalty", "frequency_penalty", "logit_bias", "best_of"])
    ok = http.post("/v1/completions", json={"prompt": "x", **nulls, "echo": None, "logprobs": None, "suffix": None})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1, ok.text
    ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **nulls,
                                                 "max_completion_tokens": None, "logprobs": None,
                                                 "top_logprobs": None})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1, ok.text


def test_api_key(server, model_name):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("POST", "/tokenize")):
            resp = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
            assert_error(resp, 401, code="invalid_api_key")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_name, prompt="x", max_tokens=2)
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_openai_client_raises_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])


def test_bad_requests_do_not_disturb_others(server, offline, model_name, http):
    """Good streams run while a burst of bad requests is answered."""
    ref = offline.generate(PROMPTS[4], greedy(40, ignore_eos=True))[0].outputs[0].text

    async def good(client):
        stream = await client.completions.create(model=model_name, prompt=PROMPTS[4], max_tokens=40, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def bad(raw):
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            return (await c.post("/v1/completions", json=raw)).status_code

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as client:
            bodies = [b for b, *_ in BAD_COMPLETIONS] * 2
            return await asyncio.gather(*(good(client) for _ in range(4)), *(bad(b) for b in bodies))

    results = asyncio.run(main())
    assert results[:4] == [ref] * 4
    assert all(400 <= status < 500 for status in results[4:])
    assert wait_until(lambda: pages_free(server))


def test_engine_step_failure_fails_running_requests_and_recovers(server, http, monkeypatch):
    runner = server.core.runner
    real_launch = runner.launch
    armed = {"left": 1}

    def flaky_launch(batch):
        if armed["left"]:
            armed["left"] -= 1
            raise RuntimeError("injected device fault")
        return real_launch(batch)

    monkeypatch.setattr(runner, "launch", flaky_launch)
    err = assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}), 500, code="engine_error")
    assert err["type"] == "server_error" and "injected device fault" in err["message"]
    assert wait_until(lambda: pages_free(server))
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200

    armed["left"] = 1  # now in the middle of a stream: an error event, then [DONE]
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"
    assert wait_until(lambda: pages_free(server))


# ---------------------------------------------------------------------------------- small routes
def test_models_health_tokenize(client, http, model_name, server):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert http.get("/health").json() == {"status": "ok"}

    tokenizer = server.core.tokenizer
    text = "def wrap(text, width=70):\n    return [text]"
    tok = http.post("/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert_error(http.post("/detokenize", json={"tokens": [10**7]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={}), 400)


def test_metrics(http, client, model_name):
    client.completions.create(model=model_name, prompt=PROMPTS[5], max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    client.completions.create(model=model_name, prompt=PROMPTS[5], max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})  # a prefix-cache hit
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for fam in text_string_to_metric_families(resp.text) for s in fam.samples
               if "le" not in s.labels and "finished_reason" not in s.labels}
    for name in ("atlas_num_requests_running", "atlas_num_requests_waiting", "atlas_kv_cache_usage_ratio",
                 "atlas_prefix_cache_hit_rate", "atlas_spec_decode_num_draft_tokens_total",
                 "atlas_spec_decode_num_accepted_tokens_total", "atlas_spec_decode_num_verify_steps_total"):
        assert name in samples, name
    assert samples["atlas_prompt_tokens_total"] > 0
    assert samples["atlas_generation_tokens_total"] >= 10
    assert samples["atlas_time_to_first_token_seconds_count"] >= 2
    assert samples["atlas_time_per_output_token_seconds_count"] >= 2
    assert samples["atlas_e2e_request_latency_seconds_count"] >= 2
    assert samples["atlas_prefix_cache_hits_total"] > 0 and 0 < samples["atlas_prefix_cache_hit_rate"] < 1
    assert samples["atlas_spec_decode_num_draft_tokens_total"] == 0  # no speculative decoding yet
    assert samples["atlas_fair_row_skips_total"] == 0  # (one request at a time: nobody is over a share)
    assert samples["atlas_kv_cache_pages_total"] > 0
    [info] = [s for fam in text_string_to_metric_families(resp.text) for s in fam.samples
              if s.name == "atlas_cache_config_info"]
    assert info.value == 1 and info.labels["cache_dtype"] == "float32"  # (the model dtype on the CPU)
    assert int(info.labels["num_pages"]) == samples["atlas_kv_cache_pages_total"] and info.labels["block_size"]


# ---------------------------------------------------------------------------------- the command
def test_atlas_serve_command_logs_and_stops_on_sigterm(qwen3_dir):
    cmd = [sys.executable, "-m", "atlas.cli", "serve", "--model", str(qwen3_dir), "--port", "0",
           "--kv-cache-memory", "4MiB", "--max-model-len", "128", "--served-model-name", "tiny", "--no-access-log"]
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
        log = "".join(lines)
        for needed in ("(Qwen3ForCausalLM) on cpu in float32", "max num seqs 256", "served as tiny",
                       "pages of 16 (4.0 MiB, 8.0 KiB per page) on cpu, --kv-cache-memory 4.0 MiB"):
            assert needed in log, log
        assert log.count("KV cache:") == 1, log  # once, from the engine
        assert wait_until(lambda: _healthy(url), timeout=30)
        resp = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["model"] == "tiny"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "server stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_cli_works_without_server_extras():
    """`atlas --help` and the engine import without fastapi/uvicorn/pydantic; `atlas serve` says what to
    install."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('fastapi', 'uvicorn', 'pydantic', 'prometheus_client', 'starlette'):\n"
        "            raise ImportError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import atlas, atlas.engine.async_engine\n"
        "from atlas.cli import build_parser, main\n"
        "build_parser().parse_args(['serve', '--port', '1'])\n"
        "sys.exit(main(['serve', '--port', '1']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "install atlas[server]" in proc.stderr
    assert not any(m in proc.stderr for m in ("Traceback",))


def test_speculative_counters_in_metrics(qwen3_dir, offline):
    """With --speculative ngram the server's greedy text is unchanged and /metrics counts drafts."""
    # (every step drafts: the counters' path, not the policy's choices, is under test here)
    srv = start_server(str(qwen3_dir), speculative="ngram", speculative_policy="always", **ENGINE)
    try:
        prompt = [5, 6, 7, 8] * 10
        ref = offline.generate({"prompt_token_ids": prompt}, greedy(60, ignore_eos=True))[0].outputs[0].text
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30, json={
                "prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ref
        samples = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                   for s in fam.samples}
        assert samples["atlas_spec_decode_num_draft_tokens_total"] > 0
        assert samples["atlas_spec_decode_num_verify_steps_total"] > 0
        assert 0 <= samples["atlas_spec_decode_num_accepted_tokens_total"] <= samples[
            "atlas_spec_decode_num_draft_tokens_total"]
        assert samples["atlas_spec_decode_mean_acceptance_length"] >= 1
        assert wait_until(lambda: pages_free(srv))
    finally:
        srv.stop()


def test_bench_serve_against_a_running_server(server, tmp_path, capsys):
    from atlas.cli import build_parser
    from atlas.errors import ConfigError

    out = tmp_path / "load.json"
    args = build_parser().parse_args(["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--num-requests",
                                      "12", "--concurrency", "4", "--max-tokens", "5", "--output-json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["server"]["requests"] == 12 and report["server"]["errors"] == 0
    assert report["server"]["output_tokens"] == 12 * 5
    assert report["server"]["ttft_s"]["p50"] > 0 and report["server"]["e2e_s"]["p99"] >= report["server"]["e2e_s"]["p50"]
    assert "requests/s" in out.with_suffix(".txt").read_text() and "requests/s" in capsys.readouterr().out
    args = build_parser().parse_args(["bench", "serve", "--url", "http://example.com:8000"])
    with pytest.raises(ConfigError, match="loopback"):
        args.func(args)


def test_bench_serve_random_prompts_of_an_exact_length(server, qwen3_dir, tmp_path):
    """--input-len: every request's prompt is that many token ids of the served model's tokenizer."""
    from atlas.cli import build_parser
    from atlas.errors import ConfigError

    out = tmp_path / "load.json"
    argv = ["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--num-requests", "6", "--concurrency", "3",
            "--max-tokens", "2", "--input-len", "17", "--tokenizer", str(qwen3_dir), "--output-json", str(out)]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["server"]["errors"] == 0 and report["server"]["prompt_tokens"] == 6 * 17
    assert report["meta"]["workload"]["prompts"] == "17 random token ids"
    for extra, named in ((["--endpoint", "chat"], "chat/completions"), (["--prompts", str(out)], "not both")):
        args = build_parser().parse_args(argv + extra)
        with pytest.raises(ConfigError, match=named):
            args.func(args)


def test_api_key_scope_is_described_alike_in_help_and_readme():
    from pathlib import Path

    from atlas.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    help_text = next(a.help for a in serve._actions if "--api-key" in a.option_strings)
    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text().replace("`", "")
    for phrase in ("on /v1/*, /tokenize, /detokenize and /tokenizer_info", "/health is always open",
                   "/metrics, /docs and /openapi.json are open unless --no-public-metrics-and-docs"):
        assert phrase in help_text and phrase in readme, phrase


def test_large_work_has_its_own_thread_and_ordinary_requests_do_not_queue_behind_it(server):
    """A client's own chat template, or a chat with many or long messages, renders in the heavy pool's one
    thread; ordinary preprocessing goes on in the other pool while that thread is busy."""
    import threading

    from atlas.server import protocol as P
    from atlas.server.chat_prompts import heavy_chat

    state = server.state
    msg = [{"role": "user", "content": "hi"}]
    assert not heavy_chat(P.ChatCompletionRequest(model="m", messages=msg))
    assert heavy_chat(P.ChatCompletionRequest(model="m", messages=msg, chat_template="{{ 1 }}"))
    assert heavy_chat(P.ChatCompletionRequest(model="m", messages=msg * 600))
    assert heavy_chat(P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x" * 300_000}]))

    release = threading.Event()

    async def scenario():
        busy = asyncio.ensure_future(state.run_blocking(release.wait, 30, heavy=True))
        await asyncio.sleep(0.05)
        # The heavy thread is busy: ordinary work still runs at once, in the other pool.
        name = await asyncio.wait_for(state.run_blocking(lambda: threading.current_thread().name), 10)
        assert name.startswith("atlas-preprocess") and not busy.done()
        release.set()
        assert await busy
        return await state.run_blocking(lambda: threading.current_thread().name, heavy=True)

    assert asyncio.run(scenario()).startswith("atlas-heavy")
