"""The xgrammar grammar engine (--structured-outputs-backend xgrammar): the lower per-token host cost, but it
drops JSON-schema keywords it does not implement without an error, so Atlas refuses every keyword outside the
subset checked over the JSON Schema Test Suite (json_schema.xgrammar_unsupported) before xgrammar sees it.
"""

from __future__ import annotations

import json
import re

import torch

from atlas.sampling_params import StructuredOutputsParams
from atlas.structured.json_schema import (
    GrammarCompileError,
    parse_schema,
    string_length_bounds,
    xgrammar_unsupported,
)

# JSON output has one layout: json.dumps's separators (", " and ": "; "," and ":" with disable_any_whitespace),
# no newlines. Free whitespace lets a weak model spend its whole budget on blanks: on the default model,
# 80 greedy tokens of a 3-field schema were mostly runs of spaces and no document was complete.
_SEPARATORS = {False: (", ", ": "), True: (",", ":")}
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "; the rest is what the user needs.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a dependency of atlas
        raise GrammarCompileError("structured outputs need the xgrammar package (pip install xgrammar)",
                                  param="structured_outputs") from exc
    return xgrammar


# xgrammar's failed internal checks read "Check failed: (<C++ condition>) is false: <the reason>": the reason only.
_CHECK_FAILED = re.compile(r"Check failed: .*? is false:\s*")


def _clean(message: str) -> str:
    lines = [_CHECK_FAILED.sub("", _LOG_PREFIX.sub("", line)).strip() for line in str(message).strip().splitlines()]
    lines = [line for line in lines if line and not line.startswith("Stack trace")]
    return "; ".join(lines[:3]) or "it does not compile"


# xgrammar writes a string with minLength/maxLength as `X ::= "\"" X_characters{m, n} "\""` with
# `X_characters ::= [^"\\\r\n]`, which lets raw control characters in and no escape. Atlas writes X itself, one
# JSON string character at a time, which is one code point of the decoded string: any code point but the control
# characters, '"', '\' and the surrogates (xgrammar's classes match decoded UTF-8 and refuse overlong forms, but
# take \xed\xa0\x80 as U+D800 unless told), or an escape: \uXXXX of a non-surrogate, or an escaped surrogate
# pair, which Python's json decodes to one code point. A lone escaped surrogate, which Python's json accepts and
# strict parsers (I-JSON, RFC 7493) do not, is left out.
# The count is a chain of rules, one per character left (atlas_json_upto_k: at most k more, then the closing
# quote), not xgrammar's {m, n} over that character: a repetition of anything but one character class makes
# xgrammar parse every token for every mask (17 ms a mask at 8,192 tokens for {0, 12}, 100 ms at 32,768;
# the chain's take 6-30 us at 8,192 tokens, 70-190 at 32,768). Each rule costs a pass over the vocabulary when the grammar compiles
# (about 1 us a token: 9 ms a rule at 8,192 tokens, 37 ms at 32,768), so the rules are capped below.
_XGR_LENGTH_RULE = re.compile(r'^(\S+) ::= \(\("\\"" (\S+_characters)\{(\d+), (-1|\d+)\} "\\""\)\)$')
_XGR_LENGTH_CHARACTER = r'(([^\"\\\r\n]))'
_PLAIN = r'[^\0-\x1f"\\\uD800-\uDFFF]'
_JSON_ESCAPE_RULES = r"""
atlas_json_escape ::= ["\\/bfnrt] | "u" atlas_json_bmp | "u" [dD] [89abAB] atlas_json_hex atlas_json_hex "\\u" [dD] [c-fC-F] atlas_json_hex atlas_json_hex
atlas_json_bmp ::= [0-9a-cA-CeEfF] atlas_json_hex atlas_json_hex atlas_json_hex | [dD] [0-7] atlas_json_hex atlas_json_hex
atlas_json_hex ::= [0-9a-fA-F]
"""
# Chain rules times vocabulary size a schema may ask for: about 2 s of compile (a 150k vocabulary: maxLength 12).
LENGTH_RULE_BUDGET = 1 << 21


def length_rule_count(bounds: set[tuple[int, int]]) -> int:
    """How many chain rules the bounded strings (minLength, maxLength or -1) take (see length_rules)."""
    upto = max((hi - lo for lo, hi in bounds if hi >= 0), default=-1) + 1
    return upto + any(hi < 0 for _, hi in bounds) + sum({(lo, hi): lo for lo, hi in bounds}.values())


