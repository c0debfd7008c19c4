"""No property name repeats in an object of constrained JSON output (distinct_keys.py): a grammar cannot forbid
it in an object open to other names, so {"x": 1, "x": 2} was in its language, and the parsed {"x": 2} broke
minProperties 2. The DistinctKeys beside each JSON sequence's matcher clears the tokens that would write a used
name, exactly: it follows the bytes, takes rollbacks, and clears nothing else."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch
from conftest import assert_pages_returned

from atlas import LLM, SamplingParams
from atlas.sampling_params import StructuredOutputsParams
from atlas.structured.distinct_keys import DistinctKeys, KeyTable


def _pairs_unique(pairs):
    names = [k for k, _ in pairs]
    assert len(names) == len(set(names)), names
    return dict(pairs)


# ------------------------------------------------------------------ generation
OPEN_SCHEMAS = [
    # (llguidance: minProperties; the parsed {"x": 2} of {"x": 1, "x": 2} has one property)
    {"type": "object", "minProperties": 2, "additionalProperties": {"type": "integer"}},
    {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False,
     "minProperties": 2, "maxProperties": 3},
    # (xgrammar: an open object with a listed name)
    {"type": "object", "properties": {"a": {"type": "integer"}}},
]


def test_open_objects_at_temperature_one_never_repeat_a_name(qwen3_dir):
    """The byte-level random model at temperature 1, pushed towards short names and many of them (logit_bias on
    '"', 'x', ',' and '}'), with both engines. Without the tracker 20 of the 30 finished outputs repeated a name
    ({"x": -8, "x": 8, "x": 65}); now none does, and each one validates."""
    llm = LLM(model=str(qwen3_dir), kv_cache_memory="64MiB", max_model_len=256)
    tok = llm.get_tokenizer()
    route = llm.engine.structured.backend.compile
    assert [route(StructuredOutputsParams(json=s))[0] for s in OPEN_SCHEMAS] == ["llguidance", "llguidance",
                                                                                 "xgrammar"]
    bias = {tok.encode(c, add_special_tokens=False)[0]: b for c, b in (('"', 7.0), ("x", 4.0), (",", 5.0),
                                                                       ("}", 3.0))}
    specs = [*({"json": s} for s in OPEN_SCHEMAS), {"json_object": True}]
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, logit_bias=bias,
                             structured_outputs=specs[s % len(specs)]) for s in range(64)]
    outs = llm.generate([[5, 6, 7]] * len(params), params)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs), [o.outputs[0].error for o in outs]
    finished = [(o.outputs[0].text, specs[s % len(specs)]) for s, o in enumerate(outs)
                if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 20 and len({json.dumps(spec) for _, spec in finished}) == len(specs)
    several = 0
    for text, spec in finished:
        value = json.loads(text, object_pairs_hook=_pairs_unique)
        several += len(value) >= 3
        if "json" in spec:
            jsonschema.validate(value, spec["json"])
    assert several >= 8
    assert_pages_returned(llm)


# ------------------------------------------------------------------ the tracker against a reference
# A small vocabulary: every byte, and tokens that cross names: a whole name with its quotes, a value closing into
# the next name, escapes, a name's end and the next one's in one token, split UTF-8.
EXTRA = [b'x"', b'", "x"', b'", "', b'"x"', b"\\u0078", b"x\\", b'xy"', b'": 1, "y"', b'{"x": 1, "x"', b'"\xc3',
         b'\xa9"', b'y": 2, "x', b'"\\u0079"', b"\\n", b'\\"', b'"x": {"x": 1}, "x"', b'", "\\u', b"\\ud83d",
         b"\\ude00", b'\xf0\x9f\x98\x80"', b'"": 0, ""', b"1, ", b"}, ", b'"\\', b'x": 0}, {"x', b' "x"', b' "\\u0078"',
         b' "xy', b' "\\', b'\\\\\\', b'x\\n"', b'\\n": 1, "\\n"', b'""']
VOCAB = [bytes([b]) for b in range(256)] + EXTRA
EOS = len(VOCAB)


def _reference_repeats(text: bytes) -> bool:
    """Whether JSON text (a prefix of a document) repeats a name in an object, or writes a backslash in a name
    whose decoded text so far is a proper prefix of a name its object already has. Written plainly: the whole text
    each time, names decoded by Python's json."""
    objects: list = []  # per open container: a list of used names, or None (an array)
    expect = in_string = False
    raw = None  # a name's raw bytes so far, inside a name
    i = 0
    while i < len(text):
        c = text[i:i + 1]
        if in_string:
            if c == b"\\":
                if raw is not None:
                    so_far = json.loads(b'"' + raw + b'"').encode("utf-8", "surrogatepass")
                    if any(len(u) > len(so_far) and u.startswith(so_far) for u in objects[-1]):
                        return True
                    raw += text[i:i + 2]
                i += 2
                if i <= len(text) and text[i - 1:i] == b"u":
                    if raw is not None:
                        raw += text[i:i + 4]
                    i += 4
                continue
            if c == b'"':
                in_string = False
                if raw is not None:
                    name = json.loads(b'"' + raw + b'"').encode("utf-8", "surrogatepass")
                    if name in objects[-1]:
                        return True
                    objects[-1].append(name)
                    raw, expect = None, False
            elif raw is not None:
                raw += c
            i += 1
            continue
        if c == b'"':
            in_string = True
            raw = b"" if expect and objects and objects[-1] is not None else None
        elif c in b"{[":
            objects.append([] if c == b"{" else None)
            expect = c == b"{"
        elif c in b"}]":
            objects.pop()
            expect = False
        elif c == b",":
            expect = objects[-1] is not None
        elif c == b":":
            expect = False
        i += 1
    return False


