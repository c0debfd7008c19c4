"""The schema rewrites Atlas makes before a grammar engine sees a schema keep its meaning exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atlas.sampling_params import StructuredOutputsParams
from atlas.structured.json_schema import (
    GrammarCompileError,
    _other_than,
    embed_schema,
    exact_other_names,
    json_quote_unsafe,
    parse_schema,
    pin_formats,
    xgrammar_unsupported,
)
from atlas.structured.xgrammar_backend import exact_json_strings, exact_string_lengths


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



# ------------------------------------------------------------------ string length bounds through xgrammar
MODEL = Path(__file__).resolve().parent.parent / "atlas" / "assets" / "default-model"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


@pytest.fixture(scope="module")
def xgr_backend(tokenizer):
    from atlas.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _compile(backend, schema):
    return backend.compile(StructuredOutputsParams(json=schema))


def _accepts(compiled, data: bytes) -> bool:
    """Whether the bytes are a whole document of the compiled grammar (the one Atlas's matchers run)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(data) and matcher.is_terminated()


# One JSON string character each, written as the grammar may write it: ASCII, 2-, 3- and 4-byte UTF-8, DEL (not
# a JSON control character), short escapes, \u escapes of the BMP around the surrogates, an escaped pair.
CHARACTERS = [b"a", "\u00e9".encode(), "\u20ac".encode(), "\U0001f600".encode(), "\U0010ffff".encode(), b"\x7f",
              b"\\n", b'\\"', b"\\\\", b"\\/", b"\\u00e9", b"\\uD7FF", b"\\ue000", b"\\ud83d\\ude00", b"\\uDBFF\\uDFFF"]


def test_xgrammar_bounded_strings_count_json_characters_exactly(tokenizer, xgr_backend):
    compiled = _compile(xgr_backend, {"type": "string", "minLength": 2, "maxLength": 4})
    for c in CHARACTERS:
        for n in (1, 2, 4, 5):
            doc = b'"' + c * n + b'"'
            assert len(json.loads(doc)) == n  # (Python's json counts it as n characters too)
            assert _accepts(compiled, doc) == (2 <= n <= 4), doc
            # (and as tokens, the way a sequence reaches it: tokens of several characters cross the count)
            tokens = [*tokenizer.encode(doc.decode(), add_special_tokens=False), tokenizer.eos_token_id]
            complete = xgr_backend.matcher(compiled).count_accepted(tokens) == len(tokens)
            assert complete == (2 <= n <= 4), doc


# Never inside a string: raw control characters, a bare or dangling backslash, unknown or short escapes,
# overlong UTF-8 (\xc0\xaf, \xe0\x80\xaf, \xf0\x80\x80\xaf are '/'), encoded surrogates (CESU-8), code points
# past U+10FFFF, cut UTF-8, and lone or reversed escaped surrogates: Python's json takes those (a string with a
# lone surrogate), strict parsers (I-JSON) do not, and a JSON consumer may count them differently.
INVALID = [b"a\x00", b"a\x1f", b"a\n", b"a\t", b"a\\", b"\\ab", b"\\x41", b"\\u00e", b"\\U00e9", b"\xc0\xaf",
           b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80",
           b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xff", b"\\ud83d", b"\\ude00", b"\\ud83da", b"\\ude00\\ud83d"]


def test_xgrammar_bounded_strings_refuse_what_json_refuses(xgr_backend):
    compiled = _compile(xgr_backend, {"type": "string", "maxLength": 12})
    assert _accepts(compiled, b'"' + b"a" * 12 + b'"') and not _accepts(compiled, b'"' + b"a" * 13 + b'"')
    for bad in INVALID:
        assert not _accepts(compiled, b'"x' + bad + b'"'), bad
    minimum = _compile(xgr_backend, {"type": "string", "minLength": 1})
    assert _accepts(minimum, b'"' + b"\\t" * 300 + b'"') and not _accepts(minimum, b'""')
    assert not any(_accepts(minimum, b'"' + bad + b'"') for bad in INVALID)


def test_xgrammar_length_bounds_where_a_schema_puts_them(xgr_backend):
    # Without a type, the bounds hold for strings only; other values stay allowed.
    typeless = _compile(xgr_backend, {"maxLength": 2, "title": "t"})
    for doc, ok in ((b'"ab"', True), (b'"abc"', False), (b"100", True), (b'["abc"]', True), (b'{"k": "abc"}', True),
                    (b"null", True), (b'"a\x01"', False)):
        assert _accepts(typeless, doc) == ok, doc
    never_a_string = _compile(xgr_backend, {"minLength": 3, "maxLength": 2})
    assert _accepts(never_a_string, b"true") and not _accepts(never_a_string, b'"ab"')
    nested = _compile(xgr_backend, {
        "type": "object", "$defs": {"s": {"type": "string", "maxLength": 2}}, "additionalProperties": False,
        "properties": {"a": {"$ref": "#/$defs/s"}, "b": {"$ref": "#/$defs/s"},
                       "c": {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 3},
                                                                  {"type": "integer"}]}}}})
    assert _accepts(nested, b'{"a": "\\u00e9\\n", "b": "\xf0\x9f\x98\x80", "c": ["abc", 7, "\\"\\"\\""]}')
    for doc in (b'{"a": "abc"}', b'{"b": "\xed\xa0\x80"}', b'{"c": ["ab"]}', b'{"c": ["ab\x00"]}'):
        assert not _accepts(nested, doc), doc


