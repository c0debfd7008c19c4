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

import ast
import json
import math
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


def _before_marker(text: str, marker: str, final: bool) -> str:
    """A reply in which `marker` has not come: all of it once it has ended, else less a suffix that may still become
    the marker."""
    return text if final else text[: len(text) - _held_back(text, marker)]


@dataclass
class ParsedCall:
    name: str | None
    arguments: str  # the arguments' JSON text so far (complete once `complete`)
    complete: bool
    id: str | None = None  # the call id the model wrote, for a format that has one (kimi_k2); else the server's


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
    """Turns reply text into (content, tool calls). `tools` maps each of the request's tool names to its
    parameters schema (the formats that write argument values as bare text type them by it)."""

    name = ""
    # The format's markers are special tokens, which detokenizing with skip_special_tokens would remove: the
    # server keeps special tokens in the text of a request this parser reads.
    needs_special_tokens = False

    def __init__(self, tools: dict[str, dict] | None = None):
        self.tools = tools or {}

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
            return _before_marker(text, self.START, final), []
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


class Ernie45ToolParser(HermesToolParser):
    """ERNIE 4.5 (the thinking models): hermes's <tool_call> JSON blocks; the content before them loses its trailing
    newlines, and an answer between <response> and </response> loses the markers (each with a newline after it),
    as vLLM's ernie45 reads them."""

    name = "ernie45"
    MARKERS = ("<response>", "</response>")

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        content, calls = super().parse(text, final)
        if content is None:
            return None, calls
        for marker in self.MARKERS:
            content = content.replace(marker + "\n", "").replace(marker, "")
        if not final:  # (a marker may still be coming)
            content = content[: len(content) - max(_held_back(content, m) for m in self.MARKERS)]
        if calls or not final:  # (newlines before calls are dropped; before the end, a call may still come)
            content = content.rstrip("\n")
        return (content or None), calls


class LongcatToolParser(HermesToolParser):
    """LongCat-Flash: hermes's JSON calls between <longcat_tool_call> and </longcat_tool_call> (special tokens,
    kept in the text of requests with this parser)."""

    name = "longcat"
    needs_special_tokens = True
    START, END = "<longcat_tool_call>", "</longcat_tool_call>"


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


class GraniteToolParser(ToolParser):
    """Granite 3.x: a reply that starts (after <|tool_call|>, Granite 3.0's special token, or <tool_call>, Granite
    3.1's text) with a JSON array [{"name": ..., "arguments": {...}}, ...] is tool calls; any other reply is content.
    (Granite 4.0 writes hermes's <tool_call> blocks: --tool-call-parser hermes, as vLLM advises.)"""

    name = "granite"
    needs_special_tokens = True
    MARKERS = ("<|tool_call|>", "<tool_call>")

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        body = text.lstrip()
        for marker in self.MARKERS:
            if body.startswith(marker):
                body = body[len(marker):].lstrip()
                break
        else:
            if not final and any(marker.startswith(body) for marker in self.MARKERS):
                return "", []  # too early to tell
        if not final and not body:
            return "", []
        if not body.startswith("["):
            return text, []
        return None, _call_list(body, 1, ",")


class Phi4MiniJsonToolParser(ToolParser):
    """Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]` (or "parameters"); the content is the text
    before it (none when that is only whitespace); any other reply is content."""

    name = "phi4_mini_json"
    TAG = "functools["

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.TAG)
        if start < 0:
            return _before_marker(text, self.TAG, final), []
        content = text[:start]
        return (content if content.strip() else None), _call_list(text, start + len(self.TAG), ",")


class _JsonCallListParser(ToolParser):
    """A JSON list of {"name": ..., "arguments": {...}} calls between START and END (special tokens, kept in the text
    of requests with this parser), in one block or several; the content is the text before the first START (none
    when only whitespace); text after a block is not content. A reply with START whose blocks hold no call it can
    read is all content (as vLLM's)."""

    needs_special_tokens = True
    START = END = ""

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        first = text.find(self.START)
        if first < 0:
            return _before_marker(text, self.START, final), []
        calls: list[ParsedCall] = []
        pos = first
        while pos >= 0:
            body = pos + len(self.START)
            while body < len(text) and text[body].isspace():
                body += 1
            if body < len(text) and text[body] == "[":
                calls += _call_list(text, body + 1, ",")
            end = text.find(self.END, body)
            pos = -1 if end < 0 else text.find(self.START, end + len(self.END))
        if final and not calls:
            return text, []
        content = text[:first]
        return (content if content.strip() else None), calls


class JambaToolParser(_JsonCallListParser):
    """Jamba 1.5 - 1.7: <tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>."""

    name = "jamba"
    START, END = "<tool_calls>", "</tool_calls>"


class HunyuanA13BToolParser(JambaToolParser):
    """Hunyuan-A13B: Jamba's <tool_calls>[...]</tool_calls> list (inside the reply's answer)."""

    name = "hunyuan_a13b"


class NemotronJsonToolParser(_JsonCallListParser):
    """Nemotron-H, Nemotron Nano 2 / 3 (and Llama-Nemotron): <TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>."""

    name = "nemotron_json"
    START, END = "<TOOLCALL>", "</TOOLCALL>"


class Lfm2ToolParser(ToolParser):
    """LFM2 / LFM2.5: a pythonic list of calls ([get_weather(city="Oslo")], as `pythonic` reads it) between the
    special tokens <|tool_call_start|> and <|tool_call_end|>. The calls are returned once the list closes; the
    content is the text before the start token and after the end token, less an echo of the call that LFM2 sometimes
    writes after it and caps with a second end token (everything through the last end token is dropped; while the
    reply is streamed, text after the end token that starts with "[" or "<" is held back until it is known not to
    be one). A start token whose text is not a list of calls makes the whole reply content (as vLLM's)."""

    name = "lfm2"
    needs_special_tokens = True
    START, END = "<|tool_call_start|>", "<|tool_call_end|>"

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return _before_marker(text, self.START, final), []
        before = text[:start]
        end = text.find(self.END, start)
        body = text[start + len(self.START): end if end >= 0 else len(text)].strip()
        closes = _list_end(body) if body.startswith("[") else None
        calls = _pythonic_calls(body[:closes]) if closes is not None else None
        if calls is None:
            if final:
                return text, []
            return (before if before.strip() else None), []
        after = "" if end < 0 else text[end + len(self.END):]
        echo = after.rfind(self.END)
        if echo >= 0:
            after = after[echo + len(self.END):]
        elif not final and after.lstrip().startswith(("[", "<")):
            after = ""  # (perhaps an echo of the call still being written)
        elif not final:
            after = after[: len(after) - _held_back(after, self.END)]
        content = (before if before.strip() else "") + (after if after.strip() else "")
        return (content or None), calls


