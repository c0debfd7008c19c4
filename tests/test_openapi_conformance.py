"""The OpenAPI document tells the truth: schemathesis generates requests from `atlas serve`'s own /openapi.json and
checks the real server's answers against it (issue 43).

For each main POST route, a bounded, derandomized run of schema-valid requests (positive) and of schema-violating
ones (negative) checks that:
- no request gets a 5xx;
- a schema-valid request is answered 2xx, except for the few rules that no JSON schema can state (ALLOWED_REFUSALS
  below: each names the field and the rule);
- a schema-violating request is refused with a 4xx;
- every answer (status, content type, JSON body) matches what the document says of that route.

Generated requests do not stream (stream: true is sent as false); test_streamed_chunks_match_their_schemas streams a
completion and a chat completion and checks every server-sent event against the documented chunk schemas.

A positive request names the served model (a request naming another model gets the documented 404, which the other
server tests cover). /v1/embeddings is documented but not run here: this server runs a generative model, where it
answers 400 (tests/test_embeddings.py covers an embedding server).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from serving import Serve

from atlas.server.protocol import UNSUPPORTED_FIELD_SCHEMAS

NAME = "tiny"
MAX_MODEL_LEN = 64  # (prompt + output: each generated request is a few milliseconds of engine work)
MAX_SEQUENCES = 4  # (--max-sequences-per-request: n and prompts x n)
DEFAULT_MAX_TOKENS = 4  # (generation_config.json's max_new_tokens: what a request that gives no max_tokens gets)
# Cases per route and mode: a few hundred in all.
EXAMPLES = {"/v1/completions": 30, "/v1/chat/completions": 30, "/v1/responses": 25, "/tokenize": 20,
            "/detokenize": 15}

# The 400s a schema-valid request may get: rules that depend on what no JSON schema sees (how text tokenizes, what a
# grammar compiles to, what the server has stored) or that compare two fields' values. By the error's code, or by
# (why, the error's param (None: any), a pattern its message matches).
ALLOWED_CODES = {"context_length_exceeded": "the prompt (in tokens) and max_tokens must fit in --max-model-len"}
ALLOWED_REFUSALS: list[tuple[str, str | None, str]] = [
    ("min_tokens <= max_tokens (or the default max_tokens)", "min_tokens", r"must be in \[0, max_tokens\]"),
    ("best_of == n", "best_of", r"best_of == n"),
    ("prompts x n <= --max-sequences-per-request", None, r"sequences \(.*\); this server allows at most"),
    ("logit_bias keys are token ids of the vocabulary", "logit_bias", r"outside the vocabulary|given twice"),
    ("a constraint (JSON schema, regex, grammar, tool parameters) must compile",
     None, r"^(structured_outputs|guided_\w+|response_format|tools\[\d+\]\.function\.parameters|tool_choice|tools)"
           r"(\.\w+)?: (?!give exactly one|must be|there are no tools|unknown field|the output is already constrained"
           r"|tool_choice .* already constrains)"),
    ("tool names are distinct, and a named tool_choice names one of them", None,
     r"two tools have the same name|there is no tool named"),
    ("continue_final_message continues a last message of the assistant's", "continue_final_message",
     r"must be the assistant's"),
    ("previous_response_id names a response this server has stored", "previous_response_id", r"no stored response"),
    # The document states these two, but they are left out of what the generator reads (UNGENERATED_RULES).
    ("top_logprobs only with logprobs true", "top_logprobs", r"needs logprobs: true"),
    ("continue_final_message true only with add_generation_prompt false", "continue_final_message",
     r"Cannot set both"),
]

# Rules between fields that the document states but the generator is not given: schemathesis models a body's rules as
# alternatives, and chat completions' four (stream, output constraint, top_logprobs, continue_final_message) make more
# than it takes at once. Their refusals are in ALLOWED_REFUSALS; tests/test_server*.py check the server keeps them.
UNGENERATED_RULES = {"ChatCompletionRequest": ("top_logprobs only with logprobs true",
                                               "continue_final_message true only with add_generation_prompt false")}


def generated_from(document: dict[str, Any]) -> dict[str, Any]:
    """The document as the generator reads it: UNGENERATED_RULES left out, and the fields Atlas does not implement
    (documented at the values that ask for nothing; tests/test_server_hardening.py sends them), which would take the
    completions body past what the generator models along with its rules."""
    document = copy.deepcopy(document)
    for body in document["components"]["schemas"].values():
        for name, harmless in UNSUPPORTED_FIELD_SCHEMAS.items():
            if body.get("properties", {}).get(name) == harmless:
                del body["properties"][name]
    for name, rules in UNGENERATED_RULES.items():
        body = document["components"]["schemas"][name]
        kept = [rule for rule in body["allOf"] if rule.get("description") not in rules]
        assert len(kept) == len(body["allOf"]) - len(rules), "a rule of UNGENERATED_RULES is not in the document"
        body["allOf"] = kept
    return document


def allowed_refusal(error: dict[str, Any]) -> str | None:
    if error.get("code") in ALLOWED_CODES:
        return ALLOWED_CODES[error["code"]]
    for why, param, pattern in ALLOWED_REFUSALS:
        if (param is None or error.get("param") == param) and re.search(pattern, error.get("message", "")):
            return why
    return None


@schemathesis.check
def schema_valid_request_accepted(ctx, response, case) -> bool | None:
    """A schema-valid request gets a 2xx, or a 400 for one of ALLOWED_REFUSALS."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code < 400:
        return None
    error = {}
    if response.status_code == 400:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            error = json.loads(response.content)["error"]
        if allowed_refusal(error):
            return None
    raise AssertionError(f"a schema-valid request was refused ({response.status_code}): {error or response.text}")


