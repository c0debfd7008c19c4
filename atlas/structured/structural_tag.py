"""vLLM's structural tags, checked and normalised for xgrammar (the one grammar engine that compiles them).

Two forms are accepted, as vLLM accepts them (in `response_format` with type "structural_tag", or as
`structured_outputs.structural_tag`, an object or its JSON text):
- the first one: `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`: free text, and
  wherever the text reaches a trigger, one of the structures whose begin starts with it: begin, a JSON value
  valid against its schema, end; then free text again;
- xgrammar's: `{"type": "structural_tag", "format": {...}}` with the formats listed in FORMATS.

Exactly or refused: each JSON schema must lie in the subset xgrammar was checked to enforce
(json_schema.xgrammar_unsupported), and a format whose enforcement Atlas has not checked (token formats,
dispatch, XML argument styles, budgets) is refused naming it and where it is. xgrammar compiles the schemas of
structural tags in its strict mode, where an object's undeclared properties are forbidden; JSON Schema allows
them, so every object schema without `additionalProperties` gets `"additionalProperties": true`, which is what
it means anyway (and what the JSON path, in xgrammar's non-strict mode, enforces). Whitespace inside the JSON is
bounded (JSON_MAX_WHITESPACE in a row) unless the format gives `max_whitespace_cnt`. The xgrammar backend compiles
each schema as a grammar format holding the schema's grammar with Atlas's exact strings and string length bounds,
as on the JSON path (XGrammarBackend.exact_structural_tag), not with xgrammar's own string rule.
"""

from __future__ import annotations

import json
from typing import Any

from atlas.structured.json_schema import GrammarCompileError, map_keywords, parse_schema, xgrammar_unsupported

PARAM = "structural_tag"
# At most this many whitespace characters in a row inside a tag's JSON (unless the format form says otherwise):
# every document stays valid, and a weak model given free whitespace spends its budget on blanks (as on the JSON
# path, which allows one layout).
JSON_MAX_WHITESPACE = 1

# type -> (fields that hold formats, fields that hold lists of formats, other fields allowed)
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...], frozenset[str]]] = {
    "const_string": ((), (), frozenset({"value"})),
    "json_schema": ((), (), frozenset({"json_schema", "style", "max_whitespace_cnt"})),
    "any_text": ((), (), frozenset({"excludes"})),
    "regex": ((), (), frozenset({"pattern"})),
    "grammar": ((), (), frozenset({"grammar", "syntax"})),
    "sequence": ((), ("elements",), frozenset()),
    "or": ((), ("elements",), frozenset()),
    "optional": (("content",), (), frozenset()),
    "plus": (("content",), (), frozenset()),
    "star": (("content",), (), frozenset()),
    "tag": (("content",), (), frozenset({"begin", "end"})),
    "triggered_tags": ((), ("tags",), frozenset({"triggers", "at_least_one", "stop_after_first", "excludes"})),
    "tags_with_separator": ((), ("tags",), frozenset({"separator", "at_least_one", "stop_after_first"})),
}


def _fail(why: str) -> GrammarCompileError:
    return GrammarCompileError(f"the structural tag cannot be enforced: {why}", param=PARAM)


def _open_objects(schema: dict) -> dict:
    """The schema with `"additionalProperties": true` written wherever an object schema leaves it out."""

    def visit(key, value, parent, where):
        return None

    out = map_keywords(schema, visit)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in ("const", "enum", "default", "examples"):
                    continue
                if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                    for sub in value.values():
                        walk(sub)
                else:
                    walk(value)
            if ("properties" in node or "required" in node or node.get("type") == "object") \
                    and "additionalProperties" not in node:
                node["additionalProperties"] = True

    walk(out)
    return out


def _schema(schema: Any, where: str) -> dict:
    parsed = parse_schema(schema, param=PARAM)
    why = xgrammar_unsupported(parsed)
    if why:
        raise _fail(f"the JSON schema at {where} has {why}, outside what the xgrammar engine enforces exactly")
    return _open_objects(parsed)


def _string(value: Any, where: str, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty):
        raise _fail(f"{where} must be a {'' if empty else 'non-empty '}string")
    return value