def test_length_bounds_xgrammar_cannot_keep_are_refused(xgr_backend):
    for schema, words in (({"type": "string", "enum": ["abc"], "maxLength": 2}, "'maxLength' beside"),
                          ({"type": "integer", "minLength": 2}, "'minLength' beside"),
                          ({"type": "string", "maxLength": 1.5}, "not a non-negative integer"),
                          ({"type": "string", "minLength": 3, "maxLength": 2}, "greater than maxLength")):
        with pytest.raises(GrammarCompileError, match=words):
            _compile(xgr_backend, schema)
    assert xgrammar_unsupported({"type": "string", "maxLength": 2}) is None


def test_the_rewrite_refuses_a_grammar_it_was_not_written_for():
    ebnf = 'root ::= (("\\"" root_characters{0, 2} "\\""))\nroot_characters ::= (([^\\"\\\\\\r\\n]))\n'
    assert "root ::= ((\"\\\"\" atlas_json_upto_2))" in exact_string_lengths(ebnf, {(0, 2)}).splitlines()
    for text, bounds in ((ebnf, {(0, 3)}),  # (bounds that are not the schema's)
                         (ebnf + "other ::= ((root_characters))\n", {(0, 2)}),  # (the rule used some other way)
                         (ebnf.replace("{0, 2}", "*"), {(0, 2)}),  # (a form not known)
                         (ebnf + "atlas_json_hex ::= \"x\"\n", {(0, 2)})):  # (a name of Atlas's taken)
        with pytest.raises(GrammarCompileError, match="string length bounds"):
            exact_string_lengths(text, bounds)


def test_length_bounds_past_the_compile_budget_go_to_llguidance(tokenizer, xgr_backend, monkeypatch):
    """A counted character is one grammar rule, and each rule one pass over the vocabulary when xgrammar compiles:
    past the budget xgrammar refuses the schema, naming why, and auto gives it to llguidance."""
    from atlas.structured import xgrammar_backend
    from atlas.structured.grammar import make_backend

    monkeypatch.setattr(xgrammar_backend, "LENGTH_RULE_BUDGET", 16 * xgr_backend.vocab_size)  # (16 rules, fast)
    # (rules atlas_json_upto_0..13 and atlas_json_min_1..2: maxLength + 1 in all)
    fits, over = ({"type": "string", "minLength": 2, "maxLength": n} for n in (15, 16))
    assert _accepts(_compile(xgr_backend, fits), b'"' + b"a" * 15 + b'"')
    with pytest.raises(GrammarCompileError, match="need 17 grammar rules .* more than 16 on a vocabulary"):
        _compile(xgr_backend, over)
    auto = make_backend("auto", tokenizer, xgr_backend.vocab_size, [tokenizer.eos_token_id])
    assert [auto.compile(StructuredOutputsParams(json=s))[0] for s in (fits, over)] == ["xgrammar", "llguidance"]