CHECKS = [not_a_server_error, schema_valid_request_accepted, negative_data_rejection, response_schema_conformance,
          status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def served(qwen3_dir, tmp_path_factory):
    """`atlas serve` (one front end, the engine in its own process) on the tiny Qwen3, with a short context, a default
    max_tokens of a few tokens, and tool_choice "auto" (the hermes parser)."""
    config = tmp_path_factory.mktemp("generation-config")
    (config / "generation_config.json").write_text(json.dumps({"max_new_tokens": DEFAULT_MAX_TOKENS}))
    server = Serve(str(qwen3_dir), "--api-server-count", "1", "--served-model-name", NAME, "--max-model-len",
                   str(MAX_MODEL_LEN), "--max-sequences-per-request", str(MAX_SEQUENCES), "--generation-config",
                   str(config), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield server
    server.close()


@pytest.fixture(scope="module")
def document(served) -> dict[str, Any]:
    return httpx.get(served.url + "/openapi.json", timeout=30).json()


def _prepared(case, mode: GenerationMode) -> None:
    """A positive case names the served model, and does not stream (stream_options goes with the stream)."""
    body = case.body
    if not mode.is_positive or not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = NAME
    if body.get("stream") is True:
        body["stream"] = False
        body.pop("stream_options", None)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("path", list(EXAMPLES))
def test_route_answers_as_documented(served, document, path, mode):
    operation = schemathesis.openapi.from_dict(generated_from(document))[path]["POST"]

    @settings(max_examples=EXAMPLES[path], derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        _prepared(case, mode)
        response = case.call(base_url=served.url, timeout=60)
        case.validate_response(response, checks=CHECKS)

    run()


def _request_validator(document: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**document["components"]["schemas"][name],
                                            "components": document["components"]})


UNGENERATED_CASES = [  # (a body the rule refuses, the same body kept to the rule)
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2, "logprobs": True}),
    ({"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True},
     {"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True,
      "add_generation_prompt": False}),
]


@pytest.mark.parametrize("refused,kept", UNGENERATED_CASES, ids=["top_logprobs", "continue_final_message"])
def test_rules_left_out_of_generation_hold(served, document, refused, kept):
    """UNGENERATED_RULES are in the document: a body that breaks one is invalid by it and refused, the same body kept
    to it is valid and answered."""
    validator = _request_validator(document, "ChatCompletionRequest")
    assert not validator.is_valid(refused)
    validator.validate(kept)
    for body, status in ((refused, 400), (kept, 200)):
        response = httpx.post(served.url + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=60)
        assert response.status_code == status, response.text


@pytest.mark.parametrize("route,name", [("/tokenize", "TokenizeRequest"),
                                        ("/v1/chat/completions", "ChatCompletionRequest")])
def test_template_kwargs_a_request_field_sets_are_refused(served, document, route, name):
    """chat_template_kwargs may not set continue_final_message (the request field's; it was a 500, the renderer
    getting the argument twice), nor the variables the server sets: the document says so and the server refuses."""
    validator = _request_validator(document, name)
    for key in ("continue_final_message", "messages", "chat_template"):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {key: False}}
        assert not validator.is_valid(body), key
        response = httpx.post(served.url + route, json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs", \
            response.text


def test_tool_parameters_the_grammar_engine_cannot_read_are_refused(served):
    """A tool's parameter schema with an integer past 64 bits (valid JSON, which llguidance cannot take in) is the
    request's 400, not a 500 (found by this file's generator)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x-note": [2**125]}}}]}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools[0].function.parameters", \
        response.text


def test_responses_tool_strict_is_a_boolean(served, document):
    """A Responses tool's strict is a boolean by the document, and the server refuses another value (it was dropped
    unread: found by this file's generator)."""
    body = {"input": "hi", "max_output_tokens": 2, "tool_choice": "none",
            "tools": [{"type": "function", "name": "f", "strict": 1}]}
    assert not _request_validator(document, "ResponsesRequest").is_valid(body)
    response = httpx.post(served.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools[0]", response.text


# ---------------------------------------------------------------------------------- streams
def _events(response: httpx.Response) -> list[dict[str, Any]]:
    events, done = [], False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "an event after [DONE]"
        if line == "data: [DONE]":
            done = True
            continue
        events.append(json.loads(line[len("data: "):]))
    assert done, "the stream did not end with [DONE]"
    return events


def _event_validator(document: dict[str, Any], route: str) -> Callable[[Any], None]:
    """The document's schema of one event of `route`'s stream (its text/event-stream content's x-event-schema)."""
    content = document["paths"][route]["post"]["responses"]["200"]["content"]["text/event-stream"]
    schema = {**content["x-event-schema"], "components": document["components"]}
    return jsonschema.Draft202012Validator(schema).validate


CALL_TOOL = {"tools": [{"type": "function", "function": {"name": "wrap", "parameters": {
    "type": "object", "properties": {"width": {"type": "integer"}}, "required": ["width"]}}}],
    "tool_choice": "required", "max_tokens": 24}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_match_their_schemas(served, document, route):
    """Every event of a stream (the role chunk, text, logprobs, token ids, tool calls, finish, usage) is valid by the
    document's schema of that route's events."""
    validate = _event_validator(document, route)
    chat = route == "/v1/chat/completions"
    prompt = {"messages": [{"role": "user", "content": "def wrap(text"}]} if chat else {"prompt": "def wrap(text"}
    logprobs = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    for extra in ({}, {**logprobs, "return_token_ids": True, "n": 2}, *([CALL_TOOL] if chat else [])):
        body = {"model": NAME, **prompt, "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        with httpx.stream("POST", served.url + route, json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _events(response)
        for event in events:
            validate(event)
        assert "error" not in events[-2], events[-2]
        assert events[-1]["usage"] is not None and events[-1]["choices"] == []
        if extra is CALL_TOOL:
            assert any(choice["delta"].get("tool_calls") for event in events for choice in event["choices"]), events