NAMES = ["x", "xy", "y", "", "\u00e9", 'x"', "\n", "n", "\t", "t", "/", "\U0001f600"]


def _spell(name: str, rng: random.Random) -> str:
    """A JSON string literal of name, each character raw or escaped at random."""
    out = []
    for ch in name:
        short = json.dumps(ch)[1:-1]
        options = [short, f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else json.dumps(ch, ensure_ascii=True)[1:-1]]
        out.append(rng.choice(options))
    return '"' + "".join(out) + '"'


def _value(rng: random.Random, depth: int) -> str:
    kind = rng.randrange(5 if depth < 3 else 3)
    if kind == 0:
        return str(rng.randrange(100))
    if kind == 1:
        return _spell(rng.choice(NAMES + ["a b", "x\\"]), rng)
    if kind == 2:
        return "null"
    if kind == 3:
        return "[" + ", ".join(_value(rng, depth + 1) for _ in range(rng.randrange(3))) + "]"
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int = 0) -> str:
    items = [_spell(rng.choice(NAMES), rng) + rng.choice([":", ": "]) + _value(rng, depth)
             for _ in range(rng.randrange(5))]
    return "{" + rng.choice([",", ", "]).join(items) + "}"


def _tokenize(text: bytes, rng: random.Random) -> list[int]:
    tokens, i = [], 0
    while i < len(text):
        fits = [t for t in range(256, len(VOCAB)) if text.startswith(VOCAB[t], i)]
        t = rng.choice(fits) if fits and rng.random() < 0.7 else text[i]
        tokens.append(t)
        i += len(VOCAB[t])
    return tokens


@pytest.fixture(scope="module")
def json_grammar():
    xgrammar = pytest.importorskip("xgrammar")
    info = xgrammar.TokenizerInfo([*VOCAB, b"<eos>"], stop_token_ids=[EOS])
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(xgrammar.Grammar.builtin_json_grammar())
    return xgrammar, compiled