# ------------------------------------------------------------------ unbounded strings through xgrammar
def _documents(kind):
    """(where, document with a string s put in): string values, listed and unlisted property names, json_object."""
    if kind == "string":
        return [lambda s: s]
    if kind == "object":  # (an open object with listed properties: the unlisted names are xgrammar's name trie)
        return [lambda s: b'{"ab": ' + s + b"}", lambda s: b"{" + s + b": 1}", lambda s: b'{"ab": "v", ' + s + b": 2}"]
    return [lambda s: b"{" + s + b': 1}', lambda s: b'{"k": [' + s + b"]}", lambda s: b'{"k": {"j": ' + s + b"}}"]


@pytest.mark.parametrize("kind", ["string", "object", "json_object"])
def test_xgrammar_plain_strings_are_exact(xgr_backend, kind):
    """xgrammar's own string rule takes lone escaped surrogates and encoded ones (invalid UTF-8); Atlas's swap
    of its class and escape refuses them, and everything else a JSON string holds still passes."""
    spec = {"string": StructuredOutputsParams(json={"type": "string"}),
            "object": StructuredOutputsParams(json={"type": "object", "properties": {"ab": {"type": "string"}}}),
            "json_object": StructuredOutputsParams(json_object=True)}[kind]
    compiled = xgr_backend.compile(spec)
    for put in _documents(kind):
        for c in CHARACTERS:
            assert _accepts(compiled, put(b'"x' + c + c + b'"')), put(c)
        assert _accepts(compiled, put(b'"' + b"".join(CHARACTERS) + b'"'))
        for bad in INVALID:
            assert not _accepts(compiled, put(b'"x' + bad + b'"')), put(bad)
            assert not _accepts(compiled, put(b'"' + bad + b'"')), put(bad)


def test_xgrammar_unlisted_names_cannot_spell_a_listed_one(xgr_backend):
    """An open object's other names come from xgrammar's trie over the listed ones: an escape could spell a listed
    name (\\u0061b is "ab") and take its value past the name's schema; Atlas writes no escape where it could."""
    compiled = _compile(xgr_backend, {"type": "object", "properties": {"ab": {"type": "integer"}, "a": {"type": "null"}}})
    for doc, ok in ((b'{"ab": 1}', True), (b'{"a": null, "abc": "x"}', True), (b'{"ab\\n": "x"}', True),
                    (b'{"b\\u0061": "x"}', True), (b'{"ab": "x"}', False), (b'{"a": 1}', False),
                    (b'{"\\u0061b": "x"}', False), (b'{"a\\u0062": "x"}', False), (b'{"\\u0061": 1}', False)):
        assert _accepts(compiled, doc) == ok, doc
        assert json.loads(doc)  # (all JSON)
    # Names xgrammar's trie matches raw or byte by byte are refused (it lets {"a"": 1} through for 'a"b', and
    # the name "\u00e9" past its schema), unless the object is closed to other names.
    for name in ('a"b', "a\\b", "\u00e9", "a\nb"):
        assert "property name" in xgrammar_unsupported({"type": "object", "properties": {name: {"type": "integer"}}})
        assert xgrammar_unsupported({"type": "object", "properties": {name: {"type": "integer"}},
                                     "additionalProperties": False}) is None
    # (printable ASCII names, class characters and the grammar's own punctuation included, go through xgrammar)
    odd = _compile(xgr_backend, {"type": "object", "properties": {"a b": {"type": "integer"},
                                                                  " ]-^[|)(": {"enum": ["basic_escape"]}}})
    for doc, ok in ((b'{"a b": 1, " ]-^[|)(": "basic_escape"}', True), (b'{"a b": "x"}', False),
                    (b'{" ]-^[|)(": 1}', False), (b'{" ]-^[|)": 1, "a c": 2}', True), (b'{"a\\u0020b": "x"}', False)):
        assert _accepts(odd, doc) == ok, doc


