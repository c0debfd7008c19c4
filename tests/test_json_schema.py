"""The schema rewrites Atlas makes before a grammar engine sees a schema keep its meaning exactly."""

from __future__ import annotations

import pytest

from atlas.structured.json_schema import GrammarCompileError, embed_schema, parse_schema, pin_formats


def test_embedded_tool_schemas_keep_their_own_references():
    tool = {"$defs": {"u": {"enum": ["C"]}}, "properties": {
        "unit": {"$ref": "#/$defs/u"}, "self": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        "default": {"$ref": "#/$defs/u"},  # (a property named like a data keyword is still a schema)
    }, "default": {"$ref": "#"}}  # (a data value: not a reference)
    out = embed_schema(tool, "#/items/anyOf/3/properties/parameters", "tools[3]")
    base = "#/items/anyOf/3/properties/parameters"
    assert out["properties"]["unit"]["$ref"] == base + "/$defs/u"
    assert out["properties"]["self"]["anyOf"][0]["$ref"] == base
    assert out["properties"]["default"]["$ref"] == base + "/$defs/u"
    assert out["default"] == {"$ref": "#"}
    with pytest.raises(GrammarCompileError, match=r"tools\[3\].*'\$id'"):
        embed_schema({"$id": "urn:x", "type": "object"}, base, "tools[3]")


def test_counts_and_formats_are_rewritten_only_where_they_are_keywords():
    schema = parse_schema('{"maxItems": 2.0, "minLength": 1.5, "const": {"maxItems": 2.0}}')
    assert schema == {"maxItems": 2, "minLength": 1.5, "const": {"maxItems": 2.0}}
    assert isinstance(schema["maxItems"], int)
    pinned = pin_formats({"properties": {"when": {"type": "string", "format": "date-time"},
                                         "enum": {"format": "date"}}, "examples": [{"format": "date"}]})
    assert "format" not in pinned["properties"]["when"] and pinned["properties"]["when"]["pattern"].startswith("^")
    assert "pattern" in pinned["properties"]["enum"] and pinned["examples"] == [{"format": "date"}]
    with pytest.raises(GrammarCompileError, match="beside 'pattern' at #/properties/d"):
        pin_formats({"properties": {"d": {"format": "date", "pattern": "^2"}}})
    for schema, word in ((False, "false"), ("[1]", "object or a boolean"), ("{", "not valid JSON")):
        with pytest.raises(GrammarCompileError, match=word):
            parse_schema(schema)
    assert parse_schema(True) == {}

