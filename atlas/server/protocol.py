"""Pydantic models of the OpenAI completion and chat-completion APIs (the subset Atlas serves).

Requests are validated strictly (a string is not a number, a float is not an integer, NaN and
infinities are refused) but unknown fields are ignored, since OpenAI clients send some that Atlas
has no use for. Fields beyond OpenAI's (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, ...) have vLLM's names.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------- requests
class StreamOptions(RequestModel):
    include_usage: bool = False


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
    # OpenAI fields Atlas does not implement: refused when they would change the result.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

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
    suffix: str | None = None

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
        """The message as a chat template expects it: content flattened to a string."""
        message = {k: v for k, v in self.model_dump().items() if v is not None}
        message["content"] = self.text()
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


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


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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


class ChatResponseMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


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
    root: str | None = None
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


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