class ApertusToolParser(ToolParser):
    """Apertus: a JSON list of one-key objects, {"NAME": {arguments}}, between the special tokens <|tools_prefix|> and
    <|tools_suffix|>. Each call is returned once its object closes; the content is the text before the prefix and
    after the suffix, as written; a prefix whose list holds no call it can read makes the whole reply content."""

    name = "apertus"
    needs_special_tokens = True
    START, END = "<|tools_prefix|>", "<|tools_suffix|>"

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return _before_marker(text, self.START, final), []
        pos = start + len(self.START)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        calls: list[ParsedCall] = []
        if text.startswith("[", pos):
            pos += 1
            while True:
                while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
                    pos += 1
                try:
                    item, pos = _DECODER.raw_decode(text, pos)
                except ValueError:
                    break
                if not isinstance(item, dict) or len(item) != 1:
                    break
                name, arguments = next(iter(item.items()))
                encoded = _json_or_none(arguments)
                if encoded is None:
                    break
                calls.append(ParsedCall(name, encoded, True))
        if final and not calls:
            return text, []
        end = text.find(self.END, start)
        after = "" if end < 0 else text[end + len(self.END):].replace(self.END, "")
        if not final:
            after = after[: len(after) - _held_back(after, self.START)]
        content = (text[:start] if text[:start].strip() else "") + (after if after.strip() else "")
        return (content or None), calls


class Olmo3ToolParser(ToolParser):
    """Olmo 3: pythonic calls one a line (get_weather(city="Oslo", metric=true): JSON's null / true / false read as
    literals too) between <function_calls> and </function_calls> at the start of the reply. The calls are the
    leading lines that read as calls, each returned once its line has ended (a newline or the closing tag); text
    after them is not content; a reply that does not start with the tag, or whose block holds no call, is all
    content. (vLLM's olmo3 also reads untagged lines as calls when the reply is not streamed; here a reply reads
    the same streamed or not.)"""

    name = "olmo3"
    START, END = "<function_calls>", "</function_calls>"

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        body = text.lstrip()
        if not body.startswith(self.START):
            if not final and self.START.startswith(body):
                return None, []  # (too early to tell)
            return text, []
        inner = body[len(self.START):]
        end = inner.find(self.END)
        closed = end >= 0 or final
        inner = inner[:end] if end >= 0 else inner
        lines = inner.split("\n")
        if not closed:
            lines = lines[:-1]  # (the line still being written)
        calls: list[ParsedCall] = []
        for line in lines:
            if not line.strip():
                continue
            call = _pythonic_calls(f"[{line.strip()}]", json_names=True)
            if call is None or len(call) != 1:
                break
            calls += call
        if final and not calls:
            return text, []
        return None, calls


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
        super().__init__()
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


# ---------------------------------------------------------------------------------- families' formats
# What each does with output it cannot read follows vLLM's parser of the same name unless said otherwise; where
# vLLM's streamed and whole replies disagree, the whole one is followed, since here a stream is the whole reply
# arriving in pieces.
def _held_back_any(text: str, tags: tuple[str, ...]) -> int:
    return max(_held_back(text, tag) for tag in tags)


