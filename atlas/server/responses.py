"""The OpenAI Responses API (POST /v1/responses) over the chat machinery.

A Responses request becomes a chat request (instructions -> a system message; input items -> messages; function
tools, tool_choice and text.format -> their chat forms), runs through the same path as /v1/chat/completions
(templates, tool and reasoning parsers, structured outputs), and its result or stream is turned into Responses
output items and events. `previous_response_id` continues a stored conversation: what a response was asked and
answered is kept (unless `store: false`) in a bounded store where the engine runs, so every front end of an
`atlas serve --api-server-count N` finds it. What Atlas cannot do (built-in tools such as web search, images and
files in the input, background responses, reasoning summaries, automatic truncation; reasoning.effort where the
chat template does not read it) is refused with a 400 naming it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, WithJsonSchema

from atlas.errors import InvalidRequestError
from atlas.sampling_params import MAX_TEMPERATURE
from atlas.server import protocol as P
from atlas.server.chat import Chat
from atlas.server.errors import APIError
from atlas.server.streaming import chat_chunks, sse

# The store of past responses (where the engine runs): at most this many, and this many characters in all.


# What /openapi.json says of a Responses request: the input items, tools, tool_choice and text.format this server
# reads (input_messages and chat_request below), and the settings it has no way to honour, at the values that ask
# for nothing.
_STRING = {"type": "string"}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["input_text", "output_text", "text"]}, "text": _STRING}}
_INPUT_ITEM = {"type": "object", "oneOf": [
    {"properties": {"type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
                    "content": {"anyOf": [_STRING, {"type": "array", "items": _TEXT_PART}]}},
     "required": ["role", "content"]},
    {"properties": {"type": {"const": "function_call"}, "call_id": _STRING, "name": _STRING, "arguments": _STRING},
     "required": ["type", "call_id", "name"]},
    {"properties": {"type": {"const": "function_call_output"}, "call_id": _STRING},
     "required": ["type", "call_id"]},
    {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]},
]}
_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "minLength": 1, "maxLength": 256},
    "description": {"type": ["string", "null"]}, "parameters": {"type": ["object", "null"]},
    "strict": {"type": ["boolean", "null"]}}}
_TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required", None]}, {
    "type": "object", "required": ["type", "name"],
    "properties": {"type": {"const": "function"}, "name": _STRING}}]}
_FORMAT = {"type": "object", "required": ["type"], "oneOf": [
    {"properties": {"type": {"enum": ["text", "json_object"]}}},
    {"properties": {"type": {"const": "json_schema"}, "name": {"type": ["string", "null"]},
                    "description": {"type": ["string", "null"]}, "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]}}, "required": ["schema"]}]}


def _documented(schema: dict[str, Any]) -> WithJsonSchema:
    return WithJsonSchema(P.or_null(schema))


def request_rules(auto_tool_choice: bool = True) -> list[dict[str, Any]]:
    """The input leaves a conversation (a message or a call, or instructions); tool_choice "required" or a named
    function needs tools and leaves text.format plain; without `auto_tool_choice` (--enable-auto-tool-choice),
    tool_choice "auto" (the default with tools) needs no tools."""
    plain = P.fields(text={"type": ["object", "null"], "properties": {"format": {
        "type": ["object", "null"], "properties": {"type": {"const": "text"}}}}})
    choices = ([P.fields(tool_choice={"enum": ["none", "auto", None]})] if auto_tool_choice else
               [P.fields(tool_choice={"const": "none"}),
                P.fields(tool_choice={"enum": ["auto", None]}, tools={"type": ["array", "null"], "maxItems": 0})])
    return [
        P.either(P.present("instructions", {"type": "string", "minLength": 1}), P.present("previous_response_id"),
                 P.present("input", {"type": "string"}), P.present("input", {"type": "array", "contains": P.either(
                     P.both({"required": ["role"]}, P.fields(type={"const": "message"})),
                     P.present("type", {"enum": ["message", "function_call", "function_call_output"]}))}),
                 rule="a conversation: instructions, a previous response, or an input message or call"),
        P.either(*choices, P.both(P.present("tools", {"type": "array", "minItems": 1}), plain),
                 rule="tool_choice \"required\" or a named function needs tools, and leaves text.format plain"
                      + ("" if auto_tool_choice else "; with tools, tool_choice is given and not \"auto\" (this "
                                                     "server runs without --enable-auto-tool-choice)"))]


class ResponsesRequest(P.RequestModel):
    # The input leaves a conversation (a message or a call, or instructions); tool_choice "required" or a named
    # function needs tools and leaves text.format plain.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              json_schema_extra={"allOf": request_rules()})

    model: str | None = None
    input: Annotated[str | list[dict[str, Any]], WithJsonSchema(
        {"anyOf": [_STRING, {"type": "array", "items": _INPUT_ITEM}]})]
    instructions: str | None = None
    max_output_tokens: Annotated[P.Int | None, _documented({"type": "integer", "minimum": 1})] = None
    temperature: Annotated[float | None, _documented(P.number(0, MAX_TEMPERATURE))] = None
    top_p: Annotated[float | None, _documented(P.number(maximum=1, exclusive_minimum=0))] = None
    tools: Annotated[list[dict[str, Any]] | None, _documented({"type": "array", "items": _TOOL})] = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(_TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None
    text: Annotated[dict[str, Any] | None, _documented(
        {"type": "object", "properties": {"format": {"anyOf": [_FORMAT, {"type": "null"}]}}})] = None
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None  # (an end-user id, as OpenAI takes it: no effect on the output)
    # reasoning.effort: the chat template's reasoning_effort (where it reads one); nothing else
    reasoning: Annotated[dict[str, Any] | None, _documented({
        "type": "object", "additionalProperties": {"type": "null"},
        "properties": {"effort": {"enum": ["low", "medium", "high", None]}}})] = None
    truncation: Annotated[str | None, WithJsonSchema({"enum": ["disabled", None]})] = None
    include: Annotated[list[str] | None, _documented({"type": "array", "maxItems": 0})] = None
    background: Annotated[bool | None, WithJsonSchema({"enum": [False, None]})] = None
    service_tier: Annotated[str | None, WithJsonSchema({"enum": ["auto", "default", None]})] = None


def _refuse(param: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {what} is not supported by this server", param=param)


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param}: a string or a list of text parts", param=param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise _refuse(param, f"content of type {kind!r} (only text)")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{param}: a text part needs 'text'", param=param)
        texts.append(part["text"])
    return "\n".join(texts)  # (as a chat message's text parts join for a string template)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{param}.role: one of user, assistant, system, developer", param=param)
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not all(isinstance(v, str) for v in (call["id"], call["function"]["name"], call["function"]["arguments"])):
                raise InvalidRequestError(f"{param}: a function_call needs call_id, name and arguments (strings)",
                                          param=param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequestError(f"{param}: a function_call_output needs call_id", param=param)
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # (the model's earlier reasoning: chat templates leave it out of later turns too)
        else:
            raise _refuse(param, f"an item of type {kind!r}")
    return messages


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """-> (the chat request body, the conversation without the instructions, to store)."""
    if req.background:
        raise _refuse("background", "background responses")
    other = sorted(k for k, v in (req.reasoning or {}).items() if k != "effort" and v is not None)
    if other:  # (reasoning.effort becomes the chat request's reasoning_effort)
        raise _refuse("reasoning", f"reasoning.{other[0]}")
    if req.truncation not in (None, "disabled"):
        raise _refuse("truncation", f"truncation {req.truncation!r}")
    if req.include:
        raise _refuse("include", f"include {req.include!r}")
    if req.service_tier not in (None, "auto", "default"):
        raise _refuse("service_tier", f"service_tier {req.service_tier!r}")
    conversation = [*history, *input_messages(req.input)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("parallel_tool_calls", req.parallel_tool_calls), ("user", req.user),
                        ("reasoning_effort", (req.reasoning or {}).get("effort"))):
        if value is not None:
            body[name] = value
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise _refuse(f"tools[{i}]", f"a tool of type {tool.get('type')!r} (only function tools)")
            if not isinstance(tool.get("strict"), (bool, type(None))):
                raise InvalidRequestError(f"tools[{i}].strict: must be a boolean", param=f"tools[{i}]")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice", f"tool_choice {choice!r} (only a function by name)")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}}
        elif kind == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif kind != "text":
            raise _refuse("text.format", f"format {fmt!r}")
    return body, conversation


# ---------------------------------------------------------------------------------- results
# The response object as /openapi.json documents it (response_object and the _*_item functions below build it).
class OutputText(P.ResponseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(P.ResponseModel):
    type: Literal["reasoning_text"]
    text: str


class MessageItem(P.ResponseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed"]
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningItem(P.ResponseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: Literal["in_progress", "completed"]


class FunctionCallItem(P.ResponseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed"]


class CachedTokens(P.ResponseModel):
    cached_tokens: int


class ReasoningTokens(P.ResponseModel):
    reasoning_tokens: int


class ResponseUsage(P.ResponseModel):
    input_tokens: int
    input_tokens_details: CachedTokens
    output_tokens: int
    output_tokens_details: ReasoningTokens
    total_tokens: int


class ResponseObject(P.ResponseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[MessageItem | ReasoningItem | FunctionCallItem]
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    store: bool
    user: str | None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def response_object(req: ResponsesRequest, response_id: str, created: int, model: str, output: list[dict[str, Any]],
                    status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "usage": _usage(usage), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
        "metadata": req.metadata or {}, "store": req.store is not False, "user": req.user,
    }


def _reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_of_chat(choice: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A chat choice -> (Responses output items, the assistant message to store)."""
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    calls = message.get("tool_calls") or []
    for call in calls:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    stored = {"role": "assistant", "content": message.get("content")}
    if calls:
        stored["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])} for c in calls]
    return output, stored


class StreamTranslator:
    """Chat completion chunks -> Responses streaming events (`event:` + `data:` lines)."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: int, model: str):
        self.req, self.response_id, self.created, self.model = req, response_id, created, model
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, int] = {}  # "reasoning" / "message" / "call:<index>" -> output index
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.message: dict[str, Any] = {"role": "assistant", "content": None}

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def start(self) -> list[str]:
        response = response_object(self.req, self.response_id, self.created, self.model, [], "in_progress", None)
        return [self.event("response.created", response=response), self.event("response.in_progress", response=response)]

    def _open(self, key: str, item: dict[str, Any], events: list[str]) -> int:
        index = len(self.output)
        self.output.append(item)
        self.open[key] = index
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        return index

    def chunk(self, data: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if data.get("usage"):
            self.usage = data["usage"]
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if "reasoning" not in self.open:
                    self._open("reasoning", _reasoning_item("", status="in_progress"), events)
                index = self.open["reasoning"]
                item = self.output[index]
                item["content"][0]["text"] += delta["reasoning_content"]
                events.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                         content_index=0, delta=delta["reasoning_content"]))
            if delta.get("content"):
                if "message" not in self.open:
                    item = _message_item("", status="in_progress")
                    index = self._open("message", item, events)
                    events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                             content_index=0, part={"type": "output_text", "text": "",
                                                                    "annotations": []}))
                index = self.open["message"]
                item = self.output[index]
                item["content"][0]["text"] += delta["content"]
                events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                         content_index=0, delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or []:
                key = f"call:{call.get('index', 0)}"
                function = call.get("function") or {}
                if key not in self.open:
                    self._open(key, _call_item(call.get("id") or _new_id("call"), function.get("name") or "", "",
                                               status="in_progress"), events)
                index = self.open[key]
                item = self.output[index]
                if function.get("arguments"):
                    item["arguments"] += function["arguments"]
                    events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                             output_index=index, delta=function["arguments"]))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> tuple[list[str], dict[str, Any]]:
        """-> (the closing events, the assistant message to store)."""
        events = []
        calls = []
        for key, index in self.open.items():
            item = self.output[index]
            item["status"] = "completed"
            if key == "reasoning":
                events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=item["content"][0]["text"]))
            elif key == "message":
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"], logprobs=[]))
                events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                         content_index=0, part=part))
                self.message["content"] = part["text"]
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, arguments=item["arguments"]))
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"], "arguments": item["arguments"]}})
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        if calls:
            self.message["tool_calls"] = calls
        status = "incomplete" if self.finish_reason == "length" else "completed"
        response = response_object(self.req, self.response_id, self.created, self.model, self.output, status,
                                   self.usage)
        events.append(self.event("response.completed" if status == "completed" else "response.incomplete",
                                 response=response))
        return events, self.message

    def failed(self, error: dict[str, Any]) -> list[str]:
        response = response_object(self.req, self.response_id, self.created, self.model, self.output, "failed",
                                   self.usage)
        response["error"] = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        return [self.event("error", code=error.get("code"), message=error.get("message", ""),
                           param=error.get("param")),
                self.event("response.failed", response=response)]


async def translate_stream(chat_lines: AsyncIterator[str], translator: StreamTranslator, on_done) -> AsyncIterator[str]:
    """The chat stream's SSE lines -> Responses events; `on_done(message)` gets the assistant message at the end."""
    for event in translator.start():
        yield event
    async for data in chat_chunks(chat_lines):
        if "error" in data:
            for event in translator.failed(data["error"]):
                yield event
            return
        for event in translator.chunk(data):
            yield event
    events, message = translator.finish()
    for event in events:
        yield event
    await on_done(message)


class Responses:
    """The /v1/responses endpoint: through Chat.answer, over the chat endpoint's FrontEnd."""

    def __init__(self, chat: Chat):
        self.chat = chat
        self.front = chat.front

    async def create(self, request: Request) -> Response:
        """POST /v1/responses: the request as a chat, its answer as a response object or Responses events."""
        arrival = time.time()
        self.front.check_generation()
        req: ResponsesRequest = await self.front.parse_body(request, ResponsesRequest)
        model = self.front.check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = await self.front.engine.load_response(req.previous_response_id)
            if history is None:
                raise APIError(400, f"previous_response_id: no stored response {req.previous_response_id!r} (it was "
                                    "made with store: false, or is too old)", param="previous_response_id")
        body, conversation = chat_request(req, history)
        result = await self.chat.answer_body(request, body, arrival)
        if isinstance(result, Response):
            return result  # (the client left)
        response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())

        async def keep(message: dict[str, Any]) -> None:
            if req.store is not False:
                await self.front.engine.store_response(response_id, [*conversation, message])

        if isinstance(result, BaseModel):
            data = result.model_dump()
            choice = data["choices"][0]
            output, message = output_of_chat(choice)
            await keep(message)
            status = "incomplete" if choice["finish_reason"] == "length" else "completed"
            return JSONResponse(response_object(req, response_id, created, model, output, status, data["usage"]))
        return sse(translate_stream(result, StreamTranslator(req, response_id, created, model), keep))