def test_the_string_rewrite_refuses_a_grammar_it_was_not_written_for():
    import xgrammar

    text = str(xgrammar.Grammar.from_json_schema('{"properties": {"ab": {"type": "integer"}}}',
                                                 any_whitespace=False, strict_mode=False))
    assert "\\uD800-\\uDFFF" in exact_json_strings(text)
    for old, new in (('[A-Fa-f0-9] [A-Fa-f0-9]))', '[A-Fa-f0-9]))'),  # (another escape rule)
                     ("basic_string_sub)) (=", "basic_string_sub) | ([\\x80-\\xff])) (="),  # (an alternative not known)
                     ("\\r\\na]", "\\r\\na\\xc3]"),  # (a name's byte in the trie)
                     ('("a" root', '("\\"" root'),  # (a quote in a name)
                     ("basic_null ::= ((\"null\"))", "basic_null ::= (([^n]))"),  # (a negated class elsewhere)
                     ("basic_null ::= ((\"null\"))", "basic_null ::= (([\\u0100-\\uffff]))")):  # (a wide one)
        assert old in text, old
        with pytest.raises(GrammarCompileError, match="strings cannot be enforced exactly"):
            exact_json_strings(text.replace(old, new, 1))


# ------------------------------------------------------------------ the same strings through llguidance
def _byte_tokens(tokenizer) -> list[int]:
    """The default tokenizer's token for each byte (byte-level BPE: GPT-2's byte-to-character table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: b for b in printable}
    table.update({b: 256 + i for i, b in enumerate(b for b in range(256) if b not in table)})
    ids = [tokenizer.convert_tokens_to_ids(chr(table[b])) for b in range(256)]
    assert len(set(ids)) == 256 and tokenizer.unk_token_id not in ids
    return ids


@pytest.fixture(scope="module")
def llg_accepts(tokenizer):
    from atlas.structured.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    ids = _byte_tokens(tokenizer)

    def accepts(spec, doc):
        tokens = [*(ids[b] for b in doc), tokenizer.eos_token_id]
        return backend.matcher(backend.compile(spec)).count_accepted(tokens) == len(tokens)

    return accepts


def test_llguidance_strings_refuse_surrogates(llg_accepts):
    """llguidance's own JSON strings (values, property names, json_object) refuse lone escaped surrogates, encoded
    surrogates, raw control characters and overlong forms, byte by byte."""
    for spec in (StructuredOutputsParams(json={"type": "string"}), StructuredOutputsParams(json_object=True)):
        for put in _documents("string" if spec.json else "json_object"):
            assert llg_accepts(spec, put("\"x\u00e9\U0001f600\\n\\\"\"".encode()))
            for bad in (b"\\ud800", b"\\ude00\\ud83d", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\x01", b"\xc0\xaf"):
                assert not llg_accepts(spec, put(b'"x' + bad + b'"')), put(bad)


def test_llguidance_unlisted_names_cannot_spell_a_listed_one(llg_accepts):
    """llguidance's rule for an open object's other names took \\u escapes, so "\\u0061b" passed as another name
    while it decodes to "ab", past the schema of "ab". Atlas gives it the object closed, the other names as the
    pattern of the listed names' complement (json_schema.exact_other_names), whose rule matches decoded names."""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"ab": {"type": "integer"}}})
    for doc, ok in ((b'{"ab": 1}', True), (b'{"abc": "x"}', True), (b'{"ab": "x"}', False),
                    (b'{"\\u0061b": "x"}', False), (b'{"a\\u0062": "x"}', False), (b'{"a": "x", "b\\n": [1]}', True)):
        assert llg_accepts(spec, doc) == ok, doc
    # Every spelling of a listed name (escapes of any character, upper or lower hex, the short escapes) takes
    # the listed name's schema, and no other name does: names with quotes, backslashes, control characters, DEL,
    # non-ASCII and regex syntax; the other names are strings.
    names = ["ab", "a", "", "a\n", "x\x00y", "q\x7f", "\u00e9", "\U0001f600x", 'a"b', "a\\b", "a/b", " ]-^[|)(",
             "$.*+?{}", "\x1f", "c\"", "c\\", "d\x01\""]
    others = ["b", "abc", "a\n\n", "a\nb", "x\x00", "q", "e", "\U0001f600", 'a"', "a\\", "a/", "\x1e", "A",
              "$.*+?{", 'c"x', "c\\x", "c", 'c""', "d\x01", "d"]
    spec = StructuredOutputsParams(json={"type": "object", "properties": {n: {"type": "integer"} for n in names},
                                         "additionalProperties": {"type": "string"}})
    for name, listed in [(n, True) for n in names] + [(n, False) for n in others]:
        for spelling in _spellings(name):
            assert json.loads(spelling) == name
            for value, is_int in ((b"1", True), (b'"s"', False)):
                doc = b"{" + spelling.encode() + b": " + value + b"}"
                if is_int != listed:
                    assert not llg_accepts(spec, doc), doc
        assert llg_accepts(spec, b"{" + json.dumps(name, ensure_ascii=False).encode() + (b": 1}" if listed
                                                                                           else b': "s"}'))


