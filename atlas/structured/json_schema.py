"""JSON schemas before a grammar engine sees them: parsed, checked for what admits no value, integer-valued
keywords written as integral floats made integers, and (for xgrammar) every keyword outside the subset whose
enforcement was checked refused, naming the keyword and where it is.

Everything here keeps a schema's meaning exactly; what cannot be kept is refused (GrammarCompileError).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from atlas.errors import InvalidRequestError


class GrammarCompileError(InvalidRequestError):
    """The constraint does not compile, or asks for something the grammar engine cannot enforce exactly."""


# Keywords whose value must be a non-negative integer; JSON Schema counts 2.0 as the integer 2.
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                   "minContains", "maxContains")
# Keywords whose values are data, not schemas: nothing inside them is rewritten or checked.
_DATA_KEYWORDS = ("const", "enum", "default", "examples")
# Keywords whose value maps names (of properties, patterns, definitions) to schemas.
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def parse_schema(schema: str | dict | bool, param: str = "json_schema") -> dict:
    """The schema as an object: its text parsed, `true` as `{}`; `false` (admits no value) refused."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarCompileError(f"the JSON schema is not valid JSON ({exc})", param=param) from None
    if schema is True:
        return {}
    if schema is False:
        raise GrammarCompileError("the JSON schema is `false`, which no value satisfies", param=param)
    if not isinstance(schema, dict):
        raise GrammarCompileError("a JSON schema must be an object or a boolean", param=param)
    return _normalize_counts(schema)