def over_length_budget(bounds: set[tuple[int, int]], vocab_size: int) -> str | None:
    """Why the bounded strings would cost xgrammar too long a compile on this vocabulary, or None."""
    rules = length_rule_count(bounds)
    if rules * vocab_size <= LENGTH_RULE_BUDGET:
        return None
    return (f"string length bounds that need {rules} grammar rules (one per character counted), more than "
            f"{LENGTH_RULE_BUDGET // vocab_size} on a vocabulary of {vocab_size} tokens")


def _tail(lo: int, hi: int) -> str:
    return "atlas_json_rest" if hi < 0 else f"atlas_json_upto_{hi - lo}"


def length_rules(bounds: set[tuple[int, int]]) -> list[str]:
    """The rules of bounded strings: atlas_json_upto_k (at most k characters, then the closing quote),
    atlas_json_rest (any number), atlas_json_min_j_<tail> (j characters, then the tail)."""
    step = f'{_PLAIN} {{next}} | "\\\\" atlas_json_escape {{next}}'
    rules = []
    upto = max((hi - lo for lo, hi in bounds if hi >= 0), default=-1)
    for k in range(upto + 1):
        rules.append('atlas_json_upto_0 ::= "\\""' if k == 0 else
                     f'atlas_json_upto_{k} ::= "\\"" | ' + step.format(next=f"atlas_json_upto_{k - 1}"))
    if any(hi < 0 for _, hi in bounds):
        rules.append('atlas_json_rest ::= "\\"" | ' + step.format(next="atlas_json_rest"))
    for lo, hi in sorted(bounds):
        for j in range(1, lo + 1):
            after = _tail(lo, hi) if j == 1 else f"atlas_json_min_{j - 1}_{_tail(lo, hi)}"
            rules.append(f"atlas_json_min_{j}_{_tail(lo, hi)} ::= " + step.format(next=after))
    return rules


def _rule_lines(ebnf: str) -> list[tuple[str, str, str]] | None:
    """xgrammar's EBNF text as (name, " ::= ", body) per line, or None where a line is not one named rule."""
    rules = [line.partition(" ::= ") for line in ebnf.strip().splitlines()]
    if any(not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) for name, sep, _ in rules):
        return None
    return rules


# (where a JSON schema the xgrammar backend cannot enforce goes instead: llguidance for the JSON path; nowhere for the
# schemas of structural tags, which only xgrammar compiles)
_ELSEWHERE = {"json_schema": "; --structured-outputs-backend llguidance enforces them", "structural_tag": ""}


def _refusal(what: str, why: str, param: str = "json_schema") -> GrammarCompileError:
    """A rewrite of xgrammar's grammar text that met a form it was not written for: the schema is refused."""
    return GrammarCompileError(f"the JSON schema's {what} cannot be enforced exactly by the xgrammar backend "
                               f"({why}{_ELSEWHERE.get(param, '')})", param=param)


def exact_string_lengths(ebnf: str, bounds: set[tuple[int, int]], param: str = "json_schema") -> str:
    """xgrammar's EBNF of a JSON schema with each of its length-bounded string rules counting JSON characters
    (above). `bounds`: the schema's (minLength, maxLength) pairs. Refused (GrammarCompileError) wherever the text
    is not in the form this was written for, so that a different xgrammar cannot slip its own rule through."""
    def fail(why: str) -> GrammarCompileError:
        return _refusal("string length bounds", why, param)

    rules = _rule_lines(ebnf)
    if rules is None:
        raise fail("xgrammar's grammar is not one rule a line")
    if any(name.startswith("atlas_json_") for name, _, _ in rules):
        raise fail("a rule name of xgrammar's is one of Atlas's")
    characters = {name for name, _, body in rules if body == _XGR_LENGTH_CHARACTER}
    used, out = {}, []
    for name, _, body in rules:
        found = _XGR_LENGTH_RULE.match(f"{name} ::= {body}")
        if found:
            lo, hi = int(found[3]), int(found[4])
            if found[2] not in characters or (lo, hi) not in bounds:
                raise fail(f"rule {name} is not a bounded string of the schema")
            used[found[2]] = used.get(found[2], 0) + 1
            first = f"atlas_json_min_{lo}_{_tail(lo, hi)}" if lo else _tail(lo, hi)
            out.append(f'{name} ::= (("\\"" {first}))')
        elif name not in characters:
            if _XGR_LENGTH_CHARACTER in body:
                raise fail("a string rule of xgrammar's that Atlas does not know")
            out.append(f"{name} ::= {body}")
    for name in characters:  # (each used only in the bounded-string form, nowhere else)
        if len(re.findall(rf"\b{name}\b", ebnf)) != used.get(name, 0) + 1:
            raise fail(f"rule {name} is used otherwise than as a bounded string")
    return "\n".join([*out, *length_rules(bounds)]) + "\n" + _JSON_ESCAPE_RULES.lstrip()