def _row(xgrammar, matcher) -> torch.Tensor:
    row = torch.full((1, (EOS + 1 + 31) // 32), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(row, 0)
    return row


def _allowed(row: torch.Tensor) -> set[int]:
    bits = row[0].numpy().view(np.uint32)
    return {t for t in range(EOS + 1) if bits[t >> 5] >> (t & 31) & 1}


def test_the_masks_clear_exactly_the_tokens_that_repeat_a_name(json_grammar):
    """Random documents (names from a small pool, each character raw or escaped at random, nested objects and
    arrays) cut into tokens of a vocabulary that crosses names: at every step, the tokens cleared from the JSON
    grammar's mask are exactly those after which the plain reference finds a repeated name (or an escape that
    could spell one); the documents are followed up to their first repeat, which is refused."""
    xgrammar, compiled = json_grammar
    table = KeyTable(VOCAB + [b""])
    special = [t for t in range(EOS) if b'"' in VOCAB[t] or b"\\" in VOCAB[t]]
    rng = random.Random(7)
    steps = refused = 0
    for _ in range(100):
        text = _object(rng).encode()
        tokens = _tokenize(text, rng)
        matcher, keys = xgrammar.GrammarMatcher(compiled), DistinctKeys(table)
        done = b""
        for t in tokens:
            row = _row(xgrammar, matcher)
            grammar = _allowed(row)
            keys.mask(row, 0)
            kept = _allowed(row)
            assert kept <= grammar
            cleared = grammar - kept
            assert cleared == {s for s in special if s in grammar and _reference_repeats(done + VOCAB[s])}, done
            assert keys.cleared == len(cleared)
            steps += 1
            if t in cleared:
                assert not keys.accept(t) and keys.count_accepted([t]) == 0
                refused += 1
                break
            assert matcher.accept_token(t) and keys.accept(t)
            done += VOCAB[t]
        else:
            assert done == text and not _reference_repeats(text)
    assert steps > 1000 and refused >= 20


def test_rollback_restores_the_state(json_grammar):
    """count_accepted leaves the state as it was; accept then rollback of k tokens gives back the same masks (the
    names a rolled-back token added, the objects it closed)."""
    xgrammar, compiled = json_grammar
    table = KeyTable(VOCAB + [b""])
    rng = random.Random(3)
    for _ in range(30):
        text = _object(rng).encode()
        tokens = _tokenize(text, rng)
        if _reference_repeats(text):
            continue
        keys = DistinctKeys(table)
        full = torch.full((1, (EOS + 1 + 31) // 32), -1, dtype=torch.int32)
        for j, t in enumerate(tokens):
            before = full.clone()
            keys.mask(before, 0)
            ahead = tokens[j:j + rng.randrange(1, 6)]
            assert keys.count_accepted(ahead) == len(ahead)
            for a in ahead:
                assert keys.accept(a)
            keys.rollback(len(ahead))
            after = full.clone()
            keys.mask(after, 0)
            assert torch.equal(before, after)
            assert keys.accept(t)
    # a refused token changes nothing
    keys = DistinctKeys(table)
    tokens = _tokenize(b'{"x": 1, "y": [{"x": 2}], "x', random.Random(0))
    assert keys.count_accepted(tokens) == len(tokens)
    for t in tokens:
        assert keys.accept(t)
    assert not keys.accept(ord('"')) and not keys.accept(VOCAB.index(b'": 1, "y"'))  # ("x" again)
    assert keys.accept(ord("y")) and keys.accept(ord('"'))
    keys.rollback(2)
    assert not keys.accept(ord('"'))
    with pytest.raises(ValueError, match="roll back"):
        keys.rollback(len(tokens) + 1)


# ------------------------------------------------------------------ in the step's masks, both engines
MODEL = "atlas/assets/default-model"


@pytest.fixture(scope="module")
def hf():
    from pathlib import Path

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parent.parent / MODEL))


def _step_rows(manager, grammar, drafts=()):
    """The step's bitmask rows of one sequence (a decode, or a verify of drafts), as the engine fills them."""
    from types import SimpleNamespace

    seq = SimpleNamespace(grammar=grammar, spec_token_ids=list(drafts))
    bitmask, _, _ = manager.fill_step_bitmask([seq], [len(drafts) + 1], [len(drafts)])
    return bitmask


def _ids(row: torch.Tensor) -> set[int]:
    bits = row.numpy().view(np.uint32)
    return {t for t in range(len(bits) * 32) if bits[t >> 5] >> (t & 31) & 1}


@pytest.mark.parametrize("backend,spec", [
    ("llguidance", {"json": {"type": "object", "minProperties": 2, "additionalProperties": {"type": "integer"}}}),
    ("xgrammar", {"json_object": True})])
def test_the_step_masks_lose_exactly_the_tokens_that_repeat_a_name(hf, backend, spec):
    from atlas.structured import StructuredOutputManager

    manager = StructuredOutputManager(hf, len(hf), [hf.eos_token_id], backend=backend)
    table = manager.key_table()
    grammar = manager.request_grammar(StructuredOutputsParams(**spec))
    grammar.compiled.result()
    grammar.start()
    prefix = hf.encode('{"x": 1, "', add_special_tokens=False)
    assert grammar.accept(prefix) == len(prefix)
    own = torch.full((1, manager.words), -1, dtype=torch.int32)
    grammar.matcher.fill_bitmask(own, 0)
    row = _step_rows(manager, grammar)[0]
    repeats = {t for t in _ids(own[0]) if table.token_bytes[t].startswith((b'x"', b"\\"))}
    assert repeats and _ids(row) == _ids(own[0]) - repeats
    # A verify's rows: the state now, then after the draft "x" (where '"' would repeat the name).
    x, quote = (hf.encode(c, add_special_tokens=False)[0] for c in 'x"')
    assert grammar.check_drafts([x, quote]) == 1 and grammar.error is None
    rows = _step_rows(manager, grammar, [x])
    assert torch.equal(rows[0], row)
    assert quote not in _ids(rows[1]) and hf.encode("y", add_special_tokens=False)[0] in _ids(rows[1])
    assert grammar.accept([x]) == 1 and grammar.accept([quote]) == 0
    assert "repeats a property name" in grammar.error


def test_a_state_whose_only_continuations_repeat_a_name_ends_with_an_error(hf):
    """Names must match ^x$ and there must be two: after {"x": 1, "x nothing continues; the sequence ends with
    the grammar's error, naming the repeat, not with a duplicate."""
    from atlas.structured import StructuredOutputManager

    manager = StructuredOutputManager(hf, len(hf), [hf.eos_token_id], backend="llguidance")
    schema = {"type": "object", "patternProperties": {"^x$": {"type": "integer"}}, "additionalProperties": False,
              "minProperties": 2}
    grammar = manager.request_grammar(StructuredOutputsParams(json=schema))
    grammar.compiled.result()
    grammar.start()
    prefix = hf.encode('{"x": 1, "x', add_special_tokens=False)
    assert grammar.accept(prefix) == len(prefix)
    row = _step_rows(manager, grammar)[0]
    assert not _ids(row)
    assert "without repeating a property name" in grammar.error


# ------------------------------------------------------------------ schemas whose objects are all closed
CLOSED = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "additionalProperties": False}


def test_schemas_with_only_closed_objects_need_no_tracker():
    """Where every schema that may take an object closes it (or only defers to others), the engines write each
    listed name once: the sequences get no DistinctKeys. Anything that may be an open object keeps one."""
    from atlas.structured.distinct_keys import names_cannot_repeat

    other = {"type": "object", "properties": {"c": {"enum": [{"x": 1}]}}, "additionalProperties": False}
    for schema in (CLOSED, {"type": "array", "items": {"$ref": "#/$defs/A"}, "$defs": {"A": CLOSED}},
                   {"anyOf": [CLOSED, other]}, {"allOf": [CLOSED, other], "title": "t"}, {"type": "string"},
                   {"enum": [{"x": 1}, 2]}, {"type": ["array", "null"], "items": {"type": "integer"}}):
        assert names_cannot_repeat(schema), schema
    for schema in ({}, {"title": "any"}, {"type": "object"}, {"type": "array", "items": {}}, {"type": "array", "items": True},
                   {**CLOSED, "additionalProperties": {"type": "integer"}},
                   {**CLOSED, "patternProperties": {"^x": {}}}, {"maxLength": 2},
                   {"type": ["object", "null"]}, {"$ref": "https://example.com/s.json"},
                   {"type": "object", "$ref": "#/$defs/A", "$defs": {"A": CLOSED}},
                   {"type": "array", "items": {"anyOf": [CLOSED, {"type": "object"}]}},
                   {**CLOSED, "properties": {"a": {"type": "object", "properties": {}}}}):
        assert not names_cannot_repeat(schema), schema


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_the_engines_write_a_closed_objects_names_once(hf, backend):
    """What names_cannot_repeat relies on: a closed object's listed names come once each, in order, however
    spelled, through either engine (so a repeat there is refused by the grammar itself)."""
    from test_json_schema import _byte_tokens

    from atlas.structured import StructuredOutputManager

    manager = StructuredOutputManager(hf, len(hf), [hf.eos_token_id], backend=backend)
    ids = _byte_tokens(hf)
    schemas = [CLOSED, {"type": "array", "items": {"$ref": "#/$defs/A"}, "$defs": {"A": CLOSED}},
               {"anyOf": [CLOSED, {"type": "object", "properties": {"c": {"type": "integer"}},
                                   "additionalProperties": False}]}]
    if backend == "llguidance":
        schemas.append({"allOf": [CLOSED, {"type": "object", "properties": {"a": {"type": "integer"},
                                                                            "b": {"type": "integer", "minimum": 0}},
                                           "additionalProperties": False}]})
    for schema in schemas:
        grammar = manager.request_grammar(StructuredOutputsParams(json=schema))
        grammar.start()
        assert grammar.keys is None
        wrap = (lambda d: b"[" + d + b"]") if schema.get("type") == "array" else (lambda d: d)
        for doc, ok in ((b'{"a": 1, "b": 2}', True), (b'{"a": 1, "a": 2}', False), (b'{"a": 1, "b": 2, "a": 3}', False),
                        (b'{"b": 1, "a": 2}', False), (b'{"a": 1, "\\u0061": 2}', False)):
            tokens = [*(ids[b] for b in wrap(doc)), hf.eos_token_id]
            assert (grammar.check_drafts(tokens) == len(tokens)) == ok, (schema, doc)
    for spec in ({"json": {"type": "object"}}, {"json_object": True}):
        grammar = manager.request_grammar(StructuredOutputsParams(**spec))
        grammar.start()
        assert grammar.keys is not None