def _spellings(name: str) -> set[str]:
    """The JSON spellings of a name: json.dumps's two, and each character in turn as \\u00XX in either case."""
    out = {json.dumps(name), json.dumps(name, ensure_ascii=False)}
    for i, ch in enumerate(name):
        if ord(ch) < 0x10000:
            for form in ("\\u%04x", "\\u%04X"):
                out.add(json.dumps(name[:i], ensure_ascii=False)[:-1] + form % ord(ch)
                        + json.dumps(name[i + 1:], ensure_ascii=False)[1:])
    return out


def test_the_other_names_pattern_is_the_complement_of_the_listed_ones():
    import random
    import re

    rng = random.Random(0)
    alphabet = 'ab"\\\x00\x7f\u00e9\U0001f600]^-$.'  # (no "\n": Python's $ also matches before a final newline)
    for _ in range(200):
        names = {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 6))}
        pattern = _other_than(sorted(names))
        probes = names | {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(40)}
        probes |= {n[:-1] for n in names} | {n + "a" for n in names}
        for s in probes:
            assert bool(re.search(pattern, s)) == (s not in names), (names, s, pattern)


def test_llguidance_objects_keep_their_meaning_when_closed(llg_accepts):
    """Open objects in an allOf (which llguidance merges) share one pattern; the names another lists are added
    with the object's additionalProperties schema. Patterns beside an open object are refused: their complement is
    not a pattern, and llguidance's own rule lets an escape spell a name a pattern matches."""
    import jsonschema

    schema = {"allOf": [{"properties": {"a": {"type": "integer"}}},
                        {"properties": {"b": {"type": "null"}}, "additionalProperties": {"type": ["string", "integer"]}}]}
    spec = StructuredOutputsParams(json=schema)
    for doc in (b'{"a": 1, "b": null}', b'{"a": 1}', b'{"a": "x"}', b'{"c": "x"}', b'{"c": null}', b'{"c": 2}',
                b'{"\\u0061": "x"}', b'{"\\u0062": "x"}', b'{"b": 1}', b'{"b\\u0000": null}'):
        assert llg_accepts(spec, doc) == jsonschema.Draft202012Validator(schema).is_valid(json.loads(doc)), doc
    closed = exact_other_names({"properties": {"a": {}}, "required": ["z"], "$defs": {"d": {"properties": {
        "b": {}}, "additionalProperties": {"type": "string"}}}})
    assert closed["additionalProperties"] is False and list(closed["properties"]) == ["a", "b"]
    assert closed["properties"]["b"] == {} and list(closed["patternProperties"].values()) == [{}]
    assert closed["$defs"]["d"]["properties"]["a"] == {"type": "string"}
    assert exact_other_names({"properties": {"a": {}}, "additionalProperties": False}) == {
        "properties": {"a": {}}, "additionalProperties": False}
    for schema, words in (({"patternProperties": {"^a": {"type": "integer"}}}, "'patternProperties' beside"),
                          ({"properties": {"a\n": {}}, "patternProperties": {"^a": {}}, "additionalProperties": False},
                           "control character"),
                          ({"properties": {"p": {"$ref": "#/additionalProperties"}, "q": {}}}, "into an")):
        with pytest.raises(GrammarCompileError, match=words):
            exact_other_names(schema)
    spec = StructuredOutputsParams(json={"type": "object", "patternProperties": {"^a": {"type": "integer"}}})
    with pytest.raises(GrammarCompileError, match="patternProperties"):
        llg_accepts(spec, b'{"\\u0061": "x"}')