# xgrammar's unbounded JSON string (every `{"type": "string"}`, property names, the strings of json_object mode):
#   basic_escape ::= (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))
#   basic_string_sub ::= (("\"") | ([^\0-\x1f\"\\\r\n] basic_string_sub) | ("\\" basic_escape basic_string_sub)) (=...)
# and, for the names of the properties an open object does not list, a trie of "string states" that exclude
# the listed names' characters one at a time ([^\0-\x1f\"\\\r\nab] basic_string_sub | "a" state_2 | ...). Its class
# takes encoded surrogates (\xed\xa0\x80: invalid UTF-8, replacement characters for the user) and its escape lone
# escaped surrogates (\ud800). Atlas keeps the shape and swaps the parts: the class also excludes U+D800-U+DFFF,
# the escape is atlas_json_escape's (above). A trie state that continues a listed name loses its escape
# alternative: an escape there could spell the name (\u0061b is "ab") and slip a listed property past its schema;
# such names are only written unescaped (a subset, so exact). The shape is the same (a right-recursive rule over
# one class, no repetition), so the mask cost is xgrammar's own: on a 32,768-token byte-level BPE, 27-28 us a mask
# inside a string either way, 36-66 in json_object's strings, 36-81 in an open object's names and values (medians
# of alternating rounds on the same prefixes; 10-20 us at 8,192 tokens); the compile through the text takes what
# compile_json_schema takes (5 ms against 15 for {"type": "string"}, 142 against 139 for an open object).
_XGR_ESCAPE = '(([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
_XGR_CLASS = '[^\\0-\\x1f\\"\\\\\\r\\n'  # (the start of every string-state class; the listed names' characters follow)
_SURROGATES = '\\uD800-\\uDFFF'
# A listed name's character in a trie: printable ASCII but '"' and '\\' (raw, or \- \] \^ in a class). Anything else
# (a quote, a backslash, a control or non-ASCII character, which xgrammar's trie takes raw or byte by byte) is
# refused; json_schema.xgrammar_unsupported refuses such names first.
_NAME_CLASS_CHARS = re.compile(r'(?:[ !#-\[^-~]|\\[-\]^])*')
_NAME_STEP = re.compile(r'"[ !#-\[\]-~]" [A-Za-z_][A-Za-z0-9_]*')
_CLASS_STEP = re.compile(re.escape(_XGR_CLASS) + r'((?:\\.|[^\]\\])*)\] basic_string_sub')
# A class anywhere else: not negated, printable ASCII (escapes of printable characters only, no \x \u \U \0).
_ASCII_CLASS = re.compile(r'\[(?:[ -\[\]-~]|\\[ -/:-TV-tv-w{-~])*\]')
_PIECES = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\s+\|\s+|[()]|[^\s"\[()|]+|\s+')


def _alternatives(body: str) -> tuple[list[str], str] | None:
    """A rule body `((a) | (b) ...) (=lookahead)` -> (["a", "b", ...], " (=lookahead)" or ""), or None."""
    pieces = _PIECES.findall(body)
    if "".join(pieces) != body or not pieces or pieces[0] != "(":
        return None
    depth, alts, start, end = 0, [], 1, None
    for i, piece in enumerate(pieces):
        if piece == "(":
            depth += 1
        elif piece == ")":
            depth -= 1
            if depth == 0:
                end = i
                break
        elif depth == 1 and piece.strip() == "|":
            alts.append("".join(pieces[start:i]))
            start = i + 1
    if end is None:
        return None
    alts.append("".join(pieces[start:end]))
    if any(not (a.startswith("(") and a.endswith(")")) for a in alts):
        return None
    return [a[1:-1] for a in alts], "".join(pieces[end + 1:])


def exact_json_strings(ebnf: str, param: str = "json_schema") -> str:
    """xgrammar's EBNF of a JSON schema with its unbounded JSON strings made exact (above). Refused
    (GrammarCompileError) wherever the text is not in the form this was written for."""
    def fail(why: str) -> GrammarCompileError:
        return _refusal("strings", why, param)

    rules = _rule_lines(ebnf)
    if rules is None:
        raise fail("xgrammar's grammar is not one rule a line")
    names = {name for name, _, _ in rules}
    out, escapes = [], False
    for name, _, body in rules:
        if name.startswith("atlas_json_"):  # (Atlas's own, from exact_string_lengths)
            out.append(f"{name} ::= {body}")
            continue
        if name == "basic_escape":
            if body != _XGR_ESCAPE:
                raise fail("xgrammar's escape rule is not the one Atlas knows")
            out.append(f"{name} ::= ((atlas_json_escape))")
            escapes = True
            continue
        pieces = _PIECES.findall(body)
        if "".join(pieces) != body:
            raise fail(f"rule {name} is not in the form Atlas reads")
        if not any(p.startswith(_XGR_CLASS) or p == "basic_escape" for p in pieces):
            # (no string here: the classes must not take a character Atlas did not check)
            for piece in pieces:
                if piece.startswith("[") and (piece.startswith("[^") or not _ASCII_CLASS.fullmatch(piece)):
                    raise fail(f"rule {name} has a character class Atlas does not know, {piece}")
            out.append(f"{name} ::= {body}")
            continue
        parsed = _alternatives(body)
        if parsed is None:
            raise fail(f"rule {name} is not a string rule in the form Atlas knows")
        alts, tail = parsed
        continues = any(_NAME_STEP.fullmatch(a) and a.rpartition(" ")[2] in names for a in alts)
        kept = []
        for alt in alts:
            step = _CLASS_STEP.fullmatch(alt)
            if alt == '"\\""':
                kept.append(alt)
            elif alt == '"\\\\" basic_escape basic_string_sub':
                if not continues:
                    kept.append(alt)
            elif step and _NAME_CLASS_CHARS.fullmatch(step[1]):
                kept.append(f"{_XGR_CLASS}{step[1]}{_SURROGATES}] basic_string_sub")
            elif _NAME_STEP.fullmatch(alt) and alt.rpartition(" ")[2] in names:
                kept.append(alt)
            else:
                raise fail(f"rule {name} has an alternative Atlas does not know, ({alt})")
        if name == "basic_string_sub" and len(kept) != 3:
            raise fail("xgrammar's string rule is not the one Atlas knows")
        out.append(f"{name} ::= (" + " | ".join(f"({a})" for a in kept) + ")" + tail)
    if not escapes and "basic_escape" in ebnf:
        raise fail("xgrammar's escape rule is missing")
    if escapes and "atlas_json_escape ::=" not in ebnf:
        out.append(_JSON_ESCAPE_RULES.strip())
    return "\n".join(out) + "\n"


def exact_json_grammar(schema: dict, bounds: set[tuple[int, int]], options: dict, param: str = "json_schema") -> str:
    """The EBNF that the xgrammar backend compiles for a JSON schema inside xgrammar's checked subset, after
    string_length_bounds (`bounds`: its length-bounded strings): xgrammar's grammar of the schema (from_json_schema
    with `options`) with Atlas's exact strings (exact_string_lengths, exact_json_strings). Refused
    (GrammarCompileError with `param`) where the text is not xgrammar's grammar exactly or not in the form the
    rewrites know."""
    xgr = _xgrammar()
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), **options))
    # (the text is xgrammar's grammar exactly: it reads its own printout back unchanged)
    if str(xgr.Grammar.from_ebnf(ebnf)) != ebnf:
        elsewhere = " (--structured-outputs-backend llguidance enforces them)" if param == "json_schema" else ""
        raise GrammarCompileError("the JSON schema's grammar does not print exactly in this xgrammar version, so its "
                                  f"strings cannot be made exact{elsewhere}", param=param)
    if bounds:
        ebnf = exact_string_lengths(ebnf, bounds, param)
    return exact_json_strings(ebnf, param)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams, checked: bool = False):
        """(checked: the compile guard's trial passed; xgrammar's compile has no separate checks to skip)"""
        kind = spec.kind
        compiler = self.compiler
        try:
            if kind in ("json", "json_object"):
                schema = parse_schema(spec.json) if kind == "json" else {"type": "object"}
                why = xgrammar_unsupported(schema)
                if why:
                    raise GrammarCompileError(
                        f"the JSON schema cannot be enforced by the xgrammar backend: {why} is outside what it "
                        "enforces exactly (--structured-outputs-backend llguidance takes more)", param="json_schema")
                schema, bounds = string_length_bounds(schema)
                too_costly = over_length_budget(bounds, self.vocab_size)
                if too_costly:
                    raise GrammarCompileError(
                        f"the JSON schema cannot be enforced by the xgrammar backend: {too_costly} (each rule costs "
                        "a pass over the vocabulary when it compiles; --structured-outputs-backend llguidance takes "
                        "more)", param="json_schema")
                # strict_mode off: properties the schema leaves open stay allowed, as JSON Schema (and llguidance)
                # have it.
                options = {"any_whitespace": False, "strict_mode": False,
                           "separators": _SEPARATORS[spec.disable_any_whitespace]}
                return compiler.compile_grammar(exact_json_grammar(schema, bounds, options))
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if kind == "structural_tag":
                from atlas.structured.structural_tag import normalize_structural_tag

                tag = normalize_structural_tag(spec.structural_tag)  # (checked: only formats it knows)
                return compiler.compile_structural_tag(json.dumps(self.exact_structural_tag(tag)))
            return compiler.compile_grammar(spec.grammar)
        except GrammarCompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError for bad input
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "structural_tag": "structural tag"}[kind]
            raise GrammarCompileError(f"the {what} cannot be compiled: {_clean(exc)}", param=kind) from None

    def exact_structural_tag(self, tag: dict) -> dict:
        """A normalised structural tag (structural_tag.normalize_structural_tag) with each json_schema format
        replaced by a grammar format holding that schema's grammar with Atlas's exact strings (exact_json_grammar):
        xgrammar compiles a json_schema format with its own string rule, which takes lone escaped surrogates
        ("\\ud800") and encoded ones (\\xed\\xa0\\x80). The grammar is the one xgrammar makes for the format
        (from_json_schema in strict mode with the format's whitespace bound, the JSON Schema meaning kept by
        normalize_structural_tag's explicit additionalProperties), rewritten as on the JSON path; a schema whose
        grammar the rewrites do not know is refused, naming where it is."""
        from atlas.structured.structural_tag import FORMATS

        found: list[tuple[dict, str, dict, set[tuple[int, int]]]] = []

        def walk(node: dict, where: str) -> dict:
            out = dict(node)
            if node.get("type") == "json_schema":
                schema, bounds = string_length_bounds(node["json_schema"])
                found.append((out, where, schema, bounds))
                return out
            one, many, _ = FORMATS[node["type"]]
            for key in one:
                out[key] = walk(node[key], f"{where}.{key}")
            for key in many:
                out[key] = [walk(v, f"{where}.{key}[{i}]") for i, v in enumerate(node[key])]
            return out

        exact = {**tag, "format": walk(tag["format"], "format")}
        # (each schema's grammar has its own rules: the length rules of all of them count against the budget)
        rules = sum(length_rule_count(bounds) for _, _, _, bounds in found if bounds)
        if rules * self.vocab_size > LENGTH_RULE_BUDGET:
            raise GrammarCompileError(
                f"the structural tag cannot be enforced: its JSON schemas have string length bounds that need {rules} "
                f"grammar rules (one per character counted), more than {LENGTH_RULE_BUDGET // self.vocab_size} on a "
                f"vocabulary of {self.vocab_size} tokens (each rule costs a pass over the vocabulary when it compiles)",
                param="structural_tag")
        for out, where, schema, bounds in found:
            options = {"any_whitespace": True, "strict_mode": True, "max_whitespace_cnt": out["max_whitespace_cnt"]}
            try:
                ebnf = exact_json_grammar(schema, bounds, options, param="structural_tag")
            except GrammarCompileError as exc:
                raise GrammarCompileError(f"the structural tag cannot be enforced: at {where}.json_schema, {exc}",
                                          param="structural_tag") from None
            out.clear()
            out.update({"type": "grammar", "grammar": ebnf})
        return exact

    def matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(_xgrammar().GrammarMatcher(compiled))

    def compiled_bytes(self, compiled, spec: StructuredOutputsParams) -> int:
        """The compiled grammar's memory as xgrammar reports it (its token-mask cache included)."""
        return int(compiled.memory_size_bytes)

    def fill_batch(self, matchers: list[XGrammarMatcher], rows: list[int], bitmask: torch.Tensor) -> None:
        """Each matcher's current mask into its row of `bitmask`."""
        for m, row in zip(matchers, rows, strict=True):
            m._m.fill_next_token_bitmask(bitmask, row)


class XGrammarMatcher:
    engine = "xgrammar"

    def __init__(self, matcher):
        self._m = matcher
        self._dead = False

    def accept_token(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def count_accepted(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if self._m.is_terminated() or not self._m.accept_token(t):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def dead(self) -> str | None:
        return None  # (xgrammar has no error state: an empty mask row tells, see RequestGrammar.fill_rows)
