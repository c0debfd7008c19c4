"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens, as vLLM serves them) over the chat
machinery.

A Messages request becomes a chat request: `system` a system message; a user turn's text blocks its content and its
tool_result blocks tool messages before it; an assistant turn's text, thinking and tool_use blocks its content,
reasoning_content and tool_calls; custom tools function tools (input_schema their parameters); tool_choice auto /
any / tool / none as auto / required / the named function / none (disable_parallel_tool_use as
parallel_tool_calls false); stop_sequences, temperature, top_p, top_k, max_tokens as themselves; `thinking`
disabled (or enabled without a budget) as the chat template's enable_thinking and thinking variables;
output_config's json_schema format as response_format and its effort as reasoning_effort; cache_control and the
service settings (speed, service_tier) change nothing here and are ignored, as vLLM ignores them.
vLLM's sampling extensions (seed, min_p, repetition_penalty, structured_outputs, ...) pass on as they are.
It runs through the same path as /v1/chat/completions (template, tool and reasoning parsers), and its answer comes
back as a message (thinking, text and tool_use blocks; stop_reason end_turn / stop_sequence / max_tokens / tool_use)
or as Anthropic's stream events. What Atlas cannot do is refused with a 400 in Anthropic's error form, naming it:
images and documents, server tools (web search, code execution, ...), containers and MCP servers, redacted
thinking, and a thinking budget
(budget_tokens is not enforced, so a request that sets one is refused; leave `thinking` out and use the template's
own default or chat_template_kwargs).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from atlas.errors import InvalidRequestError
from atlas.server import protocol as P
from atlas.server.chat import Chat
from atlas.server.chat_prompts import chat_prompt_ids, template_and_kwargs
from atlas.server.errors import APIError, to_api_error
from atlas.server.streaming import chat_chunks, sse

