"""Pydantic models of the OpenAI completion and chat-completion APIs (the subset Atlas serves).

Requests are validated strictly (a string is not a number, 2.5 is not an integer, NaN and infinities are
refused; 2.0 is the integer 2, as JSON Schema has it) but unknown fields are ignored, since OpenAI clients send
some that Atlas has no use for. Fields beyond OpenAI's (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, ...) have vLLM's names. /openapi.json states the bounds and the rules between fields that the
server enforces (docs.py; tests/test_openapi_conformance.py holds the two to each other).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from atlas.engine.chat_content import check_content, content_for_template
from atlas.sampling_params import (
    DEFAULT_MAX_LOGPROBS,
    LOGIT_BIAS_RANGE,
    MAX_BAD_WORDS,
    MAX_BEAM_WIDTH,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Message roles a chat may use ("tool": a tool's result, answering an assistant's tool call). The legacy
# "function" role (of the deprecated functions API) is refused.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
LEGACY_ROLES = ("function",)


# truncate_prompt_tokens: -1 (the context's length) or a count of tokens to keep
TRUNCATE: dict[str, Any] = {"anyOf": [{"type": "null"}, {"const": -1}, {"type": "integer", "minimum": 1}]}


# ---------------------------------------------------------------------------------- fields Atlas cannot honour
def _unset(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _falsy(value: Any) -> bool:
    return value is None or value is False


# Request fields (OpenAI's, and vLLM's extensions) that Atlas does not implement yet, each with a test of
# the values that ask for nothing (e.g. tools: null or []). A request that gives any other value is
# answered 400 naming the field, never with an answer to a different question. Implementing a field
# means deleting its entry here.
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_unset, "the deprecated functions API is not supported; use tools"),
    "function_call": (lambda v: v in (None, "none", "auto"), "the deprecated functions API is not supported; "
                                                              "use tool_choice"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
    "prediction": (_unset, "predicted outputs are not supported"),
    "audio": (_unset, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is supported"),
    "web_search_options": (_unset, "web search is not supported"),
    "reasoning_effort": (_unset, "reasoning_effort is a chat completions field"),
    "logits_processors": (_unset, "logits processors are not supported"),
    "continue_final_message": (_falsy, "continue_final_message belongs to chat messages (chat completions and "
                                        "/tokenize)"),
    "documents": (_unset, "documents are not supported"),
    "structural_tag": (_unset, "a top-level structural_tag is not read; give it as response_format {\"type\": "
                               "\"structural_tag\", ...} or structured_outputs.structural_tag"),
}
# What /openapi.json says each of them takes: the values that ask for nothing (in a request model that does not
# declare the field itself).
_NOTHING = {"type": ["null", "array", "object"], "maxItems": 0, "maxProperties": 0}
_OFF = {"enum": [None, False]}
UNSUPPORTED_FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
    **{name: _NOTHING for name, (harmless, _) in UNSUPPORTED_FIELDS.items() if harmless is _unset},
    **{name: _OFF for name, (harmless, _) in UNSUPPORTED_FIELDS.items() if harmless is _falsy},
    "function_call": {"enum": [None, "none", "auto"]},
    "suffix": {"enum": [None, ""]},
    "modalities": {"enum": [None, ["text"]]},
}
assert set(UNSUPPORTED_FIELD_SCHEMAS) == set(UNSUPPORTED_FIELDS)


# Fields that mean something else on chat completions than on completions (none today: chat's echo is honoured).
CHAT_UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {}


def unsupported_field(body: dict[str, Any], chat: bool = False, accepted: Any = ()) -> tuple[str, str] | None:
    """(field, why) for the first field of the request body that asks for something Atlas cannot do. A field the
    request's own model declares (`accepted`: its field names) is that model's to honour, whatever the table says
    (continue_final_message: on chat completions and /tokenize, not on completions)."""
    fields = {**UNSUPPORTED_FIELDS, **CHAT_UNSUPPORTED_FIELDS} if chat else UNSUPPORTED_FIELDS
    for name, (harmless, why) in fields.items():
        if name in body and name not in accepted and not harmless(body[name]):
            return name, why
    return None


# ---------------------------------------------------------------------------------- what /openapi.json says
# The request models validate the shape of a body; the bounds of the sampling fields are checked where the
# engine's SamplingParams are built (atlas/sampling_params.py). The document states those bounds too, from the same
# constants, so that a request valid by the document is one the server takes (tests/test_openapi_conformance.py).
# TOKEN_ID marks a token id: /openapi.json fills in the served model's vocabulary as its maximum (docs.py).
TOKEN_ID_MARK = "x-atlas-token-id"
TOKEN_ID: dict[str, Any] = {"type": "integer", "minimum": 0, TOKEN_ID_MARK: True}
TOKEN_IDS: dict[str, Any] = {"type": "array", "items": TOKEN_ID, "minItems": 1}


def documented(schema: dict[str, Any], nullable: bool = True) -> WithJsonSchema:
    """A field's schema in /openapi.json (null added where the field may be null)."""
    return WithJsonSchema(or_null(schema) if nullable else schema)