def _format(node: Any, where: str) -> dict:
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise _fail(f"{where} must be a format object with a type")
    kind = node["type"]
    if kind not in FORMATS:
        raise _fail(f"format type {kind!r} at {where} is not supported (supported: {', '.join(FORMATS)})")
    one, many, plain = FORMATS[kind]
    unknown = sorted(set(node) - {"type", *one, *many, *plain})
    if unknown:
        raise _fail(f"field(s) {', '.join(unknown)} of the {kind} format at {where} are not supported")
    out = dict(node)
    for name in one:
        if name not in node:
            raise _fail(f"the {kind} format at {where} needs {name}")
        out[name] = _format(node[name], f"{where}.{name}")
    for name in many:
        items = node.get(name)
        if not isinstance(items, list) or not items:
            raise _fail(f"{where}.{name} must be a non-empty list")
        out[name] = [_format(item, f"{where}.{name}[{i}]") for i, item in enumerate(items)]
        if name == "tags" and any(t["type"] != "tag" for t in out[name]):
            raise _fail(f"{where}.tags must hold tag formats")
    if kind == "json_schema":
        if node.get("style", "json") != "json":
            raise _fail(f"style {node['style']!r} at {where} is not supported (only json)")
        if "json_schema" not in node:
            raise _fail(f"the json_schema format at {where} needs json_schema")
        out["json_schema"] = _schema(node["json_schema"], f"{where}.json_schema")
        out.setdefault("max_whitespace_cnt", JSON_MAX_WHITESPACE)
    elif kind == "tag":
        _string(node.get("begin"), f"{where}.begin")
        ends = node.get("end")
        for i, end in enumerate(ends if isinstance(ends, list) else [ends]):
            _string(end, f"{where}.end" + (f"[{i}]" if isinstance(ends, list) else ""), empty=True)
    elif kind == "triggered_tags":
        triggers = node.get("triggers")
        if not isinstance(triggers, list) or not triggers:
            raise _fail(f"{where}.triggers must be a non-empty list of strings")
        for i, trigger in enumerate(triggers):
            _string(trigger, f"{where}.triggers[{i}]")
    return out


def normalize_structural_tag(value: Any) -> dict:
    """The structural tag (an object or its JSON text, either form) as xgrammar's form, checked and normalised:
    what the xgrammar backend compiles. GrammarCompileError (param structural_tag) names what is refused."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _fail(f"it is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise _fail("it must be an object")
    if "format" in value:
        unknown = sorted(set(value) - {"type", "format"})
        if value.get("type", "structural_tag") != "structural_tag" or unknown:
            raise _fail("the format form is {\"type\": \"structural_tag\", \"format\": {...}}"
                        + (f" (unknown field(s) {', '.join(unknown)})" if unknown else ""))
        return {"type": "structural_tag", "format": _format(value["format"], "format")}
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown or "structures" not in value or value.get("type", "structural_tag") != "structural_tag":
        raise _fail("give either {\"structures\": [{\"begin\", \"schema\", \"end\"}], \"triggers\": [...]} or "
                    "{\"type\": \"structural_tag\", \"format\": {...}}"
                    + (f" (unknown field(s) {', '.join(unknown)})" if unknown else ""))
    structures, triggers = value["structures"], value.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise _fail("structures must be a non-empty list")
    if not isinstance(triggers, list) or not triggers:
        raise _fail("triggers must be a non-empty list of strings")
    for i, trigger in enumerate(triggers):
        _string(trigger, f"triggers[{i}]")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"} or "begin" not in s or "end" not in s:
            raise _fail(f"structures[{i}] must be {{\"begin\", \"schema\", \"end\"}}")
        begin = _string(s["begin"], f"structures[{i}].begin")
        if not any(begin.startswith(t) for t in triggers):
            raise _fail(f"structures[{i}].begin {begin!r} starts with none of the triggers, so it could never be "
                        "generated")
        tags.append({"type": "tag", "begin": begin,
                     "content": {"type": "json_schema", "max_whitespace_cnt": JSON_MAX_WHITESPACE,
                                 "json_schema": _schema(s.get("schema", {}), f"structures[{i}].schema")},
                     "end": _string(s["end"], f"structures[{i}].end", empty=True)})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
