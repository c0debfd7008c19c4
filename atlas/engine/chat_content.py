"""How a message's content reaches the chat template (vLLM's --chat-template-content-format).

OpenAI messages carry their content as a string or as a list of parts ({"type": "text", "text": ...}). Templates
read it one of two ways: most write `message['content']` as a string; some (Gemma 3, Llama 4, vision models)
loop over its parts. `string` gives every template a string (a list's text parts joined by newlines, as vLLM
joins them); `openai` gives every template the list of parts (a string as one text part); `auto` picks per
template: `openai` where the template loops over a message's content or indexes into it, else `string`.
"""

from __future__ import annotations

import functools
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")


def content_format(setting: str, template: str | None) -> str:
    """'string' or 'openai' for rendering through `template` (the source text) under `setting`."""
    if setting not in CONTENT_FORMATS:
        raise ValueError(f"chat template content format must be one of {', '.join(CONTENT_FORMATS)}, got {setting!r}")
    if setting != "auto":
        return setting
    return _detected(template) if template else "string"


@functools.lru_cache(maxsize=64)
def _detected(template: str) -> str:
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"  # (rendering reports the error)
    # names bound to a message's content: {% set content = message['content'] %}
    aliases = {n.target.name for n in tree.find_all(nodes.Assign)
               if isinstance(n.target, nodes.Name) and _is_content(n.node, set())}

    def reads_parts(node) -> bool:
        return _is_content(node, aliases)

    for loop in tree.find_all(nodes.For):
        if reads_parts(loop.iter):
            return "openai"
    for item in tree.find_all(nodes.Getitem):
        if reads_parts(item.node) and isinstance(item.arg, nodes.Const) and isinstance(item.arg.value, int):
            return "openai"
    return "string"


def _is_content(node, aliases: set[str]) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Filter) and node.node is not None:  # message['content'] | list, ...
        return _is_content(node.node, aliases)
    return isinstance(node, nodes.Name) and node.name in aliases


def check_content(content: Any) -> None:
    """A message's content as Atlas takes it (None, a string, or a list of text parts), or a ValueError saying what
    it is not (the request models' check, and LLM.chat's)."""
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
        return
    raise ValueError("must be a string or a list of content parts")


def content_for_template(content: str | list[dict[str, Any]] | None, fmt: str) -> str | list[dict[str, Any]]:
    """A message's content as a template of format `fmt` reads it (text parts only: the request models refuse
    others)."""
    if content is None:
        return "" if fmt == "string" else []
    if fmt == "string":
        return content if isinstance(content, str) else "\n".join(part["text"] for part in content)
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": part["text"]} for part in content]