def test_llguidance_patterns_whose_json_quoting_lets_quotes_through_are_refused(llg_accepts):
    """llguidance 1.9 quotes a pattern into JSON one character set at a time, and for a set that holds every
    control character (or all but \n) it allows \" and \\ even where the set has no '"' or '\': `^[^"]*$` matched
    "a\"b". Such patterns are refused; the sets it quotes right are enforced, checked here against Python's re."""
    import re

    for pattern in ('^[^"]*$', "^[^\\\\]*$", "^[\\x00-\\x21]$", '^[^\\n"]$', '^[^\\w"]$', '^(?:a|[^"])$',
                    '^(?:[\\x00-\\x10]|[\\x11-\\x1f]|!)$', '^\\p{L}[^"]$', '[^"]*+', '(?>[^"])'):
        assert json_quote_unsafe(pattern), pattern
        with pytest.raises(GrammarCompileError, match="every control character"):
            llg_accepts(StructuredOutputsParams(json={"type": "string", "pattern": pattern}), b'"a"')
    with pytest.raises(GrammarCompileError, match="'patternProperties'"):
        llg_accepts(StructuredOutputsParams(json={"type": "object", "patternProperties": {'^[^"]': {}},
                                                  "additionalProperties": False}), b'{}')
    for pattern in ('^[^\\x00"]$', '^[^\\s"]$', "^[^a]$", "^.$", "^\\D$", "^\\W$", '^[^"\\x01]$', "^[a-z]$",
                    '^(?:[\\x00-\\x10]|[\\x12-\\x1f]|!)$', "^\\p{L}$"):
        assert not json_quote_unsafe(pattern), pattern
        spec = StructuredOutputsParams(json={"type": "string", "pattern": pattern})
        for doc in (b'"\\""', b'"\\\\"', b'"a"', b'"\\u0001"', b'"\\n"', b'" "'):
            if "\\p" not in pattern:
                assert llg_accepts(spec, doc) == bool(re.search(pattern, json.loads(doc))), (pattern, doc)
            elif doc in (b'"\\""', b'"\\\\"'):
                assert not llg_accepts(spec, doc)


def test_llguidance_compile_options_and_json_blocks_are_not_taken_from_the_client(llg_accepts):
    """llguidance reads compile options from a schema's "x-guidance" (json_allowed_escapes without u made the const
    "hello\u0000there" match "hellothere"), and compiles a lark grammar's %json blocks past Atlas's checks of JSON
    schemas (there "\u0061b" still passed for a listed "ab"): both refused."""
    with pytest.raises(GrammarCompileError, match="x-guidance"):
        llg_accepts(StructuredOutputsParams(json={"x-guidance": {"json_allowed_escapes": 'nrbtf\\"'},
                                                  "const": "hello\u0000there"}), b'"hellothere"')
    assert llg_accepts(StructuredOutputsParams(json={"const": "hello\u0000there"}), b'"hello\\u0000there"')
    assert not llg_accepts(StructuredOutputsParams(json={"const": "hello\u0000there"}), b'"hellothere"')
    lark = 'start: obj\nobj: %json {"type": "object", "properties": {"ab": {"type": "integer"}}}\n'
    with pytest.raises(GrammarCompileError, match="%json"):
        llg_accepts(StructuredOutputsParams(grammar=lark), b'{"\\u0061b": "x"}')
    assert llg_accepts(StructuredOutputsParams(grammar='start: "{" NUM "}"\nNUM: /[0-9]+/\n'), b"{12}")


