"""tool_choice over a chat's tools: which parser reads the reply's tool calls, and the output constraint that
"required" or a named function imposes (each tool's parameter schema must compile); and the finish reason
OpenAI gives a reply that called tools."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from atlas.sampling_params import StructuredOutputsParams
from atlas.server import protocol as P
from atlas.server.errors import APIError
from atlas.server.frontend import FrontEnd
from atlas.server.output_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolParser
from atlas.structured.json_schema import embed_schema

# The schema of a function declared without parameters: an object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


def required_tools_schema(tools: list[P.ToolDefinition], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one call or more (one with parallel_tool_calls false), each
    {"name": one of the tools, "parameters": valid for that tool}."""
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name},
                             # (the tool's own "#/..." references keep pointing inside its parameters)
                             "parameters": embed_schema(t.function.parameters, f"#/items/anyOf/{i}/properties/parameters",
                                                        f"tools[{i}].function.parameters")
                             if t.function.parameters is not None else _NO_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


async def tool_plan(front: FrontEnd, req: P.ChatCompletionRequest
                    ) -> tuple[Callable[[], ToolParser] | None, StructuredOutputsParams | None, str]:
    """(a maker of the reply's tool parser, the constraint tool_choice imposes, the mode: none / auto /
    required / named). Each tool's parameter schema must compile."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice in ("none", "auto"):
            return None, None, "none"
        raise APIError(400, "tool_choice: there are no tools to call (give tools)", param="tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name", param="tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            await front.compile_constraint(StructuredOutputsParams(json=tool.function.parameters),
                                           f"tools[{i}].function.parameters")
    if choice == "none":
        return None, None, "none"
    if choice == "auto":
        settings = front.settings
        if not settings.enable_auto_tool_choice:
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs the server to run with '
                                '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice '
                                '"required", "none" or a named function', param="tool_choice")
        schemas = {t.function.name: t.function.parameters or {} for t in tools}  # (formats typed by schema)
        return functools.partial(TOOL_PARSERS[settings.tool_call_parser], schemas), None, "auto"
    if choice == "required":
        spec = StructuredOutputsParams(json=required_tools_schema(tools, req.parallel_tool_calls is not False))
        await front.compile_constraint(spec, "tools")
        return RequiredToolParser, spec, "required"
    name = choice.function.name
    if name not in names:
        raise APIError(400, f"tool_choice: there is no tool named {name!r} (tools: {', '.join(names)})",
                       param="tool_choice")
    parameters = tools[names.index(name)].function.parameters
    spec = StructuredOutputsParams(json=parameters if parameters is not None else _NO_PARAMETERS)
    await front.compile_constraint(spec, "tool_choice")
    return functools.partial(NamedToolParser, name), spec, "named"


def finish_reason(reason: str | None, has_calls: bool, tool_mode: str) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call tools (auto, required) and stopped by itself; a
    named function ends with "stop"."""
    if reason == "stop" and has_calls and tool_mode in ("auto", "required"):
        return "tool_calls"
    return reason