def or_null(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or null (as one schema where it has one type: alternatives cost the request generator more)."""
    if isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def number(minimum: float | None = None, maximum: float | None = None, exclusive_minimum: float | None = None,
           integer: bool = False) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer" if integer else "number"}
    for key, value in (("minimum", minimum), ("maximum", maximum), ("exclusiveMinimum", exclusive_minimum)):
        if value is not None:
            schema[key] = value
    return schema


def _prompt_schema() -> dict[str, Any]:
    return {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS,
                      {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                      {"type": "array", "items": TOKEN_IDS, "minItems": 1}]}


STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
                         {"type": "null"}]}


# Rules between fields, written as alternatives without `if` or `not` (schemathesis's generator models those only in
# small numbers).
NOT_NULL = {"type": ["string", "number", "boolean", "array", "object"]}
NULL = {"type": "null"}


def present(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A body that has the field, not null (or matching `schema`)."""
    return {"required": [name], "properties": {name: schema if schema is not None else NOT_NULL}}


def fields(**schemas: dict[str, Any]) -> dict[str, Any]:
    """A body whose fields, where given, match these schemas."""
    return {"properties": schemas}


def either(*alternatives: dict[str, Any], rule: str | None = None) -> dict[str, Any]:
    """Any of the alternatives; `rule`: what the rule says, as the document's description of it."""
    return {"anyOf": list(alternatives), **({"description": rule} if rule else {})}


def both(*parts: dict[str, Any]) -> dict[str, Any]:
    """One schema of parts that each constrain other fields (`required` and `properties` merged)."""
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key == "required":
                merged["required"] = [*merged.get("required", []), *value]
            elif key == "properties":
                merged["properties"] = {**merged.get("properties", {}), **value}
            else:
                assert key not in merged, key
                merged[key] = value
    return merged


# The output constraints a request may give (at most one): response_format (other than text), structured_outputs and
# the guided_* fields (atlas/server/sampling.py structured_spec).
_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")


def no_constraint(*names: str) -> dict[str, Any]:
    """Each of these fields left out, null, or (response_format) of type text."""
    plain = {"type": ["object", "null"], "properties": {"type": {"const": "text"}}}
    return fields(**{name: plain if name == "response_format" else NULL for name in names})


def one_constraint(tools: bool = False, auto_tool_choice: bool = True) -> dict[str, Any]:
    """At most one output constraint; with `tools` (chat completions), tool_choice "required" or a named function
    counts as one, and needs tools. Without `auto_tool_choice` (--enable-auto-tool-choice), tool_choice "auto" (the
    default with tools) needs no tools."""
    rule = ("at most one output constraint: response_format (not text), structured_outputs or a guided_* field"
            + ("; tool_choice \"required\" or a named function is one, and needs tools" if tools else "")
            + ("" if auto_tool_choice else "; with tools, tool_choice is given and not \"auto\" (this server runs "
                                           "without --enable-auto-tool-choice)"))
    if not tools:
        return either(*(no_constraint(*(other for other in _CONSTRAINTS if other != name)) for name in _CONSTRAINTS),
                      rule=rule)
    no_tools = {"type": ["array", "null"], "maxItems": 0}
    plain = ([fields(tool_choice={"enum": ["none", "auto", None]})] if auto_tool_choice else
             [fields(tool_choice={"const": "none"}), fields(tool_choice={"enum": ["auto", None]}, tools=no_tools)])
    return either(*(both(no_constraint(*(other for other in _CONSTRAINTS if other != name)), choice)
                    for name in _CONSTRAINTS for choice in plain),
                  both(no_constraint(*_CONSTRAINTS), present("tools", {"type": "array", "minItems": 1})), rule=rule)


# A constraint's own fields (StructuredOutputsParams.validate): exactly one kind, each of its type. What they hold must
# also compile (a JSON schema the grammar engine supports, a regex, an EBNF grammar), which no schema can say.
_TEXT = {"type": "string", "minLength": 1}
_CHOICE = {"type": "array", "items": _TEXT, "minItems": 1}
JSON_SCHEMA_GIVEN = {"type": ["object", "boolean", "string", "null"]}
_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # (exactly one)
STRUCTURED_OUTPUTS_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {"json": JSON_SCHEMA_GIVEN, "regex": or_null(_TEXT),
                   "choice": or_null(_CHOICE), "grammar": or_null(_TEXT),
                   "json_object": {"type": ["boolean", "null"]},
                   "structural_tag": {"type": ["object", "string", "null"]},
                   "disable_any_whitespace": {"type": ["boolean", "null"]}},
    "anyOf": [both(present(kind, {"const": True} if kind == "json_object" else None),
                   fields(**{other: {"enum": [None, False]} if other == "json_object" else NULL
                             for other in _CONSTRAINT_KINDS if other != kind}))
              for kind in _CONSTRAINT_KINDS],
}