# ------------------------------------------------------------------ the schemas of structural tags through xgrammar
def _tags(schema):
    """(structural tag, document with a JSON value v put in): vLLM's form (free text, "<" starts a tag) and
    xgrammar's format trees (a tag after a constant, a tag in a sequence of two)."""
    legacy = {"structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}], "triggers": ["<"]}
    tag = {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</a>"}
    sequence = {"type": "sequence", "elements": [{"type": "const_string", "value": "A: "}, tag]}
    two = {"type": "sequence", "elements": [tag, {**tag, "begin": "<b>", "end": "</b>"}]}
    return [(legacy, lambda v: b"say " + b"<a>" + v + b"</a> then"),
            ({"type": "structural_tag", "format": sequence}, lambda v: b"A: <a>" + v + b"</a>"),
            ({"type": "structural_tag", "format": two}, lambda v: b'<a>{"k": 1}</a><b>' + v + b"</b>")]


@pytest.fixture(scope="module")
def tag_accepts(tokenizer, xgr_backend):
    """Whether a structural tag takes a document, fed as the byte tokens a sequence may sample (one token a byte),
    through Atlas's matcher; and the same as bytes through xgrammar's (both must agree)."""
    ids = _byte_tokens(tokenizer)

    def accepts(tag, doc: bytes) -> bool:
        compiled = xgr_backend.compile(StructuredOutputsParams(structural_tag=tag))
        tokens = [ids[b] for b in doc]
        by_tokens = xgr_backend.matcher(compiled).count_accepted(tokens) == len(tokens)
        assert _accepts(compiled, doc) == by_tokens, doc  # (no stop token here: free text may follow)
        return by_tokens

    return accepts


@pytest.mark.parametrize("where", ["value", "name", "nested"])
def test_xgrammar_structural_tag_strings_are_exact(tag_accepts, where):
    """xgrammar compiles a structural tag's JSON schema with its own string rule, which took lone escaped surrogates
    ("\\ud800") and encoded ones (\\xed\\xa0\\x80: invalid UTF-8) in values and in property names; Atlas gives it
    the schema's grammar with its exact strings instead, as on the JSON path."""
    schema = {"type": "object", "properties": {"ab": {"type": "string"}}}
    put = {"value": lambda s: b'{"ab": ' + s + b"}", "name": lambda s: b"{" + s + b": 1}",
           "nested": lambda s: b'{"c": [{"d": ' + s + b"}]}"}[where]
    for tag, doc in _tags(schema):
        for c in CHARACTERS:
            assert tag_accepts(tag, doc(put(b'"x' + c + c + b'"'))), doc(put(c))
        for bad in (b"\\ud800", b"\\udfff", b"\\ude00\\ud83d", b"\\ud83da", b"\xed\xa0\x80", b"\xed\xbf\xbf",
                    b"\xed\xa0\xbd\xed\xb8\x80", b"\x01", b"\xc0\xaf", b"\\x41"):
            assert not tag_accepts(tag, doc(put(b'"x' + bad + b'"'))), doc(put(b'"x' + bad + b'"'))


def test_xgrammar_structural_tag_names_and_lengths_are_exact(tag_accepts, xgr_backend, monkeypatch):
    """An escape cannot spell a listed name past its schema (\\u0061b is "ab"), and string length bounds, refused
    in structural tags before, count JSON characters as on the JSON path."""
    schema = {"type": "object", "properties": {"ab": {"type": "integer"},
                                               "s": {"type": "string", "minLength": 1, "maxLength": 3}}}
    for tag, doc in _tags(schema):
        for value, ok in ((b'{"ab": 1}', True), (b'{"abc": "x"}', True), (b'{"\\u0061b": "x"}', False),
                          (b'{"a\\u0062": "x"}', False), (b'{"s": "\\u00e9\\n\xf0\x9f\x98\x80"}', True),
                          (b'{"s": "abcd"}', False), (b'{"s": ""}', False), (b'{"s": "\\ud800"}', False),
                          (b'{"s": "a\\ud83d\\ude00"}', True)):
            assert tag_accepts(tag, doc(value)) == ok, doc(value)
    # (every schema's grammar has its own length rules: past the compile budget, refused naming why)
    from atlas.structured import xgrammar_backend

    monkeypatch.setattr(xgrammar_backend, "LENGTH_RULE_BUDGET", 8 * xgr_backend.vocab_size)
    bounded = {"type": "string", "maxLength": 4}  # (5 rules)
    tag = {"structures": [{"begin": "<a>", "schema": bounded, "end": "</a>"}], "triggers": ["<"]}
    assert tag_accepts(tag, b'<a>"abcd"</a>') and not tag_accepts(tag, b'<a>"abcde"</a>')
    tag["structures"].append({"begin": "<b>", "schema": bounded, "end": "</b>"})
    with pytest.raises(GrammarCompileError, match="need 10 grammar rules .* more than 8") as info:
        xgr_backend.compile(StructuredOutputsParams(structural_tag=tag))
    assert info.value.param == "structural_tag"


def test_xgrammar_structural_tag_schemas_are_xgrammars_own_grammar():
    """What Atlas puts in place of a json_schema format is the grammar xgrammar makes for it (the same text before
    the string rewrites, its root named otherwise), so nothing but the strings changes."""
    import re

    import xgrammar

    for schema in ({"type": "object", "properties": {"ab": {"type": "string"}}, "required": ["ab"],
                    "additionalProperties": True},
                   {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 2}, {"type": "null"}]}}):
        for cnt in (1, 3):
            fmt = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": cnt}
            inside = str(xgrammar.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt})))
            ours = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=True,
                                                         max_whitespace_cnt=cnt))
            assert inside.endswith("root ::= ((root_0))\n")
            assert re.sub(r"\broot_0\b", "root", inside.removesuffix("root ::= ((root_0))\n")) == ours


