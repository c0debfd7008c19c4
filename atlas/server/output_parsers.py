"""Reading a chat reply's text as OpenAI clients expect it: reasoning split from the answer
(`--reasoning-parser`), and tool calls taken out of the text (`--tool-call-parser`, or the JSON the
grammar forced for `tool_choice: required` / a named function).

Every parser is a pure function of the text generated so far, `parse(text, final)`. A streamed reply
is the same function applied to each longer prefix: the parts it returns only grow (text that could
still turn into a tag, such as a trailing "<tool_", is held back until it is known), so the deltas
are the differences between two parses, and the streamed reply, put together, is exactly the
non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------- pieces
_DECODER = json.JSONDecoder()
# The head of one call object, name first: {"name": "f", "arguments": (or "parameters")
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_OBJECT_END = re.compile(r"\s*\}")
_NAME_ONLY = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ParsedCall:
    name: str | None
    arguments: str  # the arguments' JSON text so far (complete once `complete`)
    complete: bool


@dataclass
class Parsed:
    content: str | None = None
    reasoning: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)


def _unquote(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def parse_call_object(text: str, pos: int) -> tuple[ParsedCall | None, int]:
    """One call object {"name": ..., "arguments"|"parameters": {...}} starting at text[pos:] (perhaps
    still being written). -> (the call or None if nothing of it is readable yet, index after it)."""
    m = _CALL_HEAD.match(text, pos)
    if m is not None:
        name = _unquote(m.group(1))
        start = m.end()
        try:
            _, end = _DECODER.raw_decode(text, start)
        except ValueError:
            return ParsedCall(name, text[start:], False), len(text)
        after = _OBJECT_END.match(text, end)
        if after is None:  # more keys after the arguments, or the object is not closed yet
            closed = _close_object(text, end)
            return ParsedCall(name, text[start:end], closed is not None), closed if closed is not None else len(text)
        return ParsedCall(name, text[start:end], True), after.end()
    # Keys in another order: read the object once it is whole.
    try:
        obj, end = _DECODER.raw_decode(text, pos + len(text[pos:]) - len(text[pos:].lstrip()))
    except ValueError:
        m = _NAME_ONLY.match(text, pos)
        return (ParsedCall(_unquote(m.group(1)), "", False) if m else None), len(text)
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                          True), end
    return None, end


def _close_object(text: str, pos: int) -> int | None:
    """After the arguments value, skip the object's remaining keys to its closing brace."""
    depth, in_string, escape = 1, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _call_list(text: str, pos: int, separators: str) -> list[ParsedCall]:
    """Call objects one after another from pos, separated by any of `separators` and whitespace."""
    calls = []
    while pos < len(text):
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            break
        call, pos = parse_call_object(text, pos)
        if call is None:
            break
        calls.append(call)
        if not call.complete:
            break
    return calls


# ---------------------------------------------------------------------------------- tool-call formats
class ToolParser:
    """Turns reply text into (content, tool calls)."""

    name = ""

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them; the
    content is the text before the first one."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        first = text.find(self.START)
        if first < 0:
            keep = len(text) if final else len(text) - _held_back(text, self.START)
            return text[:keep], []
        calls = []
        pos = first
        while pos >= 0:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start: end if end >= 0 else len(text)]
            if end < 0 and not final:
                body = body[: len(body) - _held_back(body, self.END)]
            call, _ = parse_call_object(body, 0)
            if call is not None:
                calls.append(call)
            if end < 0:
                break
            pos = text.find(self.START, end + len(self.END))
        content = text[:first]
        return (content if content.strip() else None), calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3 JSON: a reply that starts (after an optional <|python_tag|>) with {"name": ...,
    "parameters": {...}} is tool calls, several separated by ';'; any other reply is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        body = text.lstrip()
        if body.startswith(self.TAG):
            return None, _call_list(body, len(self.TAG), ";")
        if not final and (not body or self.TAG.startswith(body)):
            return "", []  # too early to tell
        if not body.startswith("{"):
            return text, []
        return None, _call_list(body, 0, ";")


class RequiredToolParser(ToolParser):
    """tool_choice "required": the grammar made the reply a JSON array of {"name", "parameters"}."""

    name = "required"

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        start = text.find("[")
        return None, ([] if start < 0 else _call_list(text, start + 1, ","))


class NamedToolParser(ToolParser):
    """A named function in tool_choice: the grammar made the whole reply its arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        if not final:
            return None, [ParsedCall(self.function, text, False)]
        try:
            _DECODER.decode(text)
            complete = True
        except ValueError:
            complete = False
        return None, [ParsedCall(self.function, text, complete)]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "llama": Llama3JsonToolParser,
}


# ---------------------------------------------------------------------------------- reasoning
class ReasoningParser:
    """<think>...</think> at the start of a reply is reasoning; the rest is the answer.

    qwen3: without a <think> the reply is all answer (thinking switched off by the template or the
    model); deepseek_r1: the template opens <think> in the prompt, so everything up to </think> is
    reasoning, with or without an opening tag."""

    START, END = "<think>", "</think>"

    def __init__(self, name: str):
        self.name = name
        self.implicit_start = name == "deepseek_r1"

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        body = text
        stripped = body.lstrip()
        opened = stripped.startswith(self.START)
        if not opened and not final and not self.implicit_start and self.START.startswith(stripped):
            return None, ""  # may still become "<think>"
        if opened:
            body = stripped[len(self.START):]
        elif not self.implicit_start:
            return None, text
        end = body.find(self.END)
        if end < 0:
            keep = len(body) if final else len(body) - _held_back(body, self.END)
            return body[:keep], ""
        return body[:end], body[end + len(self.END):].lstrip("\n")


REASONING_PARSERS = ("qwen3", "deepseek_r1")


# ---------------------------------------------------------------------------------- one choice
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceParser:
    """The parsers one choice goes through (reasoning first, then tool calls in the answer), with what a
    stream has sent so far."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls  # parallel_tool_calls false: the first call only
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_calls: list[tuple[str, int]] = []  # (call id, argument characters sent)

    def parse(self, text: str, final: bool) -> Parsed:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, final)
        if self.tools is None:
            return Parsed(content if content or reasoning is None else None, reasoning)
        content, calls = self.tools.parse(content, final)
        return Parsed(content or None, reasoning, calls[: self.max_calls])

    def delta(self, text: str, final: bool) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning delta, content delta, tool-call deltas as OpenAI streams them) since the last call."""
        parsed = self.parse(text, final)
        reasoning = (parsed.reasoning or "")[self.sent_reasoning:]
        self.sent_reasoning += len(reasoning)
        content = (parsed.content or "")[self.sent_content:]
        self.sent_content += len(content)
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self.sent_calls):
                self.sent_calls.append((new_call_id(), 0))
                deltas.append({"index": index, "id": self.sent_calls[index][0], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            call_id, sent = self.sent_calls[index]
            more = call.arguments[sent:]
            if more:
                self.sent_calls[index] = (call_id, sent + len(more))
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += more
                else:
                    deltas.append({"index": index, "function": {"arguments": more}})
        return reasoning or None, content or None, deltas

    def call_ids(self, n: int) -> list[str]:
        """Ids for the calls of a whole (non-streamed) reply."""
        while len(self.sent_calls) < n:
            self.sent_calls.append((new_call_id(), 0))
        return [cid for cid, _ in self.sent_calls[:n]]