def _find_any(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The first of tags in text[start:] -> (index, tag), or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, tag
    return best, found


def _json_or_none(value) -> str | None:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _literal(text: str):
    """A Python literal (never evaluated: ast.literal_eval), or raise ValueError."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(text) from None


def _object_text(pairs: list[tuple[str, str]], closed: bool) -> str:
    """JSON object text from (key, value JSON) pairs, as json.dumps writes it; without its closing brace while
    more pairs may come, so that it only grows."""
    body = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in pairs)
    return body + "}" if closed else body


def _schema_properties(tools: dict[str, dict], function: str) -> dict:
    params = tools.get(function)
    if not isinstance(params, dict):
        return {}
    props = params.get("properties", params)
    return props if isinstance(props, dict) else {}


def _int_or_text(raw: str):
    try:
        return int(raw)
    except ValueError:
        return raw


def _number_or_text(raw: str):
    """A finite number (a whole one as an integer), else the text."""
    try:
        number = float(raw)
    except ValueError:
        return raw
    if not math.isfinite(number):
        return raw
    return int(number) if number == int(number) else number


def _qwen3_coder_value(raw: str, name: str, props: dict):
    """A Qwen3-Coder parameter's text typed by the tool's schema (vLLM's and Qwen's rules): "null" is null;
    a parameter the schema does not declare, or one of a string type, stays text; integer and number types are
    read as numbers (a whole number as an integer), booleans as true for "true" (any case) and false for anything
    else (vLLM's rule, which it logs); objects and arrays as
    JSON, then as a Python literal; any other type as a Python literal. Text that does not read as its type
    stays text."""
    if raw.lower() == "null":
        return None
    if name not in props:
        return raw
    spec = props[name]
    kind = str(spec["type"]).strip().lower() if isinstance(spec, dict) and "type" in spec else "string"
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return raw
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        return _int_or_text(raw)
    if kind.startswith(("num", "float")):
        return _number_or_text(raw)
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        return _json_or_literal(raw)
    return _literal_or_text(raw)


def _json_or_literal(raw: str):
    """raw read as JSON, else as a Python literal, else as it is (text)."""
    try:
        return json.loads(raw)
    except ValueError:
        return _literal_or_text(raw)


def _literal_or_text(raw: str):
    try:
        return _literal(raw)
    except ValueError:
        return raw


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder: <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>.

    A value is the text between its tags less one newline each side, typed by the request's schema
    (_qwen3_coder_value). A parameter also ends at the next <parameter= or at </function>; a function ends at
    </function>, </tool_call> or the end of the reply (a reply cut short still returns the parameters it
    finished, as vLLM does). Content is the text before the first <tool_call> (or <function= without one).
    Streamed, each parameter is sent once its value has ended. A parameter named twice keeps its first value
    (vLLM keeps the last: the first keeps the streamed arguments a prefix of the whole). A reply whose only
    function header never closes (no ">") is all content, as in vLLM. Text between and after calls is not
    content (as vLLM)."""

    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        first_fn = text.find(self.FUNCTION)
        if first_fn < 0:
            start = text.find(self.START)
            if final:
                return text, []
            if start >= 0:
                return text[:start], []  # (a <function= may follow)
            return text[: len(text) - _held_back_any(text, (self.START, self.FUNCTION))], []
        start = text.find(self.START)
        first = start if 0 <= start < first_fn else first_fn
        calls: list[ParsedCall] = []
        pos = first_fn
        while pos >= 0:
            name_start = pos + len(self.FUNCTION)
            name_end = text.find(">", name_start)
            if name_end < 0:
                if final and not calls:
                    return text, []  # (vLLM: the header cannot be read, the reply is content)
                break
            body_end, tag = _find_any(text, (self.FUNCTION_END, self.END, self.FUNCTION), name_end + 1)
            closed = body_end >= 0 and tag != self.FUNCTION
            if body_end < 0:
                body_end = len(text)
            ended = body_end < len(text) or final
            calls.append(self._call(text[name_start:name_end].strip(), text[name_end + 1: body_end], ended,
                                    closed))
            if not ended:
                break
            pos = text.find(self.FUNCTION, body_end if tag == self.FUNCTION else body_end + len(tag))
        content = text[:first]
        return (content if content else None), calls

    def _call(self, name: str, body: str, ended: bool, complete: bool) -> ParsedCall:
        props = _schema_properties(self.tools, name)
        pairs: list[tuple[str, str]] = []
        seen: set[str] = set()
        pos = body.find(self.PARAM)
        while pos >= 0:
            name_start = pos + len(self.PARAM)
            name_end = body.find(">", name_start)
            if name_end < 0:
                break
            value_end, tag = _find_any(body, (self.PARAM_END, self.PARAM), name_end + 1)
            if value_end < 0:
                if not ended:
                    break  # (still being written)
                value_end = len(body)  # (the reply ended inside the value)
            key = body[name_start:name_end].strip()
            value = body[name_end + 1: value_end]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            if key not in seen:
                seen.add(key)
                typed = _json_or_none(_qwen3_coder_value(value, key, props))
                pairs.append((key, typed if typed is not None else json.dumps(value, ensure_ascii=False)))
            if value_end >= len(body):
                break
            pos = body.find(self.PARAM, value_end if tag == self.PARAM else value_end + len(tag))
        return ParsedCall(name, _object_text(pairs, ended), complete)


def _glm_value(raw: str, key: str, props: dict):
    """A GLM-4.5 argument value: text for a parameter the schema types "string", else JSON, else a Python
    literal, else text (vLLM's rules)."""
    spec = props.get(key)
    if isinstance(spec, dict) and spec.get("type") == "string":
        return raw
    return _json_or_literal(raw)


class SeedOssToolParser(Qwen3CoderToolParser):
    """Seed-OSS: Qwen3-Coder's XML calls (<function=NAME><parameter=P>VALUE</parameter></function>, values typed the
    same way) between <seed:tool_call> and </seed:tool_call> (special tokens, kept in the text of requests with this
    parser)."""

    name = "seed_oss"
    needs_special_tokens = True
    START, END = "<seed:tool_call>", "</seed:tool_call>"


class _WholeCallsParser(ToolParser):
    """Calls between START and END, each returned (and streamed) once its END has come. Content is the text
    before the first START; a call still open when the reply ends, or one `_call` cannot read, is added to the
    content; text between and after calls is not content."""

    START = END = ""

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        first = text.find(self.START)
        if first < 0:
            return _before_marker(text, self.START, final), []
        content = text[:first]
        calls: list[ParsedCall] = []
        pos = first
        while pos >= 0:
            end = text.find(self.END, pos + len(self.START))
            if end < 0:
                if final:
                    content += text[pos:]
                break
            call = self._call(text[pos + len(self.START): end])
            if call is None:
                content += text[pos: end + len(self.END)]
            else:
                calls.append(call)
            pos = text.find(self.START, end + len(self.END))
        return (content if content else None), calls

    def _call(self, body: str) -> ParsedCall | None:
        raise NotImplementedError


class Glm45ToolParser(_WholeCallsParser):
    """GLM-4.5 / 4.6: <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>.

    Values are stripped and typed by the request's schema (_glm_value). A call is returned (and streamed) once
    its </tool_call> has come, as vLLM streams it. Content is the text before the first <tool_call>. A call
    still open when the reply ends, or one without a name, is not a call: its text is added to the content
    (vLLM drops it when other calls came before it, and makes the whole reply content when none did). Text
    between and after calls is not content (as vLLM, and as hermes here)."""

    name = "glm45"
    START, END = "<tool_call>", "</tool_call>"
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _call(self, body: str) -> ParsedCall | None:
        name_end, _ = _find_any(body, ("\n", "<arg_key>"))
        name = (body if name_end < 0 else body[:name_end]).strip()
        if not name or "<" in name:
            return None
        props = _schema_properties(self.tools, name)
        values = {}
        for key, value in self.PAIR.findall(body):
            values[key.strip()] = value.strip()  # (a key given twice keeps its last value, as vLLM's dict)
        pairs = []
        for key, value in values.items():
            typed = _json_or_none(_glm_value(value, key, props))
            pairs.append((key, typed if typed is not None else json.dumps(value, ensure_ascii=False)))
        return ParsedCall(name, _object_text(pairs, True), True)


class DeepSeekV3ToolParser(_WholeCallsParser):
    """DeepSeek-V3 / R1: <｜tool▁calls▁begin｜> then per call <｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME\n```json\nARGS
    \n```<｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>. The markers are special tokens (kept in the text of requests
    with this parser). The arguments are the model's JSON text as written (as vLLM's deepseek_v3 passes them).

    As glm45 here: a call is returned once its end marker has come; content is the text before the calls marker
    (or before the first call when the model left the marker out); a call still open when the reply ends, or one
    not in the format, is added to the content; text between and after calls is not content. A reply with the
    calls marker and no call is content, less the marker."""

    name = "deepseek_v3"
    needs_special_tokens = True
    CALLS = "<｜tool▁calls▁begin｜>"
    START, END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _BODY = re.compile(r"([^\n]+?)\s*\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL)

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        if not final:
            text = text[:len(text) - _held_back(text, self.CALLS)]  # (a calls marker still being written)
        head, first = text.find(self.CALLS), text.find(self.START)
        if head >= 0 and (first < 0 or head < first):
            text = text[:head] + text[head + len(self.CALLS):]
        return super().parse(text, final)

    def _call(self, body: str) -> ParsedCall | None:
        sep = body.find(self.SEP)
        m = self._BODY.match(body, sep + len(self.SEP)) if sep > 0 else None
        if m is None or not m.group(1).strip() or "<" in m.group(1):
            return None
        return ParsedCall(m.group(1).strip(), m.group(2).strip(), True)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek-V3.1 and later: per call <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜> (the name
    before the separator, the JSON arguments after it, no code fence); otherwise as deepseek_v3."""

    name = "deepseek_v31"

    def _call(self, body: str) -> ParsedCall | None:
        sep = body.find(self.SEP)
        name = body[:sep].strip() if sep >= 0 else ""
        if not name or "<" in name or "\n" in name:
            return None
        return ParsedCall(name, body[sep + len(self.SEP):].strip(), True)


class _CallsBlockParser(_WholeCallsParser):
    """Calls (each between START and END) inside a block opened by CALLS: content is the text before the block; no
    block, no calls (a call outside one is content); a reply whose block holds no call it can read is all content.
    keeps_tail: the text after the calls that is not a call (whitespace aside) is content too."""

    CALLS = ""
    keeps_tail = False

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        if not final:
            text = text[:len(text) - _held_back(text, self.CALLS)]  # (a block marker still being written)
        head = text.find(self.CALLS)
        if head < 0:
            return (text or None), []
        rest, calls = super().parse(text[head + len(self.CALLS):], final)
        if final and not calls:
            return text, []
        content = text[:head] + (rest if self.keeps_tail and rest and rest.strip() else "")
        return (content or None), calls


class DeepSeekV32ToolParser(_CallsBlockParser):
    """DeepSeek-V3.2's DSML calls (its chat format: engine/chat_encodings.py): after the answer, two newlines and a
    <｜DSML｜function_calls> block of <｜DSML｜invoke name="NAME"> elements, each with one
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter> a parameter: a string="true" value is
    text as written, a "false" one JSON (kept as text where it is not JSON).

    As vLLM's deepseek_v32: content is the text before the block (its two newlines included); no block, no calls
    (an invoke outside a block is content); a call is returned (and streamed) once its </｜DSML｜invoke> has come; a
    reply whose block holds no call it can read is all content."""

    name = "deepseek_v32"
    needs_special_tokens = True
    keeps_tail = True
    CALLS = "<｜DSML｜function_calls>"
    START, END = "<｜DSML｜invoke", "</｜DSML｜invoke>"
    _NAME = re.compile(r'\s*name="([^"<>\n]+)"\s*>')
    _PARAM = re.compile(r'<｜DSML｜parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>',
                        re.DOTALL)

    def _call(self, body: str) -> ParsedCall | None:
        m = self._NAME.match(body)
        if m is None:
            return None
        pairs = []
        for key, string, value in self._PARAM.findall(body, m.end()):
            if string == "false":
                try:
                    pairs.append((key, json.dumps(json.loads(value), ensure_ascii=False)))
                    continue
                except ValueError:
                    pass
            pairs.append((key, json.dumps(value, ensure_ascii=False)))
        return ParsedCall(m.group(1), _object_text(pairs, True), True)


class KimiK2ToolParser(_CallsBlockParser):
    """Kimi K2: <|tool_calls_section_begin|> then per call <|tool_call_begin|>functions.NAME:INDEX
    <|tool_call_argument_begin|>ARGS<|tool_call_end|>, then <|tool_calls_section_end|> (special tokens; vLLM also
    reads the section markers written singular, <|tool_call_section_begin|>). The call's id is what the model wrote
    before the arguments (functions.NAME:INDEX), returned as the tool call's id, as vLLM's kimi_k2 does: Kimi's chat
    template writes a call's id back into the history, and the model's next turn refers to its calls by it. The
    arguments are the model's JSON text as written.

    As deepseek_v32 here: content is the text before the section; no section, no calls; a call is returned (and
    streamed) once its <|tool_call_end|> has come; a section holding no call it can read is all content."""

    name = "kimi_k2"
    needs_special_tokens = True
    CALLS, SINGULAR = "<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"
    START, END = "<|tool_call_begin|>", "<|tool_call_end|>"
    _BODY = re.compile(r"\s*([^<\n]+:\d+)\s*<\|tool_call_argument_begin\|>(.*)$", re.DOTALL)

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        if not final:
            text = text[:len(text) - _held_back(text, self.SINGULAR)]  # (a singular marker still being written)
        return super().parse(text.replace(self.SINGULAR, self.CALLS), final)

    def _call(self, body: str) -> ParsedCall | None:
        m = self._BODY.match(body)
        if m is None:
            return None
        call_id = m.group(1).strip()
        name = call_id.rsplit(":", 1)[0].split(".")[-1]  # (functions.get_weather:0 -> get_weather)
        return ParsedCall(name, m.group(2).strip(), True, id=call_id) if name else None


def _minimax_value(raw: str, key: str, props: dict):
    """A MiniMax-M2 parameter's text typed by the tool's schema (MiniMax's published rules): "null" is null; text for
    a parameter the schema does not declare or types as a string; integers and numbers read as such (a whole
    number as an integer), booleans true for "true" or "1"; anything else read as JSON. Text that does not read as
    its type stays text."""
    if raw.lower() == "null":
        return None
    spec = props.get(key)
    kind = spec.get("type", "string") if isinstance(spec, dict) else "string"
    if isinstance(kind, list):  # (["integer", "null"]: the type besides null)
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).lower()
    if kind in ("string", "str", "text"):
        return raw
    if kind in ("integer", "int"):
        return _int_or_text(raw)
    if kind in ("number", "float"):
        return _number_or_text(raw)
    if kind in ("boolean", "bool"):
        return raw.lower() in ("true", "1")
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _unquoted(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'" else text


class MiniMaxM2ToolParser(_CallsBlockParser):
    """MiniMax-M2: a <minimax:tool_call> block of <invoke name="NAME"> elements, each with
    <parameter name="KEY">VALUE</parameter> a parameter; names may be quoted or bare; a value is stripped of
    surrounding whitespace and typed by the request's schema (_minimax_value).

    As deepseek_v32 here: content is the text before the first block; no block, no calls; a call is returned (and
    streamed) once its </invoke> has come; a reply whose block holds no call it can read is all content; text
    between and after calls (block ends, other blocks' markers) is not content."""

    name = "minimax_m2"
    CALLS = "<minimax:tool_call>"
    START, END = "<invoke", "</invoke>"
    _NAME = re.compile(r"\s+name=([^<>\n]+)>")
    _PARAM = re.compile(r"<parameter\s+name=([^<>\n]+)>(.*?)</parameter>", re.DOTALL)

    def _call(self, body: str) -> ParsedCall | None:
        m = self._NAME.match(body)
        name = _unquoted(m.group(1)) if m is not None else ""
        if not name:
            return None
        props = _schema_properties(self.tools, name)
        pairs = []
        for key, value in self._PARAM.findall(body, m.end()):
            key = _unquoted(key)
            typed = _json_or_none(_minimax_value(value.strip(), key, props))
            pairs.append((key, typed if typed is not None else json.dumps(value.strip(), ensure_ascii=False)))
        return ParsedCall(name, _object_text(pairs, True), True)


class _Gemma4Syntax(ValueError):
    """A Gemma 4 call body that is not the format."""


class Gemma4ToolParser(_WholeCallsParser):
    """Gemma 4: <|tool_call>call:NAME{key:VALUE,...}<tool_call|>, any number of them. A value is a string between
    <|"|> quote tokens (its text as written, no escapes), a number, true / false / null, an object {k:v,...} or an
    array [v,...]; keys are bare. Strings written bare (no quote tokens) stay text.

    As glm45 here (and vLLM's gemma4 parser for complete calls): a call is returned once its <tool_call|> has come;
    content is the text before the first <|tool_call>; a call still open when the reply ends, or one not in the
    format, is added to the content; text between and after calls (the <|tool_response> marker) is not content."""

    name = "gemma4"
    needs_special_tokens = True
    START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'

    def _call(self, body: str) -> ParsedCall | None:
        body = body.strip()
        if not body.startswith("call:") or not body.endswith("}"):
            return None
        brace = body.find("{")
        name = body[len("call:"): brace].strip() if brace >= 0 else ""
        if not name or any(c in name for c in "{}[]:,<> \n"):
            return None
        try:
            value, at = self._value(body, brace)
        except _Gemma4Syntax:
            return None
        if at != len(body) or not isinstance(value, dict):
            return None
        return ParsedCall(name, json.dumps(value, ensure_ascii=False), True)

    def _value(self, text: str, at: int):
        """The value at text[at:] (leading spaces skipped) -> (value, index after it)."""
        while at < len(text) and text[at].isspace():
            at += 1
        if text.startswith(self.QUOTE, at):
            close = text.find(self.QUOTE, at + len(self.QUOTE))
            if close < 0:
                raise _Gemma4Syntax("an unclosed string")
            return text[at + len(self.QUOTE): close], close + len(self.QUOTE)
        if text.startswith("{", at):
            out, at = {}, at + 1
            while True:
                while at < len(text) and text[at].isspace():
                    at += 1
                if text.startswith("}", at):
                    return out, at + 1
                colon = text.find(":", at)
                key = text[at: colon].strip() if colon >= 0 else ""
                if not key or any(c in key for c in "{}[],"):
                    raise _Gemma4Syntax("a key")
                if key.startswith(self.QUOTE) and key.endswith(self.QUOTE) and len(key) >= 2 * len(self.QUOTE):
                    key = key[len(self.QUOTE): -len(self.QUOTE)]
                out[key], at = self._value(text, colon + 1)
                at = self._after_item(text, at, "}")
                if text.startswith("}", at):
                    return out, at + 1
                at += 1  # (the comma)
        if text.startswith("[", at):
            items, at = [], at + 1
            while True:
                while at < len(text) and text[at].isspace():
                    at += 1
                if text.startswith("]", at):
                    return items, at + 1
                item, at = self._value(text, at)
                items.append(item)
                at = self._after_item(text, at, "]")
                if text.startswith("]", at):
                    return items, at + 1
                at += 1
        stop = at
        while stop < len(text) and text[stop] not in ",}]":
            stop += 1
        raw = text[at: stop].strip()
        if not raw:
            raise _Gemma4Syntax("an empty value")
        return self._bare(raw), stop

    def _after_item(self, text: str, at: int, close: str) -> int:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text) or text[at] not in "," + close:
            raise _Gemma4Syntax(f"',' or {close!r} expected")
        return at

    @staticmethod
    def _bare(raw: str):
        """A bare value: true / false / null, a JSON number, else its text."""
        if raw in ("true", "false", "null"):
            return json.loads(raw)
        try:
            number = json.loads(raw)
        except ValueError:
            return raw
        return number if isinstance(number, (int, float)) and math.isfinite(number) else raw


class MistralToolParser(ToolParser):
    """Mistral: [TOOL_CALLS] then either a JSON list of {"name", "arguments"} (tokenizers before v11:
    Mistral-7B-Instruct-v0.3, Mixtral, Nemo) or, per call, NAME[ARGS]{...} with an optional [CALL_ID]ID before
    [ARGS] (v11 and later: Mistral-Small-3.1+, Devstral, Magistral; also NAME{...} without the [ARGS] token, as
    vLLM sees it through mistral_common). [TOOL_CALLS] is a special token: the server keeps special tokens in
    the text of requests with tools.

    Content is the text before the first [TOOL_CALLS]. Arguments are the model's JSON text as written;
    arguments that are not valid JSON still make a call (as vLLM does for v11+: the model sees it tried).
    When what follows [TOOL_CALLS] is neither form, the reply, less the marker, is content (as vLLM)."""

    name = "mistral"
    needs_special_tokens = True
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        first = text.find(self.TAG)
        if first < 0:
            return _before_marker(text, self.TAG, final), []
        content = text[:first] or None
        after = first + len(self.TAG)
        not_calls = (text[:first] + text[after:]) or None  # (what the reply is if no calls follow the marker)
        body_start = len(text) - len(text[after:].lstrip())
        if body_start >= len(text):
            return (not_calls if final else content), []
        if text[body_start] in "[{":  # before v11: a JSON list of call objects
            calls = _call_list(text, body_start + (text[body_start] == "["), ",")
            if calls:
                return content, calls
            return (not_calls if final or self._not_call_objects(text, body_start) else content), []
        calls = self._named_calls(text, after, final)
        if calls is None:
            return not_calls, []
        return content, calls

    @staticmethod
    def _not_call_objects(text: str, pos: int) -> bool:
        """The list after [TOOL_CALLS] already cannot hold call objects (its first item is not an object)."""
        rest = text[pos + 1:].lstrip()
        return text[pos] == "[" and bool(rest) and rest[0] != "{"

    def _named_calls(self, text: str, pos: int, final: bool) -> list[ParsedCall] | None:
        """v11+ calls, NAME[CALL_ID]ID[ARGS]{...}, from pos (just after a [TOOL_CALLS]). None: the first one is
        not such a call. A call is returned from the moment its name has ended."""
        calls: list[ParsedCall] = []
        while True:
            marker, tag = _find_any(text, (self.ARGS, self.CALL_ID, "{"), pos)
            if marker < 0:  # a name still being written, or not a call
                name = text[pos:].strip()
                if not final:
                    name = name[: len(name) - _held_back_any(name, (self.ARGS, self.CALL_ID))]
                    if not name or self._NAME.fullmatch(name):
                        return calls
                return calls or None
            name = text[pos:marker].strip()
            if not self._NAME.fullmatch(name):
                return calls or None
            if tag == self.CALL_ID:
                marker = text.find(self.ARGS, marker)
                if marker < 0:
                    return [*calls, ParsedCall(name, "", False)]
                tag = self.ARGS
            args_start = marker + len(tag) if tag == self.ARGS else marker
            while args_start < len(text) and text[args_start].isspace():
                args_start += 1
            try:
                _, end = _DECODER.raw_decode(text, args_start)
            except ValueError:  # arguments still being written, or not JSON
                partial = text[args_start:]
                nxt = partial.find(self.TAG)
                if nxt >= 0:
                    calls.append(ParsedCall(name, partial[:nxt], False))
                    pos = args_start + nxt + len(self.TAG)
                    continue
                if not final:
                    partial = partial[: len(partial) - _held_back(partial, self.TAG)]
                return [*calls, ParsedCall(name, partial, False)]
            calls.append(ParsedCall(name, text[args_start:end], True))
            nxt = text.find(self.TAG, end)
            if nxt < 0:
                return calls
            pos = nxt + len(self.TAG)


class PythonicToolParser(ToolParser):
    """Pythonic (Llama 3.2 / 4, Gemma 3, ToolACE): the reply is a Python list of calls with keyword arguments,
    [get_weather(city="Paris", days=2), get_time()], read with Python's ast (values must be literals: strings,
    numbers, True/False/None, lists, tuples and dicts of them; nothing is evaluated). Llama 4's
    <|python_start|> ... <|python_end|> around it are removed (llama4_pythonic).

    A reply that does not start with "[" is content. One that does is held back until its list closes (or the
    reply ends): then either every item is a call and they are the tool calls, or the whole reply is content
    (as vLLM). Positional arguments make it content too (vLLM drops them). Text after a closed list of calls is
    content (vLLM makes the whole reply content)."""

    name = "pythonic"
    PY_START, PY_END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(self.PY_START):
            body = body[len(self.PY_START):]
            lead += len(self.PY_START)
        elif not final and self.PY_START.startswith(body):
            return None, []  # (too early to tell)
        if not body.lstrip().startswith("["):
            return (text if final or body.strip() else None), []
        end = _list_end(body)
        if end is None:
            return (text if final else None), []
        calls = _pythonic_calls(body[:end])
        if calls is None:
            return (text if final or end else None), []
        tail = body[end:].replace(self.PY_END, "")
        if not final:
            tail = tail[: len(tail) - _held_back(tail, self.PY_END)]
        return (tail if tail.strip() else None), calls


def _list_end(text: str) -> int | None:
    """Index after the bracket that closes the list text starts with (strings and nesting skipped)."""
    depth, quote, i = 0, "", 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote) - 1
        elif c in "[({":
            depth += 1
        elif c in "])}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class _JsonNames(ast.NodeTransformer):
    """null / true / false written as bare names (JSON's literals, which Olmo 3 writes in its calls) -> constants."""

    VALUES = {"null": None, "true": True, "false": False}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.VALUES[node.id]) if node.id in self.VALUES else node


def _pythonic_calls(text: str, json_names: bool = False) -> list[ParsedCall] | None:
    """[f(a=1), g()] -> calls, or None if it is not a list of calls with literal keyword arguments (json_names: null,
    true and false read as JSON's literals too)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if json_names and isinstance(tree, ast.List):
            for item in tree.elts:
                if isinstance(item, ast.Call):
                    item.keywords = [_JsonNames().visit(k) for k in item.keywords]
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for item in tree.elts:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            return None
        arguments = {}
        for keyword in item.keywords:
            if keyword.arg is None:
                return None
            try:
                value = ast.literal_eval(keyword.value)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return None
            arguments[keyword.arg] = value
        encoded = _json_or_none(arguments)
        if encoded is None:  # (a set, bytes or a complex number: not JSON)
            return None
        calls.append(ParsedCall(item.func.id, encoded, True))
    return calls


class HarmonyToolParser(ToolParser):
    """gpt-oss's harmony format (o200k_harmony), read from the detokenized text with its special tokens kept:
    each message is [<|start|>ROLE[ to=RECIPIENT]]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]
    <|message|>BODY, ended by <|end|>, <|call|> or <|return|> (the last two stop generation, so they are not
    in the text; the reply's end ends its last message). The reply's first message has no <|start|>ROLE: the
    prompt ends with "<|start|>assistant".

    The analysis channel is reasoning_content; final, and commentary without a recipient (a preamble shown to
    the user), are content; a message to functions.NAME (commentary, or analysis) is a tool call whose
    arguments are its body as written. Several messages of one kind are joined with a newline. With tool
    calls off (tool_choice "none", no tools) a message to a function is read by its channel like any other,
    as vLLM streams it. Text outside any message is content; a header cut off by the reply's end is dropped
    (it is markup, not text). Text-level parsing: a literal "<|channel|>" typed as ordinary characters would
    read as a marker (vLLM parses token ids)."""

    name = "openai"
    needs_special_tokens = True
    START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    HEADS = (START, CHANNEL)
    BODY_ENDS = (*ENDS, START)
    ALL = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)

    def __init__(self, tools: dict[str, dict] | None = None, calls: bool = True):
        super().__init__(tools)
        self.calls = calls

    def parse(self, text: str, final: bool) -> tuple[str | None, list[ParsedCall]]:
        parsed = self.parse_all(text, final)
        return parsed.content, parsed.calls

    def parse_all(self, text: str, final: bool) -> Parsed:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ParsedCall] = []
        first, _ = _find_any(text, self.HEADS)
        lead = text if first < 0 else text[:first]
        stripped = lead.strip()
        if first < 0:
            if not final and (stripped.startswith("to=") or "to=".startswith(stripped)):
                return Parsed()  # (too early to tell)
            keep = len(lead) if final else len(lead) - _held_back_any(lead, self.ALL)
            return Parsed(lead[:keep] or None)
        role_part = ""
        if stripped.startswith("to="):
            role_part = lead  # (the first message's recipient, written in its role section)
        elif stripped:
            content.append(lead)
        pos = first
        while True:
            header_start = pos + len(self.START) if text.startswith(self.START, pos) else pos
            msg = text.find(self.MESSAGE, header_start)
            bad, bad_tag = _find_any(text, self.BODY_ENDS, header_start)
            if bad >= 0 and (msg < 0 or bad < msg):
                after = bad if bad_tag == self.START else bad + len(bad_tag)  # a broken header: markup, dropped
            elif msg < 0:
                break  # (a header still being written, or cut off by the reply's end: markup, dropped)
            else:
                channel, recipient = self._header(role_part + " " + text[header_start:msg])
                body_start = msg + len(self.MESSAGE)
                end, tag = _find_any(text, self.BODY_ENDS, body_start)
                if end < 0:
                    body = text[body_start:]
                    if not final:
                        body = body[: len(body) - _held_back_any(body, self.ALL)]
                else:
                    body = text[body_start:end]
                if self.calls and recipient.startswith("functions.") and channel in ("commentary", "analysis"):
                    calls.append(ParsedCall(recipient[len("functions."):], body, end >= 0 or final))
                elif channel == "analysis":
                    reasoning.append(body)
                else:
                    content.append(body)
                if end < 0:
                    break
                after = end if tag == self.START else end + len(tag)
            role_part = ""
            nxt, _ = _find_any(text, self.HEADS, after)
            gap = text[after: len(text) if nxt < 0 else nxt]
            if nxt < 0:
                if not final:
                    gap = gap[: len(gap) - _held_back_any(gap, self.ALL)]
                if gap.strip():
                    content.append(gap)
                break
            if gap.strip():
                if text.startswith(self.CHANNEL, nxt):
                    role_part = gap  # (a header without its <|start|>)
                else:
                    content.append(gap)
            pos = nxt
        return Parsed("\n".join(content) or None, "\n".join(reasoning) or None, calls)

    def _header(self, header: str) -> tuple[str, str]:
        """(channel, recipient) of a message header's text (role section, then <|channel|> section)."""
        role, _, channel_part = header.partition(self.CHANNEL)
        recipient = ""
        for word in (role + " " + channel_part).replace(self.CONSTRAIN, " ").split():
            if word.startswith("to="):
                recipient = word[3:]
        words = channel_part.replace(self.CONSTRAIN, " ").split()
        return (words[0] if words else ""), recipient


# Named as vLLM names them (and Atlas's earlier aliases qwen, llama).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "llama": Llama3JsonToolParser, "llama4_json": Llama3JsonToolParser, "phi4_mini_json": Phi4MiniJsonToolParser,
    "granite": GraniteToolParser, "qwen3_coder": Qwen3CoderToolParser, "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser, "longcat": LongcatToolParser, "seed_oss": SeedOssToolParser,
    "mistral": MistralToolParser, "pythonic": PythonicToolParser, "llama4_pythonic": PythonicToolParser,
    "openai": HarmonyToolParser, "gemma4": Gemma4ToolParser, "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser, "deepseek_v32": DeepSeekV32ToolParser, "minimax_m2": MiniMaxM2ToolParser,
    "qwen3_xml": Qwen3CoderToolParser, "jamba": JambaToolParser, "nemotron_json": NemotronJsonToolParser,
    "lfm2": Lfm2ToolParser, "olmo3": Olmo3ToolParser, "ernie45": Ernie45ToolParser,
    "apertus": ApertusToolParser, "hunyuan_a13b": HunyuanA13BToolParser, "kimi_k2": KimiK2ToolParser,
}


# ---------------------------------------------------------------------------------- reasoning
class ReasoningParser:
    """<think>...</think> at the start of a reply is reasoning; the rest is the answer.

    qwen3 (and glm45, GLM-4.5's, read the same way): without a <think> the reply is all answer (thinking
    switched off by the template or the model); deepseek_r1: the template opens <think> in the prompt, so
    everything up to </think> is reasoning, with or without an opening tag; gemma4: Gemma 4's thought channel,
    <|channel>thought\n...<channel|> (special tokens, so the server keeps special tokens in the text; the
    channel's "thought" label is not reasoning), read as qwen3; minimax_m2: deepseek_r1's reading (MiniMax-M2's
    template opens <think> in the prompt); minimax_m2_append_think: no reasoning, the reply is all answer with the
    <think> the template opened put back in front of it (as vLLM's, for clients that send the thinking back in the
    next turn's history, as MiniMax advises). hunyuan_a13b: Hunyuan-A13B's `<think>\n...\n</think>\n<answer>\n...
    \n</answer>`: the reasoning inside the think tags, the answer inside the answer tags (a reply without the think
    tags is all answer, its answer tags dropped too). kimi_k2: Kimi K2's, deepseek_r1's reading where the request's
    `thinking` template variable is true or not given (Kimi K2 Thinking's default) and no reasoning where it is
    false; either way the "(no content)" placeholder the model writes before tool calls is dropped from the answer,
    as vLLM's kimi_k2 does. (openai_gptoss, gpt-oss's, is the harmony format's analysis channel: HarmonyToolParser
    reads it.)"""

    # name -> (start marker, end marker, the label the start marker is followed by)
    _FORMATS = {"gemma4": ("<|channel>", "<channel|>", "thought\n"), "seed_oss": ("<seed:think>", "</seed:think>", ""),
                "hunyuan_a13b": ("<think>\n", "\n</think>", "")}
    _ANSWER = ("<answer>", "</answer>")

    def __init__(self, name: str):
        self.name = name
        self.implicit_start = name in ("deepseek_r1", "minimax_m2", "kimi_k2")
        self.answer_only = name == KIMI_K2_NO_THINKING  # (no reasoning; the answer cleaned as kimi_k2's)
        self.prepend = "<think>" if name == "minimax_m2_append_think" else None
        self.START, self.END, self.label = self._FORMATS.get(name, ("<think>", "</think>", ""))

    @classmethod
    def needs_special_tokens_for(cls, name: str) -> bool:
        """Whether the `name` format's markers are special tokens (the server then keeps them in the text)."""
        return name in cls._FORMATS

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        reasoning, answer = self._split(text, final)
        if self.name == "hunyuan_a13b":  # (thinking off writes empty think tags: no reasoning)
            return reasoning or None, self._unwrap_answer(answer, final)
        if self.name in ("kimi_k2", KIMI_K2_NO_THINKING):
            return reasoning, self._drop_placeholder(answer, final)
        return reasoning, answer

    @staticmethod
    def _drop_placeholder(text: str, final: bool) -> str:
        """Kimi K2's answer without its "(no content)" placeholders; while the reply streams, a suffix that may
        still become one held back (so what has been sent is never taken back)."""
        text = text.replace(_KIMI_PLACEHOLDER, "")
        return text if final else text[:len(text) - _held_back(text, _KIMI_PLACEHOLDER)]

    def _unwrap_answer(self, text: str, final: bool) -> str:
        """The answer between Hunyuan-A13B's <answer> tags (the newlines inside them dropped); while the reply
        streams, a suffix that may still become the closing tag (or the newlines before it) held back."""
        start, end = self._ANSWER
        body = text.lstrip("\n")
        if body.startswith(start):
            body = body[len(start):].lstrip("\n")
        elif not final and start.startswith(body):
            return ""  # (may still become the tag)
        close = body.find(end)
        if close >= 0:
            return body[:close].rstrip("\n")
        if final:
            return body
        return body[:len(body) - _held_back(body, end)].rstrip("\n")

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.prepend is not None:
            return None, self.prepend + text
        if self.answer_only:
            return None, text
        body = text
        stripped = body.lstrip()
        opened = stripped.startswith(self.START)
        if not opened and not final and self.START.startswith(stripped):
            # May still become "<think>" (deepseek_r1 too: a model that writes the opening tag itself, which
            # would otherwise be streamed as reasoning before it is known to be the tag).
            return ("" if self.implicit_start else None), ""
        if opened:
            body = stripped[len(self.START):]
            if self.label and body.startswith(self.label):
                body = body[len(self.label):]
            elif self.label and not final and self.label.startswith(body):
                return "", ""  # (may still become the label)
        elif not self.implicit_start:
            return None, text
        end = body.find(self.END)
        if end < 0:
            keep = len(body) if final else len(body) - _held_back(body, self.END)
            return body[:keep], ""
        return body[:end], body[end + len(self.END):].lstrip("\n")


REASONING_PARSERS = ("qwen3", "deepseek_r1", "deepseek_v3", "glm45", "gemma4", "seed_oss", "openai_gptoss",
                     "minimax_m2", "minimax_m2_append_think", "hunyuan_a13b", "kimi_k2")
# kimi_k2 for a request whose `thinking` is false (not a --reasoning-parser name)
KIMI_K2_NO_THINKING = "kimi_k2 (thinking off)"
_KIMI_PLACEHOLDER = "(no content)"


def reasoning_for_request(name: str | None, template_kwargs: dict) -> str | None:
    """The reasoning format one request's reply is read with: deepseek_v3 (vLLM's, for DeepSeek-V3.1 / V3.2, whose
    thinking a template variable switches on) is deepseek_r1's when the request's `thinking` or `enable_thinking`
    is true, else none (the reply is all answer); kimi_k2 with `thinking` false reads no reasoning; any other
    parser as named."""
    if name == "deepseek_v3":
        return "deepseek_r1" if template_kwargs.get("thinking") or template_kwargs.get("enable_thinking") else None
    if name == "kimi_k2" and not template_kwargs.get("thinking", True):
        return KIMI_K2_NO_THINKING
    return name
HARMONY_REASONING = "openai_gptoss"


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
        if isinstance(self.tools, HarmonyToolParser):  # (reasoning, answer and calls in one format)
            parsed = self.tools.parse_all(text, final)
            parsed.calls = parsed.calls[: self.max_calls]
            return parsed
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
                self.sent_calls.append((call.id or new_call_id(), 0))
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

    def call_ids(self, calls: list[ParsedCall]) -> list[str]:
        """Ids for the calls of a whole (non-streamed) reply: the model's own where its format writes one."""
        while len(self.sent_calls) < len(calls):
            self.sent_calls.append((calls[len(self.sent_calls)].id or new_call_id(), 0))
        return [cid for cid, _ in self.sent_calls[:len(calls)]]