def map_keywords(node: Any, visit, where: str = "#") -> Any:
    """A copy of a schema in which `visit(key, value, parent, where)` may replace each keyword: it returns the
    (key, value) to put instead, or None to keep the key and descend into its value. Data values (`const`,
    `enum`, `default`, `examples`) are copied untouched; `where` is the parent's JSON pointer."""
    if isinstance(node, list):
        return [map_keywords(v, visit, f"{where}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        replaced = None if key in _DATA_KEYWORDS else visit(key, value, node, where)
        if replaced is not None:
            out[replaced[0]] = replaced[1]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAME_MAPS and isinstance(value, dict):  # (names, not keywords: a property called "enum")
            out[key] = {name: map_keywords(sub, visit, f"{where}/{key}/{name}") for name, sub in value.items()}
        else:
            out[key] = map_keywords(value, visit, f"{where}/{key}")
    return out


def _normalize_counts(node: Any) -> Any:
    """A copy with every count keyword given as an integral float (2.0) made an integer (2)."""
    def visit(key, value, parent, where):
        if key in _COUNT_KEYWORDS and isinstance(value, float) and value.is_integer() and value >= 0:
            return key, int(value)
        return None

    return map_keywords(node, visit)


# Keywords that give a subschema its own base URI or name a reference target other than by JSON pointer: a
# schema holding one cannot be moved inside another by rewriting its "#..." references.
_SCOPE_KEYWORDS = ("$id", "id", "$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef", "$recursiveAnchor")


def embed_schema(schema: Any, pointer: str, where: str) -> Any:
    """A copy of `schema` for the place `pointer` ("#/items/anyOf/0/...") inside a larger schema: each local
    reference ("#" or "#/...") made to point to the same place under `pointer`, so that it keeps its own
    scope. Refused (GrammarCompileError naming `where`) when the schema sets its own base URI or anchors."""
    def visit(key, value, parent, at):
        if key in _SCOPE_KEYWORDS:
            raise GrammarCompileError(f"{where}: {key!r} cannot be combined with the other tools' schemas (name the "
                                      "function in tool_choice, or use only '#/...' references)", param="tools")
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            return key, pointer + value[1:]
        return None

    return map_keywords(schema, visit)


# RFC 3339 dates and times, as `pattern`s that are a subset of each format: no leap second (RFC 3339 allows
# :60 only at 23:59 UTC, which a regular language over the local time and offset cannot say) and no 29 February
# (leap years are not regular either). llguidance's own formats allow :60 at any time, which `jsonschema` (and
# RFC 3339) reject; a subset keeps every output valid.
_DATE = ("[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         "|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:[.][0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[Tt]{_TIME}$"}


def pin_formats(schema: Any) -> Any:
    """A copy with each date / time / date-time `format` replaced by its subset pattern (above)."""
    def visit(key, value, parent, where):
        if key != "format" or value not in _FORMAT_PATTERNS:
            return None
        if "pattern" in parent:
            raise GrammarCompileError(f"'format' {value!r} beside 'pattern' at {where} is not supported",
                                      param="json_schema")
        return "pattern", _FORMAT_PATTERNS[value]

    return map_keywords(schema, visit)


# ---------------------------------------------------------------------------------------------- xgrammar
# The keywords that xgrammar (0.2.x) was checked to enforce exactly, over the JSON Schema Test Suite
# (tests/test_json_schema_suite.py). Everything else is refused for it: it drops many keywords silently
# (not, if/then/else, uniqueItems, contains, multipleOf, unevaluated*, ...), and its `pattern` lets overlong
# UTF-8 sequences through (\xe0\x9d\xaf: three replacement characters, so the length is wrong).
# minLength/maxLength on strings are enforced, but not by xgrammar's own rule for them ([^"\\\r\n]{m,n}: raw
# control characters in, escapes out): xgrammar_backend writes that rule itself (its EBNF character classes refuse
# overlong forms but take an encoded surrogate, \xed\xa0\x80, so the rule excludes U+D800-U+DFFF by name).
# The schemas of structural tags go through the same rewrites (XGrammarBackend.exact_structural_tag).
_XGRAMMAR_ANNOTATIONS = {"title", "description", "$comment", "default", "examples", "$schema", "deprecated",
                         "readOnly", "writeOnly"}
_XGRAMMAR_KEYWORDS = _XGRAMMAR_ANNOTATIONS | {
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$ref",
    "$defs", "definitions", "minimum", "maximum", "minItems", "maxItems",
}
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_LENGTHS = ("minLength", "maxLength")


def xgrammar_unsupported(schema: dict) -> str | None:
    """Why xgrammar cannot be trusted with this schema (the first keyword outside the checked subset, with its
    location as a JSON pointer), or None. minLength/maxLength are allowed where xgrammar keeps them (the schema then
    goes through string_length_bounds and xgrammar_backend's own rule for them)."""
    return _xgrammar_check(schema, "#", True)


def _lengths_only(node: dict) -> bool:
    """Whether the schema says nothing but string length bounds (and annotations): any value of another type."""
    rest = node.keys() - _XGRAMMAR_ANNOTATIONS
    return bool(rest) and rest <= set(_LENGTHS)


def _xgrammar_check(node: Any, where: str, lengths: bool) -> str | None:
    if isinstance(node, bool):
        return None if node else f"`false` at {where}"
    if not isinstance(node, dict):
        return f"a schema that is not an object at {where}"
    for key, value in node.items():
        at = f"{where}/{key}"
        if key in _LENGTHS and lengths:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return f"{key!r} {json.dumps(value)} at {where} (not a non-negative integer)"
            # (xgrammar drops the bounds beside an enum or a const: "abc" would pass maxLength 2)
            if node.get("type") != "string" and not _lengths_only(node) or "enum" in node or "const" in node:
                return f"{key!r} beside keywords other than type string at {where}"
            continue
        if key not in _XGRAMMAR_KEYWORDS:
            return f"keyword {key!r} at {where}"
        if key in _XGRAMMAR_ANNOTATIONS or key in ("const", "enum", "required"):
            continue
        if key == "type":
            types = value if isinstance(value, list) else [value]
            if len(types) != 1 or types[0] not in _TYPES:
                return f"'type' {json.dumps(value)} at {where} (one type name only)"
        elif key == "$ref":
            if not isinstance(value, str) or not value.startswith("#/"):
                return f"'$ref' {json.dumps(value)} at {where} (only local JSON-pointer references)"
        elif key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                return f"{key!r} at {where} is not an object"
            for name, sub in value.items():
                # (xgrammar's rule for the names an open object does not list matches the listed names raw and
                # byte by byte: a quote lets invalid JSON through ({"a"": 1} for the name 'a"b'), a non-ASCII
                # name ('\u00e9') passes as an unlisted one, past its schema)
                if key == "properties" and node.get("additionalProperties") is not False \
                        and not re.fullmatch(r'[ !#-\[\]-~]*', name):
                    return (f"property name {json.dumps(name)} at {where} (in an object open to other properties, "
                            "names of printable ASCII without '\"' or '\\' only)")
                why = _xgrammar_check(sub, f"{at}/{name}", lengths)
                if why:
                    return why
        elif key == "additionalProperties":
            if value is not False:
                return f"'additionalProperties' other than false at {where}"
        elif key == "items":
            why = _xgrammar_check(value, at, lengths) if isinstance(value, dict) else \
                f"'items' at {where} is not a schema"
            if why:
                return why
        elif key == "anyOf":
            if not isinstance(value, list) or not value or len(node) > 1 + len(
                    _XGRAMMAR_ANNOTATIONS & node.keys()):
                return f"'anyOf' beside other keywords, or empty, at {where}"
            for i, sub in enumerate(value):
                why = _xgrammar_check(sub, f"{at}/{i}", lengths)
                if why:
                    return why
        elif key in ("minimum", "maximum") and node.get("type") != "integer":
            return f"{key!r} on a type other than integer at {where}"
        elif key in ("minItems", "maxItems") and node.get("type") != "array":
            return f"{key!r} without type array at {where}"
    if "$ref" in node and len(node) > 1 + len(_XGRAMMAR_ANNOTATIONS & node.keys()):
        return f"'$ref' beside other keywords at {where}"
    if "type" not in node and "$ref" not in node and "anyOf" not in node and "enum" not in node \
            and "const" not in node and len(node) > len(_XGRAMMAR_ANNOTATIONS & node.keys()) \
            and not (lengths and _lengths_only(node)):
        return f"keywords without 'type' at {where}"
    return None


def string_length_bounds(schema: dict) -> tuple[dict, set[tuple[int, int]]]:
    """For xgrammar, a schema inside its subset (xgrammar_unsupported) -> (the schema with each length-bounded
    string typed, the (minLength, maxLength) pairs of those strings, -1 for no maximum). A schema of length
    bounds alone leaves every other type allowed, and xgrammar drops bounds without a type, so it is written as
    anyOf: the bounded string or a value of another type (the string left out where min > max: none is)."""
    bounds: set[tuple[int, int]] = set()

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {key: value if key in _DATA_KEYWORDS
               else {name: walk(sub) for name, sub in value.items()} if key in _NAME_MAPS and isinstance(value, dict)
               else walk(value) for key, value in node.items()}
        if not any(k in out for k in _LENGTHS):
            return out
        lo, hi = out.get("minLength", 0), out.get("maxLength", -1)
        if out.get("type") == "string":
            bounds.add((lo, hi))
            return out
        string = {"type": "string", **{k: out.pop(k) for k in _LENGTHS if k in out}}
        others = [{"type": t} for t in ("number", "boolean", "null", "array", "object")]
        if hi == -1 or lo <= hi:
            bounds.add((lo, hi))
            others.insert(0, string)
        out["anyOf"] = others
        return out

    return walk(schema), bounds


# ---------------------------------------------------------------------------------------------- llguidance
# llguidance (1.9) writes the names of an object's listed properties as literals (json.dumps's spelling, one
# spelling each) and takes the other names of an open object (additionalProperties not false) through a JSON
# string rule that allows every \uXXXX escape, minus those literals compared as text: "\u0061b" is not the text
# "ab", so it passed as another property while it decodes to "ab", and its value skipped the schema of "ab". Its
# rule for a patternProperties name is the pattern quoted into JSON by its regex library (derivre's JsonQuote),
# which matches the decoded name: every character written raw except '"' '\' (\" \\) and the control characters
# and DEL (their short escape or \u00XX), no other escape. So an open object that lists names is given to
# llguidance closed, with its other names as one pattern, the complement of the listed names (exact_other_names):
# the same schema, with every spelling of a listed name going to the listed one. Patterns of the schema's own
# beside an open object are refused there: their complement is not a pattern llguidance reads.

def _regex_char(ch: str) -> str:
    """One character as a regex atom llguidance reads (outside or inside a class): ASCII letters, digits and '_'
    raw, other ASCII as \\xHH, the rest raw (UTF-8)."""
    if ch.isascii():
        return ch if ch.isalnum() or ch == "_" else f"\\x{ord(ch):02x}"
    return ch


# (derivre's JsonQuote of a character class holding every control character, or all but \n, allows \" and \\ even
# where the class leaves '"' or '\' out: `[^"]` matched the name "\"". Such a class is written without \x00, and
# \x00 as its own branch, which derivre does not merge back into the class since it continues.)
_ANY = r"[\s\S]"


def _other_than(names: list[str]) -> str:
    """A pattern (search semantics, as JSON Schema's patternProperties) that matches exactly the strings that are
    not one of `names`: at each node of the names' trie, the end where no name ends there, a character that no
    name continues with, or a character that one does and the rest from there."""
    end = ""  # (the trie's mark of a name's end: no character is the empty string)
    trie: dict = {}
    for name in names:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[end] = {}
    # post-order without recursion (a name may be longer than Python's recursion limit)
    out: dict[int, str] = {}
    stack = [(trie, False)]
    while stack:
        node, done = stack.pop()
        kids = sorted(k for k in node if k != end)
        if not done:
            stack.append((node, True))
            stack.extend((node[k], False) for k in kids)
            continue
        parts = [] if end in node else ["$"]
        if not kids:
            parts.append(_ANY)
        else:
            controls = {k for k in kids if ord(k) < 0x20}
            split = controls <= {"\n"} and ('"' in node or "\\" in node)
            parts.append("[^" + "".join(_regex_char(k) for k in [*kids, *(["\x00"] if split else [])]) + "]")
            if split:
                parts.append(f"\\x00(?:$|{_ANY})")
        parts.extend(_regex_char(k) + out.pop(id(node[k])) for k in kids)
        out[id(node)] = "(?:" + "|".join(parts) + ")"
    return "^" + out[id(trie)]


# Names an object lists are added to the other open objects that list names, with their additionalProperties
# schema (the same meaning), so that every such object has the same pattern: llguidance merges the objects of an
# allOf or of a $ref with siblings pattern by pattern, and refuses two different patterns that overlap. Not past
# this many added names (each one a property more), nor for an object with min/maxProperties (llguidance counts
# optional properties there otherwise), nor where the additionalProperties schema sets a base URI or an anchor
# (copies would repeat it): those keep a pattern of their own names.
SHARED_NAMES_BUDGET = 512


def _schema_nodes(node: Any):
    """Every schema object in a schema (data values left out)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            yield node
            for key, value in node.items():
                if key in _DATA_KEYWORDS:
                    continue
                stack.extend(value.values() if key in _NAME_MAPS and isinstance(value, dict) else [value])


def _listed_open(node: dict) -> tuple[dict, Any] | None:
    """(the listed properties, the additionalProperties schema) of an object open to other names that lists some
    and has no patternProperties, or None."""
    listed, other = node.get("properties"), node.get("additionalProperties", True)
    if not isinstance(listed, dict) or not listed or other is False or node.get("patternProperties"):
        return None
    return listed, other


def _has_scope(node: Any) -> bool:
    return any(key in n for n in _schema_nodes(node) for key in _SCOPE_KEYWORDS)


def exact_other_names(schema: dict) -> dict:
    """For llguidance: a copy of the schema in which each object open to other properties (additionalProperties
    absent or not false) that lists properties is closed, its other names matched by one pattern, the complement
    of the listed names (of all such objects, see SHARED_NAMES_BUDGET), with the additionalProperties schema (see
    above). The same schema for every instance. Refused (GrammarCompileError naming the keyword and where):
    patternProperties beside additionalProperties other than false; beside patternProperties, a listed name with a
    control character or DEL (JsonQuote spells it more ways than the literal); a '$ref' that points into an
    additionalProperties, which moves."""
    def fail(why: str) -> GrammarCompileError:
        return GrammarCompileError(f"the JSON schema cannot be enforced exactly by the llguidance backend: {why}",
                                   param="json_schema")

    for node in _schema_nodes(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and "additionalproperties" in unquote(ref).lower():
            raise fail(f"'$ref' {json.dumps(ref)} (into an 'additionalProperties', which Atlas rewrites for this "
                       "backend)")
    shared: dict[str, None] = {}  # (the names of every open object that lists names, in order)
    opens = [found for found in map(_listed_open, _schema_nodes(schema)) if found]
    for listed, _ in opens:
        shared.update(dict.fromkeys(listed))
    if sum(len(shared) - len(listed) for listed, _ in opens) > SHARED_NAMES_BUDGET:
        shared = {}

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{where}/{i}") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                out[key] = value
            elif key in _NAME_MAPS and isinstance(value, dict):
                out[key] = {name: walk(sub, f"{where}/{key}/{name}") for name, sub in value.items()}
            else:
                out[key] = walk(value, f"{where}/{key}")
        patterns = out.get("patternProperties") if isinstance(out.get("patternProperties"), dict) else {}
        if patterns and out.get("additionalProperties", True) is not False:
            raise fail(f"'patternProperties' beside 'additionalProperties' other than false at {where} (llguidance's "
                       "rule for the other names takes \\u escapes, so a name a pattern matches could be spelled "
                       "past the pattern's schema); add \"additionalProperties\": false or list the names")
        if patterns and isinstance(out.get("properties"), dict):
            for name in out["properties"]:
                if any(ord(ch) < 0x20 or ch == "\x7f" for ch in name):
                    raise fail(f"property name {json.dumps(name)} at {where} beside 'patternProperties' (a control "
                               "character or DEL in a listed name, which llguidance's pattern rule spells otherwise)")
        found = _listed_open(out)
        if found:
            listed, other = found
            other = {} if other is True else other
            if any("\ud800" <= ch <= "\udfff" for name in listed for ch in name):
                raise fail(f"a property name with a lone surrogate at {where}")
            extra = [] if ("minProperties" in out or "maxProperties" in out or _has_scope(other)) else \
                [name for name in shared if name not in listed]
            out["properties"] = {**listed, **{name: other for name in extra}}
            out["patternProperties"] = {_other_than([*listed, *extra]): other}
            out["additionalProperties"] = False
        return out

    return walk(schema, "#")


# derivre (llguidance's regex library) quotes a pattern into JSON one character set at a time; for a set that holds
# every control character (or all but \n) it allows the escapes \" and \\ whether or not the set holds '"' and '\':
# `^[^"]*$` matched the string "a\"b" (llguidance 1.9). A pattern with such a set (a class, or single characters
# in alternation, which become one set) is refused for llguidance; a pattern Python's parser cannot read, or with
# Rust's class operators, is refused where it has a class or an alternation at all.
_ALL_ASCII = frozenset(range(128))
_CONTROLS = frozenset(range(32)) - {10}
_SPACE_SURE, _SPACE_MAY = frozenset(b"\t\n\v\f\r "), frozenset(b"\t\n\v\f\r \x1c\x1d\x1e\x1f")
_DIGITS = frozenset(b"0123456789")
_WORD = frozenset(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")


def _re_internals():
    """Python's regex parser and its constants (re._parser from 3.11, sre_parse before)."""
    try:
        from re import _constants, _parser
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_constants as _constants
        import sre_parse as _parser
    return _parser, _constants


def _one_char_sets(op, av) -> tuple[frozenset, frozenset] | None:
    """(the ASCII characters an item matching one character may match, those it surely matches), or None."""
    c = _re_internals()[1]

    if op is c.LITERAL:
        return frozenset({av}) & _ALL_ASCII, frozenset({av}) & _ALL_ASCII
    if op is c.NOT_LITERAL:
        return _ALL_ASCII - {av}, _ALL_ASCII - {av}
    if op is c.ANY:
        return _ALL_ASCII, _ALL_ASCII - {10, 13}
    if op is not c.IN:
        return None
    categories = {c.CATEGORY_DIGIT: (_DIGITS, _DIGITS), c.CATEGORY_NOT_DIGIT: (_ALL_ASCII - _DIGITS,) * 2,
                  c.CATEGORY_WORD: (_WORD, _WORD), c.CATEGORY_NOT_WORD: (_ALL_ASCII - _WORD,) * 2,
                  c.CATEGORY_SPACE: (_SPACE_MAY, _SPACE_SURE),
                  c.CATEGORY_NOT_SPACE: (_ALL_ASCII - _SPACE_SURE, _ALL_ASCII - _SPACE_MAY)}
    may, sure, negate = set(), set(), False
    for kind, value in av:
        if kind is c.NEGATE:
            negate = True
        elif kind is c.LITERAL:
            may |= {value} & _ALL_ASCII
            sure |= {value} & _ALL_ASCII
        elif kind is c.RANGE:
            span = set(range(value[0], min(value[1], 127) + 1))
            may |= span
            sure |= span
        elif kind is c.CATEGORY and value in categories:
            may |= categories[value][0]
            sure |= categories[value][1]
        else:
            may |= _ALL_ASCII  # (anything else: assume the worst)
    if negate:
        return _ALL_ASCII - sure, _ALL_ASCII - may
    return frozenset(may), frozenset(sure)


def _unsafe(sets: tuple[frozenset, frozenset] | None) -> bool:
    return sets is not None and sets[0] >= _CONTROLS and not {34, 92} <= sets[1]


def _items_unsafe(items) -> bool:
    c = _re_internals()[1]

    for op, av in items:
        if _unsafe(_one_char_sets(op, av)):
            return True
        inner = []  # (the item lists inside this item)
        if op is c.BRANCH:
            singles = [_one_char_sets(*alt[0]) for alt in av[1] if len(alt) == 1]
            singles = [s for s in singles if s is not None]
            if singles and _unsafe((frozenset().union(*(s[0] for s in singles)),
                                    frozenset().union(*(s[1] for s in singles)))):
                return True
            inner = av[1]
        elif op is c.SUBPATTERN:
            inner = [av[3]]
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
            inner = [av[2]]
        elif op in (c.ASSERT, c.ASSERT_NOT):
            inner = [av[1]]
        elif op is getattr(c, "ATOMIC_GROUP", None):
            inner = [av]
        elif op is c.GROUPREF_EXISTS:
            inner = [x for x in av[1:] if x]
        if any(_items_unsafe(x) for x in inner):
            return True
    return False


def json_quote_unsafe(pattern: str) -> bool:
    """Whether llguidance's JSON quoting of this pattern could let \\" or \\\\ through where the pattern has no
    '"' or '\\' (above)."""
    import warnings

    if not any(op in pattern for op in ("&&", "--", "~~", "[[")):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return _items_unsafe(_re_internals()[0].parse(pattern))
        except Exception:  # noqa: BLE001 - syntax Python's parser does not read (\p{...}, ...)
            pass
    return "[" in pattern or "|" in pattern


def refuse_json_quote_unsafe(schema: dict) -> None:
    """GrammarCompileError naming the first `pattern` or patternProperties pattern that json_quote_unsafe."""
    for node in _schema_nodes(schema):
        found = [("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            found += [("patternProperties", p) for p in node["patternProperties"]]
        for key, pattern in found:
            if json_quote_unsafe(pattern):
                raise GrammarCompileError(
                    f"the JSON schema cannot be enforced exactly by the llguidance backend: {key!r} "
                    f"{json.dumps(pattern)} has a character set holding every control character but not both '\"' "
                    "and '\\' (llguidance's JSON quoting of such a set lets \\\" and \\\\ through); write the "
                    "control characters it allows out", param="json_schema")
