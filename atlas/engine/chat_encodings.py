"""Chat formats that ship as code rather than as a Jinja chat template.

DeepSeek-V3.2 (model_type deepseek_v32) publishes no chat template: its tokenizer_config.json has none, and the
format is defined by the Python encoder in the model's repository (vLLM renders it under --tokenizer-mode
deepseek_v32). `render_deepseek_v32` writes the same text: a begin-of-sentence token; system messages as their text
(the request's tools as a system block before them, with the DSML tool-call instructions and each function's JSON
schema); each user turn as <｜User｜>TEXT<｜Assistant｜> and then </think> (chat mode), or <think> after the last user
turn in thinking mode (template variable `thinking` or `enable_thinking` true); assistant turns as their text with
their tool calls as a DSML block, closed by the end-of-sentence token (in thinking mode the turns after the last user
message carry their reasoning before </think>); tool results as <function_results> of <result> items, followed by
</think> or, in thinking mode, <think>.
"""

from __future__ import annotations

import json
from typing import Any

from atlas.errors import InvalidRequestError

CHAT_ENCODINGS = ("deepseek_v32",)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"

# The tools block of the system prompt (the text the model was trained with).
_TOOLS_BLOCK = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{d}function_calls>" block like the following as part of your reply to the user:
<{d}function_calls>
<{d}invoke name="$FUNCTION_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$FUNCTION_NAME2">
...
</{d}invoke>
</{d}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{d}function_calls>
...
</{d}function_calls>

<function_results>
...
</function_results>

{think}...thinking about results{end_think}

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any) -> str:
    """A message's content as text (text parts joined by newlines; None as nothing)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))


def _tools_block(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(_json(t.get("function", t)) for t in tools)
    return _TOOLS_BLOCK.format(d=DSML, think=THINK, end_think=END_THINK, schemas=schemas)


def _dsml_calls(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's tool calls as the DSML block it writes (after two newlines)."""
    invokes = []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidRequestError(f"a tool call of {function.get('name')!r}: its arguments are not JSON, "
                                          "which the DeepSeek-V3.2 format writes parameter by parameter",
                                          param="messages") from None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(f"a tool call of {function.get('name')!r}: its arguments must be a JSON "
                                      "object", param="messages")
        params = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f'{value if isinstance(value, str) else _json(value)}</{DSML}parameter>'
            for key, value in arguments.items())
        invokes.append(f'<{DSML}invoke name="{function.get("name")}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


def render_deepseek_v32(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        thinking: bool = False) -> str:
    """The prompt text of a conversation in DeepSeek-V3.2's format (module docstring)."""
    if tools:
        messages = [{"role": "system", "content": "", "tools": tools}, *messages]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)
    out = [BOS]
    for index, message in enumerate(messages):
        role, content = message.get("role"), _text(message.get("content"))
        opens_thinking = thinking and index == last_user
        if role == "system":
            out.append(content)
            if message.get("tools"):
                out.append("\n\n" + _tools_block(message["tools"]))
        elif role in ("user", "developer"):
            if role == "developer":
                content = "\n\n# The user's message is: " + content
            out.append(USER + content + ASSISTANT + (THINK if opens_thinking else END_THINK))
        elif role == "assistant":
            reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
            head = reasoning + END_THINK if thinking and index > last_user else ""
            calls = _dsml_calls(message["tool_calls"]) if message.get("tool_calls") else ""
            out.append(head + content + calls + EOS)
        elif role == "tool":
            start = index
            while start > 0 and messages[start - 1].get("role") == "tool":
                start -= 1
            owner = messages[start - 1] if start > 0 else None
            if owner is None or owner.get("role") != "assistant" or not owner.get("tool_calls"):
                raise InvalidRequestError("a tool message must follow an assistant message with tool_calls",
                                          param="messages")
            order, calls = index - start + 1, len(owner["tool_calls"])
            if order > calls:
                raise InvalidRequestError(f"{order} tool results follow an assistant message of {calls} tool calls",
                                          param="messages")
            if order == 1:
                out.append("\n\n<function_results>")
            out.append(f"\n<result>{content}</result>")
            if order == calls:
                out.append("\n</function_results>\n\n" + (THINK if thinking and index >= last_user else END_THINK))
        else:
            raise InvalidRequestError(f"the DeepSeek-V3.2 format has no {role!r} messages", param="messages")
    return "".join(out)