# stop_reason of a chat finish_reason (a stop string that matched: stop_sequence)
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Fields of a chat request that a Messages request may carry beside Anthropic's own (vLLM's sampling extensions, and
# its structured outputs), passed on as they are
_CHAT_EXTRAS = ("seed", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "logit_bias", "structured_outputs", "response_format", "priority")
# Anthropic's error types by HTTP status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(P.RequestModel):
    """POST /v1/messages (the fields Atlas reads; others are ignored, as vLLM ignores them)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # (vLLM's extension)


class CountTokensRequest(P.RequestModel):
    """POST /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _refuse(param: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {what} is not supported by this server", param=param)


def _text(blocks: str | list[dict[str, Any]], param: str) -> str:
    """Text blocks (or a string) as one string."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _refuse(param, f"a {kind!r} block here (text blocks are)")
        parts.append(block["text"])
    return "\n".join(parts)


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic's system and messages as chat messages (module docstring)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        param = f"messages.{i}"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"{param}.role: must be 'user' or 'assistant', got {role!r}", param="messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"{param}.content: a string or a list of content blocks", param="messages")
        texts, calls, reasoning = [], [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                text = _text(result, f"{param}.content") if result is not None else ""
                if block.get("is_error"):
                    text = "Error: " + text
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "thinking" and role == "assistant":
                reasoning.append(str(block.get("thinking") or ""))
            elif kind in ("image", "document", "search_result"):
                raise _refuse("messages", f"a {kind} block ({param})")
            else:
                raise _refuse("messages", f"a {kind!r} block in a {role} message ({param})")
        if role == "user":
            if texts or not (out and out[-1]["role"] == "tool"):  # (a turn of tool results alone adds no message)
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        chat = {"role": "assistant", "content": "\n".join(texts) if texts else None}
        if calls:
            chat["tool_calls"] = calls
        if reasoning:
            chat["reasoning_content"] = "\n".join(reasoning)
        out.append(chat)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise _refuse("tools", f"the server tool {kind!r} (tools.{i}; custom tools with an input_schema are)")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise InvalidRequestError(f"tools.{i}: a tool needs a name and an input_schema object", param="tools")
        function = {"name": tool["name"], "parameters": {"type": "object", **tool["input_schema"]}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """-> (the chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequestError(f"tool_choice: type {kind!r} is not one of auto, any, tool (with a name), none",
                              param="tool_choice")


def thinking_kwargs(thinking: dict[str, Any] | None, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """`thinking` as the template variables that switch a model's thinking on or off."""
    if thinking is None:
        return kwargs
    kind = thinking.get("type")
    if kind == "enabled" and thinking.get("budget_tokens") is not None:
        raise InvalidRequestError("thinking.budget_tokens: this server does not enforce a thinking budget; leave "
                                  "thinking out (the model's default) or send chat_template_kwargs "
                                  '{"enable_thinking": true}', param="thinking")
    if kind not in ("enabled", "disabled"):
        raise InvalidRequestError(f"thinking.type: {kind!r} is not enabled or disabled", param="thinking")
    on = kind == "enabled"
    return {"enable_thinking": on, "thinking": on, **(kwargs or {})}


def output_settings(config: dict[str, Any] | None) -> dict[str, Any]:
    """output_config as chat fields: format json_schema as response_format, effort low / medium / high as
    reasoning_effort (which the chat path refuses where the template does not read it)."""
    if not config:
        return {}
    out: dict[str, Any] = {}
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError("output_config.format: a json_schema format with its schema object is what "
                                      "this server reads", param="output_config")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = config.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high"):
            raise InvalidRequestError(f"output_config.effort: {effort!r} has no reasoning_effort to map to (low, "
                                      "medium, high do)", param="output_config")
        out["reasoning_effort"] = effort
    return out


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat request a Messages request is."""
    for name in ("container", "mcp_servers"):
        if (req.model_extra or {}).get(name) is not None:
            raise _refuse(name, f"{name} (code-execution containers and MCP servers run at Anthropic)")
    choice, parallel = chat_tool_choice(req.tool_choice)
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.system, req.messages),
                            "max_tokens": req.max_tokens, "stream": req.stream}
    tools = chat_tools(req.tools)
    for key, value in (("tools", tools), ("tool_choice", choice if tools else None), ("parallel_tool_calls", parallel),
                       ("stop", req.stop_sequences or None), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("top_k", req.top_k),
                       ("chat_template_kwargs", thinking_kwargs(req.thinking, req.chat_template_kwargs))):
        if value is not None:
            body[key] = value
    body.update(output_settings(req.output_config))
    for key in _CHAT_EXTRAS:
        if (req.model_extra or {}).get(key) is not None:
            body[key] = req.model_extra[key]
    if req.stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(500, "the model wrote tool-call arguments that are not a JSON object, which a tool_use block "
                            "cannot carry: " + arguments[:200], type="api_error")
    return value


def _stop(choice: dict[str, Any], stops: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished chat choice."""
    reason = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if reason == "stop" and isinstance(matched, str) and stops and matched in stops:
        return "stop_sequence", matched
    return _STOP_REASONS.get(reason, "end_turn" if reason else None), None


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": details.get("cached_tokens", 0)}


def message_of_chat(data: dict[str, Any], message_id: str, model: str, stops: list[str] | None) -> dict[str, Any]:
    """A chat completion response -> a Messages response."""
    choice = data["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    reason, sequence = _stop(choice, stops)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(data.get("usage"))}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Any failure as Anthropic's error body: (status, {"type": "error", "error": {"type", "message"}})."""
    err = to_api_error(exc)
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return err.status, {"type": "error", "error": {"type": kind, "message": err.message}}


class StreamTranslator:
    """Chat completion chunks -> Anthropic's stream events (`event:` + `data:` lines)."""

    def __init__(self, message_id: str, model: str, stops: list[str] | None):
        self.message_id, self.model, self.stops = message_id, model, stops
        self.started = False
        self.block: str | None = None  # the open block: "thinking", "text" or "tool:<index>"
        self.index = -1  # the open block's index
        self.usage: dict[str, Any] | None = None
        self.finished: dict[str, Any] | None = None  # the finished choice

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def _start(self, events: list[str]) -> None:
        if not self.started:
            self.started = True
            usage = _usage(self.usage)
            events.append(self.event("message_start", message={
                "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {**usage, "output_tokens": 0}}))

    def _open(self, key: str, block: dict[str, Any], events: list[str]) -> None:
        if self.block == key:
            return
        self._close(events)
        self.index += 1
        self.block = key
        events.append(self.event("content_block_start", index=self.index, content_block=block))

    def _close(self, events: list[str]) -> None:
        if self.block is not None:
            events.append(self.event("content_block_stop", index=self.index))
            self.block = None

    def chunk(self, data: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if data.get("usage"):
            self.usage = data["usage"]
        self._start(events)
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, events)
                events.append(self.event("content_block_delta", index=self.index,
                                         delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                self._open("text", {"type": "text", "text": ""}, events)
                events.append(self.event("content_block_delta", index=self.index,
                                         delta={"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                key = f"tool:{call.get('index', 0)}"
                if self.block != key:
                    self._open(key, {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                                     "name": function.get("name") or "", "input": {}}, events)
                if function.get("arguments"):
                    events.append(self.event("content_block_delta", index=self.index,
                                             delta={"type": "input_json_delta",
                                                    "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self.finished = choice
        return events

    def finish(self) -> list[str]:
        events: list[str] = []
        self._start(events)
        self._close(events)
        reason, sequence = _stop(self.finished or {}, self.stops)
        events.append(self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                 usage={"output_tokens": _usage(self.usage)["output_tokens"]}))
        events.append(self.event("message_stop"))
        return events

    def failed(self, error: dict[str, Any]) -> list[str]:
        return [self.event("error", error={"type": "api_error", "message": error.get("message", "")})]


async def translate_stream(chat_lines: AsyncIterator[str], translator: StreamTranslator) -> AsyncIterator[str]:
    async for data in chat_chunks(chat_lines):
        if "error" in data:
            for event in translator.failed(data["error"]):
                yield event
            return
        for event in translator.chunk(data):
            yield event
    for event in translator.finish():
        yield event


class Messages:
    """The /v1/messages endpoints: through Chat.answer, over the chat endpoint's FrontEnd."""

    def __init__(self, chat: Chat):
        self.chat = chat
        self.front = chat.front

    async def create(self, request: Request) -> Response:
        arrival = time.time()
        self.front.check_generation()
        req: MessagesRequest = await self.front.parse_body(request, MessagesRequest)
        model = self.front.check_model(req.model)
        result = await self.chat.answer_body(request, chat_body(req), arrival)
        if isinstance(result, Response):
            return result  # (the client left)
        message_id = f"msg_{uuid.uuid4().hex}"
        if isinstance(result, BaseModel):
            return JSONResponse(message_of_chat(result.model_dump(), message_id, model, req.stop_sequences))
        return sse(translate_stream(result, StreamTranslator(message_id, model, req.stop_sequences)))

    async def count_tokens(self, request: Request) -> dict[str, int]:
        req: CountTokensRequest = await self.front.parse_body(request, CountTokensRequest)
        self.front.check_model(req.model)
        choice, _ = chat_tool_choice(req.tool_choice)
        tools = chat_tools(req.tools) if choice != "none" else None
        messages = [P.ChatMessage.model_validate(m) for m in chat_messages(req.system, req.messages)]
        template, kwargs = template_and_kwargs(self.front.settings, None,
                                               thinking_kwargs(req.thinking, req.chat_template_kwargs))
        definitions = [P.ToolDefinition.model_validate(t) for t in tools] if tools else None
        ids = await self.front.run_blocking(chat_prompt_ids, self.front, messages, True, template, kwargs,
                                            definitions)
        return {"input_tokens": len(ids)}