# use_beam_search (server/beam_search.py): the fields a beam search would not honour, each with the values that ask
# for nothing (a request that sets one otherwise is refused naming it), and its own bounds.
BEAM_SEARCH_NOTHING: dict[str, tuple[Any, ...]] = {
    "stream": (None, False), "temperature": (None, 0), "top_p": (None, 1.0), "top_k": (None, 0, -1),
    "min_p": (None, 0.0), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "logit_bias": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "logprobs": (None, False), "top_logprobs": (None,), "prompt_logprobs": (None,), "echo": (None, False),
    "stop": (None, []), "min_tokens": (None, 0), "response_format": (None,), "structured_outputs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "tools": (None, [])}

SAMPLING_RULES: list[dict[str, Any]] = [
    either(both(present("stream", {"const": True}), fields(prompt_logprobs=NULL)),
           fields(stream={"enum": [False, None]}, stream_options=NULL),
           rule="stream_options only with stream true; prompt_logprobs only without"),
]
# (fields of BEAM_SEARCH_NOTHING that only chat completions declare: a completion request ignores them)
CHAT_ONLY_FIELDS = ("top_logprobs", "tools")


def beam_search_rule(declared: Callable[[str], bool] = lambda name: True) -> dict[str, Any]:
    """use_beam_search true only where its refused fields ask for nothing (over the fields the request declares)."""
    nothing = {name: {"enum": list(values)} for name, values in BEAM_SEARCH_NOTHING.items() if declared(name)}
    return either(fields(use_beam_search={"enum": [None, False]}),
                  both(present("use_beam_search", {"const": True}),
                       fields(**nothing, n={"type": ["integer", "null"], "maximum": MAX_BEAM_WIDTH})),
                  rule=f"use_beam_search true only with n at most {MAX_BEAM_WIDTH} and without streaming, sampling "
                       "settings, penalties, logit changes, constraints, tools, logprobs, echo, stop strings or "
                       "min_tokens")


def whole_number(value: Any) -> Any:
    """A float with no fractional part as the integer it is (2.0 is 2: JSON Schema's integers are numbers, however
    written); anything else unchanged, for the field's own validation."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# An integer field of a request: an integer, or a float with no fractional part (not a string, a bool or 2.5).
Int = Annotated[int, BeforeValidator(whole_number)]


def _token_ids(value: Any) -> Any:
    """A list's whole-number floats as integers (token ids); other values unchanged."""
    return [whole_number(t) for t in value] if isinstance(value, list) else value


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TruncatingRequest(RequestModel):
    """A request whose prompts may be cut: vLLM's truncate_prompt_tokens keeps each prompt's last k tokens (-1: as
    many as the context holds)."""

    truncate_prompt_tokens: Annotated[Int | None, WithJsonSchema(TRUNCATE)] = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError("must be -1 (as many tokens as the context holds) or a positive number of tokens")
        return v


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------- requests
class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (the prompt's tokens, the tokens streamed)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        either(fields(type={"enum": ["text", "json_object"]}),
               both(fields(type={"const": "json_schema"}), present("json_schema", {
                   "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}})),
               both(fields(type={"const": "structural_tag"}), either(present("structures"), present("format"))),
               rule="json_schema needs json_schema.schema; structural_tag needs structures or format"),
    ]})

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tags (type structural_tag): `structures` and `triggers`, or xgrammar's `format`; checked
    # by atlas/structured/structural_tag.py
    structures: Any = None
    triggers: Any = None
    format: Any = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("type json_schema needs json_schema.schema")
        if self.type == "structural_tag" and self.structures is None and self.format is None:
            raise ValueError("type structural_tag needs structures and triggers, or format")
        return self

    def structural_tag(self) -> dict[str, Any]:
        return {"type": "structural_tag", **{k: v for k, v in (("structures", self.structures),
                                                               ("triggers", self.triggers), ("format", self.format))
                                             if v is not None}}


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class SamplingRequest(TruncatingRequest):
    """Fields that completions and chat completions share."""

    model: str | None = None
    # null (as some clients send for "default") means 1
    n: Annotated[Int | None, documented(number(1, MAX_N, integer=True))] = 1
    temperature: Annotated[float | None, documented(number(0, MAX_TEMPERATURE))] = None
    top_p: Annotated[float | None, documented(number(maximum=1, exclusive_minimum=0))] = None
    top_k: Annotated[Int | None, documented(number(-1, integer=True))] = None
    min_p: Annotated[float | None, documented(number(0, 1))] = None
    presence_penalty: Annotated[float | None, documented(number(-2, 2))] = None
    frequency_penalty: Annotated[float | None, documented(number(-2, 2))] = None
    repetition_penalty: Annotated[float | None, documented(number(*REPETITION_PENALTY_RANGE))] = None
    stop: Annotated[Any, WithJsonSchema(STOP_SCHEMA)] = None
    seed: Annotated[Int | None, documented(number(INT64_MIN, INT64_MAX, integer=True))] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Beyond OpenAI (vLLM names).
    ignore_eos: bool = False
    min_tokens: Annotated[Int, documented(number(0, integer=True), nullable=False)] = 0
    stop_token_ids: Annotated[list[Int] | None, documented({"type": "array", "items": number(0, integer=True)})] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # best_of is accepted when it equals n (OpenAI's default); see also UNSUPPORTED_FIELDS.
    best_of: Annotated[Int | None, documented(number(1, MAX_N, integer=True))] = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: Annotated[dict[str, Any] | None, documented(STRUCTURED_OUTPUTS_SCHEMA)] = None
    guided_json: Annotated[Any, WithJsonSchema(JSON_SCHEMA_GIVEN)] = None
    guided_regex: Annotated[str | None, documented(_TEXT)] = None
    guided_choice: Annotated[list[str] | None, documented(_CHOICE)] = None
    guided_grammar: Annotated[str | None, documented(_TEXT)] = None
    # vLLM's: only requests with the same salt share cached prompt pages
    cache_salt: Annotated[str | None, documented({"type": "string", "minLength": 1, "maxLength": 1024})] = None
    # vLLM's: token ids beside the text (prompt_token_ids, and each choice's token_ids; streamed as deltas)
    return_token_ids: bool | None = None
    # vLLM's: each prompt token's logprob and the top k (not in streams), as `prompt_logprobs` in the response
    prompt_logprobs: Annotated[Int | None, documented(number(0, DEFAULT_MAX_LOGPROBS, integer=True))] = None
    priority: Int | None = None  # vLLM's: lower runs first (needs --scheduling-policy priority)
    # OpenAI's: {token id (a decimal string, as JSON keys are): bias in [-100, 100]} added to those logits
    logit_bias: Annotated[dict[str, float] | None, documented({
        "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": number(*LOGIT_BIAS_RANGE)})] = None
    # vLLM's: logprob entries name their tokens 'token_id:123'
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: n beams (the beam width) in place of n samples; finished beams ranked by summed logprob / generated
    # tokens ** length_penalty
    use_beam_search: bool | None = None
    length_penalty: Annotated[float | None, documented(number())] = 1.0
    # vLLM's: words the output never holds
    bad_words: Annotated[list[str] | None, WithJsonSchema({
        "type": ["array", "null"], "items": {"type": "string", "pattern": "\\S"}, "maxItems": MAX_BAD_WORDS})] = None
    # vLLM's: the only tokens the output may hold
    allowed_token_ids: Annotated[list[Int] | None, WithJsonSchema({
        "type": ["array", "null"], "items": TOKEN_ID, "minItems": 1})] = None

    @field_validator("stop")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("must be a string or a list of strings")

    @model_validator(mode="after")
    def _nulls_mean_defaults(self):
        if self.n is None:
            self.n = 1
        return self

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not INT64_MIN <= v <= INT64_MAX:
            raise ValueError("must fit in a signed 64-bit integer")
        return v


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _plain_token_list(value: Any) -> bool:
    """A non-empty list of plain ints (JSON integers as json.loads gives them): a prompt's usual shape, taken in one
    pass with nothing to convert."""
    return type(value) is list and bool(value) and all(type(t) is int for t in value)


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        *SAMPLING_RULES, beam_search_rule(lambda name: name not in CHAT_ONLY_FIELDS), one_constraint(),
        either(fields(max_tokens={"type": ["integer", "null"], "minimum": 1}), present("echo", {"const": True}),
               rule="max_tokens 0 only with echo true")]})

    prompt: Annotated[Any, WithJsonSchema(_prompt_schema())]
    # None: 16, as OpenAI (capped at what the context leaves); 0 only with echo (scores the prompt)
    max_tokens: Annotated[Int | None, documented(number(0, integer=True))] = None
    echo: bool | None = False
    logprobs: Annotated[Int | None, documented(number(0, DEFAULT_MAX_LOGPROBS, integer=True))] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if _plain_token_list(v):
            return v
        v = _token_ids(v)
        if isinstance(v, list) and v and all(isinstance(p, list) for p in v):
            v = [_token_ids(p) for p in v]
        if isinstance(v, str) or (_is_token_list(v) and v):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(_is_token_list(p) for p in v)):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        # (the validator made the prompt a string or a non-empty list of one kind: its first item says which)
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {"function": {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string"}, "arguments": {"type": ["string", "object"]}}}}}
_CONTENT = {"anyOf": [{"type": ["string", "null"]}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}


def _message_rules(schema: dict[str, Any]) -> None:
    schema["properties"]["function_call"] = _NOTHING  # (the deprecated functions API: only its empty values)
    schema["allOf"] = [either(fields(role={"const": "assistant"}), both(present("content"), fields(tool_calls=NULL)),
                              rule="content, but for the assistant's; tool_calls only from the assistant")]


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, json_schema_extra=_message_rules)

    role: Annotated[str, WithJsonSchema({"enum": list(CHAT_ROLES)})]
    content: Annotated[Any, WithJsonSchema(_CONTENT)] = None
    name: str | None = None

    tool_calls: Annotated[list[dict[str, Any]] | None, documented({"type": "array", "items": _TOOL_CALL})] = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v in LEGACY_ROLES:
            raise ValueError(f"{v!r} messages belong to the deprecated functions API; send 'tool' messages")
        if v not in CHAT_ROLES:
            raise ValueError(f"must be one of {', '.join(CHAT_ROLES)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _tool_fields(self):
        if not _unset((self.model_extra or {}).get("function_call")):
            raise ValueError("function_call in messages belongs to the deprecated functions API; use tool_calls")
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise ValueError("only assistant messages have tool_calls")
            for call in self.tool_calls:
                function = call.get("function")
                if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(
                        function.get("arguments", ""), (str, dict)):
                    raise ValueError("each tool call needs function.name (a string) and function.arguments "
                                     "(a JSON string)")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    @field_validator("content")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        check_content(v)
        return v

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as the string content format joins them)."""
        return content_for_template(self.content, "string")

    def for_template(self, content_format: str = "string") -> dict[str, Any]:
        """The message as a chat template expects it: content as the template reads it (engine/chat_content.py:
        a string, or with "openai" a list of text parts), tool-call arguments as objects (templates write them with
        tojson) where they are JSON."""
        message = {k: v for k, v in self.model_dump().items() if v is not None}
        message["content"] = content_for_template(self.content, content_format)
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                function = dict(call["function"])
                if isinstance(function.get("arguments"), str):
                    with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                        function["arguments"] = json.loads(function["arguments"])
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        return message


CONTINUE_FINAL_MESSAGE = either(fields(continue_final_message={"const": False}),
                                present("add_generation_prompt", {"const": False}),
                                rule="continue_final_message true only with add_generation_prompt false")


def chat_rules(auto_tool_choice: bool = True) -> list[dict[str, Any]]:
    """The rules between a chat completion request's fields (docs.py gives the server's `auto_tool_choice`)."""
    return [*SAMPLING_RULES, beam_search_rule(), one_constraint(tools=True, auto_tool_choice=auto_tool_choice),
            either(fields(top_logprobs=NULL), present("logprobs", {"const": True}),
                   rule="top_logprobs only with logprobs true"), CONTINUE_FINAL_MESSAGE]


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": chat_rules()})

    messages: list[ChatMessage] = Field(min_length=1)
    # (max_tokens is deprecated by OpenAI in favour of max_completion_tokens)
    max_tokens: Annotated[Int | None, documented(number(1, integer=True))] = None
    max_completion_tokens: Annotated[Int | None, documented(number(1, integer=True))] = None
    logprobs: bool | None = False
    top_logprobs: Annotated[Int | None, documented(number(0, DEFAULT_MAX_LOGPROBS, integer=True))] = None
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the last (assistant) message, which the reply continues; needs
    # add_generation_prompt false
    continue_final_message: bool = False
    # vLLM's: the reply starts with the last message's content when that message has the reply's role (the
    # request continues it: add_generation_prompt false, or a last assistant message)
    echo: bool | None = False
    # A template of the request's own (vLLM's field; also accepted inside chat_template_kwargs): refused
    # unless the server runs with --trust-request-chat-template.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's (vLLM's values): the chat template's `reasoning_effort` variable (gpt-oss's reads it); a 400 where the
    # template does not read it.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(RequestModel):
    # exactly one of prompt and messages; continue_final_message as on chat completions
    model_config = ConfigDict(json_schema_extra={"allOf": [
        either(both(present("prompt"), fields(messages=NULL)), both(present("messages"), fields(prompt=NULL)),
               rule="exactly one of prompt and messages"),
        CONTINUE_FINAL_MESSAGE]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # (as on chat completions)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: Annotated[list[Int], WithJsonSchema({"type": "array", "items": TOKEN_ID})]


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT LoRA adapter folder (or hub id) served under lora_name."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: Int | None = None  # (vLLM's; Atlas keys adapters by name)


class PooledInputRequest(TruncatingRequest):
    """The inputs of a pooling route (/v1/embeddings, /classify): text or token ids, one or a list."""

    model: str | None = None
    input: Annotated[Any, WithJsonSchema(_prompt_schema())]  # (as a completion's prompt)
    user: str | None = None
    add_special_tokens: bool = True

    @field_validator("input")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        if _plain_token_list(v):
            return v
        v = _token_ids(v)
        if isinstance(v, list) and v and all(isinstance(p, list) for p in v):
            v = [_token_ids(p) for p in v]
        if (isinstance(v, str) and v) or (_is_token_list(v) and v):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) and p for p in v)
                                          or all(_is_token_list(p) and p for p in v)):
            return v
        raise ValueError("must be a non-empty string, a list of non-empty strings, a list of token ids or a list "
                         "of non-empty token-id lists")

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text or token ids."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):  # (as prompts())
            return [self.input]
        return list(self.input)


class EmbeddingRequest(PooledInputRequest):
    """POST /v1/embeddings (OpenAI's, with vLLM's add_special_tokens)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(default=None, ge=1)


class ClassificationRequest(PooledInputRequest):
    """POST /classify (vLLM's): the class probabilities of each input under a sequence classifier."""


class PoolingRequest(PooledInputRequest):
    """POST /pooling (vLLM's): the raw pooled output of each input (an embedding, a classifier's logits)."""

    encoding_format: Literal["float", "base64"] = "float"


# ---------------------------------------------------------------------------------- responses
class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: its logprob} with the token itself
# and the top k.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class TokenIdsModel(ResponseModel):
    """A response part with vLLM's return_token_ids fields, which appear only when asked for."""

    @model_serializer(mode="wrap")
    def _drop_unasked_token_ids(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("prompt_token_ids", "token_ids", "prompt_logprobs"):
            if key in data and data[key] is None:
                del data[key]
        return data


class CompletionChoice(TokenIdsModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # (with return_token_ids; in a stream, in the first chunk)
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # (with prompt_logprobs)


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(TokenIdsModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # (with return_token_ids)


class ChatCompletionResponse(TokenIdsModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # (with return_token_ids)
    prompt_logprobs: PromptLogprobs | None = None  # (with prompt_logprobs)


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(ResponseModel):
    """A tool call's piece in a stream: the first has id, type and function.name; the next ones add
    function.arguments text to the call at `index`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(TokenIdsModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # (with return_token_ids: this chunk's)


class ChatCompletionChunk(TokenIdsModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # (with return_token_ids: in the first chunk)


class CompletionChunk(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "atlas"
    root: str | None = None  # the primary served name (never a path on the server)
    parent: str | None = None  # a LoRA adapter's base model (its primary served name); None for the base model
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # (a string: base64 of little-endian float32 values)


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class ListResponse(ResponseModel):
    """The envelope of a pooling route's answer (/v1/embeddings, /classify, /pooling): `data` and `usage` follow."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class EmbeddingResponse(ListResponse):
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ClassificationData(ResponseModel):
    index: int
    label: str  # (the most probable class's, from the checkpoint's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(ListResponse):
    data: list[ClassificationData]
    usage: UsageInfo


class PoolingData(ResponseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str  # (a string: base64 of little-endian float32 values)


class PoolingResponse(ListResponse):
    data: list[PoolingData]
    usage: UsageInfo


_SCORE_TEXT = {"type": "string", "minLength": 1}
_SCORE_TEXTS = {"anyOf": [_SCORE_TEXT, {"type": "array", "items": _SCORE_TEXT, "minItems": 1}]}


def _score_texts(v: Any) -> Any:
    if (isinstance(v, str) and v) or (isinstance(v, list) and v and all(isinstance(t, str) and t for t in v)):
        return v
    raise ValueError("must be a non-empty string or a non-empty list of non-empty strings")


class ScoreRequest(TruncatingRequest):
    """POST /score (vLLM's): text_1 against text_2, pair by pair (one text against a list: against each of it); on
    an embedding model the cosine similarity of their embeddings, on a one-label classifier (a cross-encoder) its
    score of the two as one prompt (atlas/scoring.py)."""

    model: str | None = None
    text_1: Annotated[Any, WithJsonSchema(_SCORE_TEXTS)]
    text_2: Annotated[Any, WithJsonSchema(_SCORE_TEXTS)]

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        return _score_texts(v)


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(TruncatingRequest):
    """POST /rerank (vLLM's, Jina / Cohere style): the documents by their score against the query (as /score
    computes it), best first; top_n of them (all when left out or 0)."""

    model: str | None = None
    query: Annotated[str, Field(min_length=1)]
    documents: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    top_n: Annotated[Int | None, Field(ge=0)] = None
    return_documents: bool = True


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(ResponseModel):
    total_tokens: int


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's settings (tokenizer_config.json's fields, as vLLM serves them), its class and chat
    template."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None


class HealthResponse(ResponseModel):
    status: Literal["ok"] = "ok"


class VersionResponse(ResponseModel):
    version: str


class LoadResponse(ResponseModel):
    server_load: int  # HTTP requests this front end is answering, this one aside


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