def test_xgrammar_structural_tag_schemas_the_rewrites_do_not_know_are_refused(xgr_backend, monkeypatch):
    from atlas.structured import xgrammar_backend

    monkeypatch.setattr(xgrammar_backend, "_XGR_ESCAPE", "(another escape rule)")
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "A: "}, {"type": "json_schema", "json_schema": {"type": "string"}}]}}
    with pytest.raises(GrammarCompileError, match=r"at format\.elements\[1\]\.json_schema, the JSON schema's "
                                                  r"strings cannot be enforced exactly .*escape rule") as info:
        xgr_backend.compile(StructuredOutputsParams(structural_tag=tag))
    assert info.value.param == "structural_tag" and "llguidance" not in str(info.value)


def test_auto_warms_without_an_engine_that_cannot_read_the_tokenizer(tokenizer, caplog):
    """A stop id past the tokenizer's vocabulary (a model's generation config with another tokenizer, as `atlas
    bench serve --tokenizer` runs): llguidance refuses the tokenizer. Warming `auto` (the compile guard's worker does
    at start) says so in a log line instead of raising, a schema still compiles on xgrammar, and a constraint that
    needs llguidance gets its error when it compiles."""
    from atlas.structured.grammar import make_backend

    auto = make_backend("auto", tokenizer, len(tokenizer), [len(tokenizer) + 100])
    with caplog.at_level("INFO", logger="atlas.structured.grammar"):
        auto.warm()
    assert "the llguidance grammar engine is not available with this tokenizer" in caplog.text
    assert auto.compile(StructuredOutputsParams(json={"type": "object"}))[0] == "xgrammar"
    with pytest.raises(GrammarCompileError, match="llguidance grammar engine cannot use this tokenizer"):
        auto.compile(StructuredOutputsParams(regex="a+"))
