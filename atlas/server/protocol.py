"""Pydantic models of the OpenAI completion and chat-completion APIs (the subset Atlas serves).

Requests are validated strictly (a string is not a number, a float is not an integer, NaN and
infinities are refused) but unknown fields are ignored, since OpenAI clients send some that Atlas
has no use for. Fields beyond OpenAI's (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, ...) have vLLM's names.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Message roles a chat may use ("tool": a tool's result, answering an assistant's tool call). The legacy
# "function" role (of the deprecated functions API) is refused.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
LEGACY_ROLES = ("function",)


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
    "use_beam_search": (_falsy, "beam search is not supported"),
    "allowed_token_ids": (_unset, "allowed_token_ids is not supported"),
    "bad_words": (_unset, "bad_words is not supported"),
    "logits_processors": (_unset, "logits processors are not supported"),
    "truncate_prompt_tokens": (_unset, "prompt truncation is not supported"),
    "continue_final_message": (_falsy, "continue_final_message belongs to chat messages (chat completions and "
                                        "/tokenize)"),
    "documents": (_unset, "documents are not supported"),
    "return_tokens_as_token_ids": (_falsy, "return_tokens_as_token_ids is not supported"),
    "structural_tag": (_unset, "a top-level structural_tag is not read; give it as response_format {\"type\": "
                               "\"structural_tag\", ...} or structured_outputs.structural_tag"),
}
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


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------- requests
class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
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


class SamplingRequest(RequestModel):
    """Fields that completions and chat completions share."""

    model: str | None = None
    n: int | None = 1  # null (as some clients send for "default") means 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Any = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Beyond OpenAI (vLLM names).
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # best_of is accepted when it equals n (OpenAI's default); see also UNSUPPORTED_FIELDS.
    best_of: int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prompt pages
    # vLLM's: token ids beside the text (prompt_token_ids, and each choice's token_ids; streamed as deltas)
    return_token_ids: bool | None = None
    # vLLM's: each prompt token's logprob and the top k (not in streams), as `prompt_logprobs` in the response
    prompt_logprobs: int | None = None
    priority: int | None = None  # vLLM's: lower runs first (needs --scheduling-policy priority)
    # OpenAI's: {token id (a decimal string, as JSON keys are): bias in [-100, 100]} added to those logits
    logit_bias: dict[str, float] | None = None

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


class CompletionRequest(SamplingRequest):
    prompt: Any
    max_tokens: int | None = None  # None: 16, as OpenAI (capped at what the context leaves)
    echo: bool | None = False
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str) or (_is_token_list(v) and v):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(_is_token_list(p) for p in v)):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        if isinstance(self.prompt, str) or _is_token_list(self.prompt):
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: str
    content: Any = None
    name: str | None = None

    tool_calls: list[dict[str, Any]] | None = None
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
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(part, dict) for part in v):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            return v
        raise ValueError("must be a string or a list of content parts")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: content flattened to a string, tool-call arguments as
        objects (templates write them with tojson) where they are JSON."""
        message = {k: v for k, v in self.model_dump().items() if v is not None}
        message["content"] = self.text()
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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
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
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings (OpenAI's, with vLLM's add_special_tokens)."""

    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    add_special_tokens: bool = True

    @field_validator("input")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        if (isinstance(v, str) and v) or (_is_token_list(v) and v):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) and p for p in v)
                                          or all(_is_token_list(p) and p for p in v)):
            return v
        raise ValueError("must be a non-empty string, a list of non-empty strings, a list of token ids or a list "
                         "of non-empty token-id lists")

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text or token ids."""
        if isinstance(self.input, str) or _is_token_list(self.input):
            return [self.input]
        return list(self.input)


# ---------------------------------------------------------------------------------- responses
class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


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


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


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


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
