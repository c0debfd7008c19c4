"""Distinct property names in constrained JSON output.

A grammar cannot forbid a repeated property name in an object whose other names are open (additionalProperties,
patternProperties): {"x": 1, "x": 2} is in its language. JSON parsers keep one of the two values (Python's json the
last), so the parsed object may break the schema the output was constrained to (minProperties 2: {"x": 2} has one
property), and strict parsers (I-JSON, RFC 7493) refuse the text. So every JSON sequence whose schema may have
such an object (names_cannot_repeat) also has a DistinctKeys beside its grammar matcher: it follows the bytes of the tokens the sequence keeps (the object nesting,
the names each open object has used, whether the output is inside a name and what that name decodes to so far) and
takes out of each mask the tokens that would write a name its object already has:

- inside a name whose decoded text so far, P, begins a used name N (and before a name, P empty, for the tokens
  that open it after whitespace): the tokens that spell the rest of N raw and the closing quote, and every token
  that writes a backslash while the name is still a proper prefix of a used one (an escape could spell N another
  way: \\u0078 is "x"). Both are found by the bytes before the token's first quote or backslash (KeyTable);
- a token with two or more quotes or backslashes that the grammar allows and that can reach another name from
  the state (one token can close a value and write a whole name, `", "x"`; KeyTable.touching): its bytes are run
  from the current state and it is taken out if they complete a used name or escape a prefix of one. A token with
  one quote or backslash or none cannot reach a name past the one the first bullet covers.

No name repeats, however it is spelled and however the tokens cut it. What else is taken away is the escapes in a
name while it is a proper prefix of a used one: such a name is written raw, and a name that needs an escape there
(a quote, a backslash, a control character) cannot be written at that point; every output left is still in the
grammar's language. A state whose every continuation is taken away has an empty mask, which ends the sequence with
the grammar's error (grammar.RequestGrammar.note_if_dead). The tracker only reads JSON the grammar accepted; it
stays total on any bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_OUT, _STRING, _NAME = 0, 1, 2  # between tokens of the structure, in a string value, in a property name
_QUOTE, _BACKSLASH = 0x22, 0x5C
_SHORT = {0x62: b"\b", 0x66: b"\f", 0x6E: b"\n", 0x72: b"\r", 0x74: b"\t"}  # (\" \\ \/ and others: the byte itself)
_HEX = {c: int(chr(c), 16) for c in b"0123456789abcdefABCDEF"}
_WHITESPACE = frozenset(b" \t\n\r")
_STRUCTURE = frozenset(b'"\\{}[],:')
# Entries of KeyTable.repeating's cache (per kind of lookup).
REPEATING_ENTRIES = 1 << 16
# Undo records kept (a rollback goes back over drafts only: a few tokens).
MAX_ROLLBACK = 256


def _specials(data: bytes) -> int:
    return data.count(b'"') + data.count(b"\\")


def _first_special(data: bytes, start: int) -> int:
    """Where the first quote or backslash from `start` is, or -1."""
    q, e = data.find(b'"', start), data.find(b"\\", start)
    return q if e < 0 or 0 <= q < e else e


# Keywords a schema may have beside those that only defer to other schemas, each checked on its own.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "$schema", "deprecated",
                          "readOnly", "writeOnly", "$defs", "definitions"})
_DEFERRING = frozenset({"$ref", "anyOf", "oneOf", "allOf"})
_DATA = ("const", "enum", "default", "examples")
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def names_cannot_repeat(schema: Any) -> bool:
    """Whether no object of a JSON schema's outputs can repeat a name, whatever the grammar engine: every schema in
    it that may take an object closes it (additionalProperties false and no patternProperties: both engines write the
    listed names each once, in the schema's order; tests/test_distinct_keys.py checks that they refuse a repeat) or
    only defers to others (a local $ref, anyOf, oneOf, allOf: those are checked themselves), and no schema is `true`
    (any value; any `true` counts). Then the sequence needs no DistinctKeys. Anything else keeps one."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if node is True:
            return False
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        may_be_object = "const" not in node and "enum" not in node and (
            types is None or types == "object" or isinstance(types, list) and "object" in types)
        if may_be_object:
            closed = node.get("additionalProperties") is False and not node.get("patternProperties")
            ref = node.get("$ref")
            defers = bool(node.keys() & _DEFERRING) and node.keys() - _ANNOTATIONS <= _DEFERRING and (
                ref is None or isinstance(ref, str) and ref.startswith("#"))
            if not closed and not defers:
                return False
        for key, value in node.items():
            if key not in _DATA:
                stack.extend(value.values() if key in _NAME_MAPS and isinstance(value, dict) else [value])
    return True


class KeyTable:
    """The vocabulary's token byte strings arranged for DistinctKeys (one per tokenizer and vocabulary): the tokens
    by the bytes before their first quote or backslash, and the tokens with two or more of them."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        # (the bytes before the first quote or backslash -> the tokens where it is a quote; a backslash. And the
        #  same for the bytes after a first quote that only whitespace comes before: a name the token opens.)
        lookups: tuple[dict[bytes, list[int]], ...] = ({}, {}, {}, {})
        for i, b in enumerate(token_bytes):
            first = _first_special(b, 0)
            if first < 0:
                continue
            lookups[b[first] == _BACKSLASH].setdefault(b[:first], []).append(i)
            if b[first] == _QUOTE and not b[:first].strip(b" \t\n\r"):
                second = _first_special(b, first + 1)
                if second >= 0:
                    lookups[2 + (b[second] == _BACKSLASH)].setdefault(b[first + 1:second], []).append(i)
        self.quote_first, self.escape_first, self.open_quote_first, self.open_escape_first = (
            {k: tuple(v) for k, v in d.items()} for d in lookups)
        # (the lengths of the escape lookups' keys: the prefixes of a used name worth looking up)
        self.escape_lengths, self.open_escape_lengths = (sorted({len(k) for k in d}) for d in lookups[1::2])
        self._repeating: tuple[dict[bytes, tuple[int, ...]], dict[bytes, tuple[int, ...]]] = ({}, {})
        self.multi_ids = [i for i, b in enumerate(token_bytes) if _specials(b) >= 2]
        self.plain = [not any(c in _STRUCTURE for c in b) for b in token_bytes]  # (nothing the tracker reads)
        self._touching: dict[tuple, tuple[list[int], np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> KeyTable:
        """The bytes each token writes (xgrammar's reading of the tokenizer, the one its matchers use); stop and
        special tokens write none."""
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        token_bytes = [bytes(b) for b in info.decoded_vocab][:vocab_size]
        token_bytes += [b""] * (vocab_size - len(token_bytes))
        for i in [*stop_token_ids, *info.special_token_ids]:
            if 0 <= i < vocab_size:
                token_bytes[i] = b""
        return cls(token_bytes)

    def repeating(self, rest: bytes, opens: bool) -> tuple[int, ...]:
        """The tokens whose first quote or backslash, in a name (opens: in the name the token opens after
        whitespace) that a used name continues with `rest`, would repeat it: `rest` raw then the closing quote, or a
        backslash after a proper prefix of `rest`. Kept per `rest` (names recur: the same schemas, the same
        names), within REPEATING_ENTRIES."""
        cache = self._repeating[opens]
        found = cache.get(rest)
        if found is None:
            quote, escape, lengths = ((self.open_quote_first, self.open_escape_first, self.open_escape_lengths) if opens
                                      else (self.quote_first, self.escape_first, self.escape_lengths))
            ids = list(quote.get(rest, ()))
            for j in lengths:
                if j >= len(rest):
                    break
                ids.extend(escape.get(rest[:j], ()))
            found = tuple(ids)
            if len(cache) >= REPEATING_ENTRIES:
                cache.clear()
            cache[rest] = found
        return found

    def touching(self, kind: tuple) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
        """The tokens of two or more quotes and backslashes that, from a state of this kind (see _touches), may write
        a name's closing quote or a backslash in a name that the mask's lookups do not cover, as (ids, the same as an
        array, their bitmask words, their bits). The others cannot repeat a name from there. Computed once per
        kind."""
        found = self._touching.get(kind)
        if found is None:
            ids = [i for i in self.multi_ids if _touches(self.token_bytes[i], kind)]
            at = np.array(ids, dtype=np.int64)
            found = self._touching[kind] = (ids, at, at >> 5, (at & 31).astype(np.uint32))
        return found


# How many containers a state's kind describes (the innermost ones); a token that closes more is simulated.
_KIND_DEPTH = 4


def _touches(data: bytes, kind: tuple) -> bool:
    """Whether `data`, from a state of `kind` (mode, escape, a high surrogate waits, a string here is a name, the
    innermost containers: True an object, whether there are more), writes the first closing quote or backslash of a
    name that the mask's lookups do not cover, or closes more containers than the kind describes. Covered: the name
    the state is in (its first such byte is looked up; a name with an escape already cannot become a used one), and
    in a state before a name, the name a first quote after nothing but whitespace opens. A name whose first such
    byte passes cannot become a used one: its later ones are not counted. Bytes no JSON has there (before a name
    only whitespace, a quote or '}'; after one only whitespace and ':') end it: the grammar never allows the token.
    """
    mode, esc, high, expect, containers, deeper = kind
    stack = list(containers)
    pending = False  # (the name being read has had no closing quote or backslash, and no lookup covers it)
    lead = mode == _OUT and expect and bool(stack) and stack[-1]  # (only whitespace so far, before a name)
    named = False  # (a name has just closed: its ':' comes next)
    for c in data:
        if mode == _OUT:
            if c not in _WHITESPACE:
                if named and c != 0x3A or expect and stack and stack[-1] and c not in (_QUOTE, 0x7D):
                    return False
                named = False
            if c == _QUOTE:
                if expect and stack and stack[-1]:
                    mode, pending = _NAME, not lead
                else:
                    mode = _STRING
            elif c == 0x7B or c == 0x5B:
                stack.append(c == 0x7B)
                expect = c == 0x7B
            elif c == 0x7D or c == 0x5D:
                if not stack:
                    if deeper:
                        return True  # (a container the kind does not describe)
                    continue
                stack.pop()
                expect = False
            elif c == 0x2C:
                expect = bool(stack) and stack[-1]
            elif c == 0x3A:
                expect = False
            if c not in _WHITESPACE:
                lead = False
            continue
        if esc == 1:
            esc = 2 if c == 0x75 else 0
            continue
        if esc:
            esc = esc + 1 if esc < 5 else 0
            continue
        if c in (_QUOTE, _BACKSLASH):
            if mode == _NAME and pending:
                return True
            pending = False
            if c == _QUOTE:
                named = mode == _NAME
                mode, expect = _OUT, False
            else:
                esc = 1
    return False


_VIEW: list = [None, None]  # (the last bitmask, and its words as uint32: one view a step for every sequence)


def _rows(bitmask: torch.Tensor) -> np.ndarray:
    if _VIEW[0] is not bitmask:
        _VIEW[1] = bitmask.numpy().view(np.uint32)
        _VIEW[0] = bitmask
    return _VIEW[1]


class DistinctKeys:
    """One sequence's JSON key state: accept / rollback / count_accepted as its grammar matcher, and `mask`,
    which clears the tokens that would repeat a property name (see above)."""

    def __init__(self, table: KeyTable):
        self.table = table
        self._stack: list[set[bytes] | None] = []  # open containers: an object's used names, or None (an array)
        # (mode, escape: 0 none, 1 after '\', 2-5 hex digits of \uXXXX read + 2, the code unit so far, a high
        #  surrogate escape waiting for its pair, the name decoded so far (UTF-8), whether a string here is a name)
        self._state = (_OUT, 0, 0, 0, b"", False)
        self._undo: list[tuple[tuple, tuple, list]] = []
        self.cleared = 0  # tokens the last mask took out

    # ------------------------------------------------------------------ following the output
    def accept(self, token: int) -> bool:
        """Advance by a token; False (nothing changed) if it would repeat a name in an object or escape a name that
        is a proper prefix of a used one."""
        table = self.table
        data = table.token_bytes[token] if 0 <= token < len(table.token_bytes) else b""
        state = self._state
        # (no quote, backslash or structure, at no escape: in a string or between tokens nothing changes, in a name
        #  its text)
        if (table.plain[token] if 0 <= token < len(table.plain) else True) and not state[1] and not state[3]:
            if state[0] == _NAME:
                self._state = (_NAME, 0, 0, 0, state[4] + data, state[5])
            self._undo.append((state, None, ()))
            return True
        before = (state, tuple(self._stack))
        added: list = []
        state = self._run(data, self._stack, added)
        if state is None:
            for names, name in added:
                names.discard(name)
            self._state, self._stack = before[0], list(before[1])
            return False
        self._state = state
        self._undo.append((*before, added))
        if len(self._undo) > 2 * MAX_ROLLBACK:
            del self._undo[:-MAX_ROLLBACK]
        return True

    def rollback(self, n: int) -> None:
        if n > len(self._undo):
            raise ValueError(f"cannot roll back {n} tokens (at most {len(self._undo)} are kept)")
        for _ in range(n):
            state, stack, added = self._undo.pop()
            for names, name in added:
                names.discard(name)
            self._state = state
            if stack is not None:
                self._stack = list(stack)

    def count_accepted(self, tokens: list[int]) -> int:
        """How many leading tokens are taken (the state is unchanged)."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n

    def _run(self, data: bytes, stack: list, added: list | None) -> tuple | None:
        """The state after `data` from the current one, or None where it repeats a name or escapes a prefix of a
        used one. `stack` is changed in place; a name is added to its object's set and noted in `added` or, with
        added None (a trial), kept aside (the sets are not changed)."""
        mode, esc, code, high, key, expect = self._state
        aside: dict[int, set[bytes]] | None = None if added is not None else {}
        i, n = 0, len(data)
        while i < n:
            if mode == _OUT:
                c = data[i]
                i += 1
                if c == _QUOTE:
                    if expect and stack and stack[-1] is not None:
                        mode, key = _NAME, b""
                    else:
                        mode = _STRING
                elif c == 0x7B:  # {
                    stack.append(set())
                    expect = True
                elif c == 0x5B:  # [
                    stack.append(None)
                    expect = False
                elif c == 0x7D or c == 0x5D:  # } ]
                    if stack:
                        stack.pop()
                    expect = False
                elif c == 0x2C:  # ,
                    expect = bool(stack) and stack[-1] is not None
                elif c == 0x3A:  # :
                    expect = False
                continue
            if esc == 0:
                q, b = data.find(b'"', i), data.find(b"\\", i)
                j = min(q if q >= 0 else n, b if b >= 0 else n)
                if mode == _NAME and j > i:
                    if high:
                        key, high = key + chr(high).encode("utf-8", "surrogatepass"), 0
                    key += data[i:j]
                if j == n:
                    break
                i = j + 1
                if data[j] == _QUOTE:
                    if mode == _NAME:
                        if high:
                            key, high = key + chr(high).encode("utf-8", "surrogatepass"), 0
                        names = stack[-1]
                        if key in names or (aside is not None and key in aside.get(id(names), ())):
                            return None
                        if aside is None:
                            names.add(key)
                            added.append((names, key))
                        else:
                            aside.setdefault(id(names), set()).add(key)
                        expect = False
                    mode = _OUT
                else:
                    if mode == _NAME and not high and self._begins_used(key, stack[-1], aside):
                        return None
                    esc = 1
                continue
            c = data[i]
            i += 1
            if esc == 1:
                if c == 0x75:  # \u
                    esc, code = 2, 0
                    continue
                esc = 0
                if mode == _NAME:
                    if high:
                        key, high = key + chr(high).encode("utf-8", "surrogatepass"), 0
                    key += _SHORT.get(c, bytes([c]))
                continue
            code = code * 16 + _HEX.get(c, 0)
            esc += 1
            if esc < 6:
                continue
            esc = 0
            if mode != _NAME:
                continue
            if high and 0xDC00 <= code <= 0xDFFF:
                key += chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)).encode("utf-8")
                high = 0
                continue
            if high:
                key, high = key + chr(high).encode("utf-8", "surrogatepass"), 0
            if 0xD800 <= code <= 0xDBFF:
                high = code
            else:
                key += chr(code).encode("utf-8", "surrogatepass")
        return mode, esc, code, high, key, expect

    @staticmethod
    def _begins_used(key: bytes, names: set[bytes], aside: dict | None) -> bool:
        """Whether a used name of the object starts with `key` and is longer."""
        more = aside.get(id(names), ()) if aside else ()
        return any(len(u) > len(key) and u.startswith(key) for u in (*names, *more))

    # ------------------------------------------------------------------ masks
    def mask(self, bitmask: torch.Tensor, row: int) -> int:
        """Clear from the row (the grammar's mask of the current state) the tokens that would repeat a property
        name; -> how many were cleared (also in `cleared`)."""
        table = self.table
        mode, esc, _, high, key, expect = self._state
        stack = self._stack
        out: set[int] = set()
        # The token's first quote or backslash in this name, or in the name it opens after whitespace: the rest of
        # a used name raw and its closing quote, or a backslash while the name is a proper prefix of a used one.
        if mode == _NAME and not esc and not high and stack[-1]:
            cut = len(key)
            for used in stack[-1]:
                if used.startswith(key):
                    out.update(table.repeating(used[cut:], False))
        elif mode == _OUT and expect and stack and stack[-1]:
            for used in stack[-1]:
                out.update(table.repeating(used, True))
        ids, array, at, bits = table.touching((mode, esc, bool(high), expect,
                                        tuple(f is not None for f in stack[-_KIND_DEPTH:]), len(stack) > _KIND_DEPTH))
        if not ids and not out:
            self.cleared = 0
            return 0
        words = _rows(bitmask)[row]
        if ids:
            if len(ids) > 32:
                allowed = array[((words[at] >> bits) & 1).nonzero()[0]].tolist()
            else:
                allowed = [i for i in ids if int(words[i >> 5]) >> (i & 31) & 1]
            out.update(i for i in allowed if self._run(table.token_bytes[i], list(stack), None) is None)
        cleared = 0
        if len(out) > 16:
            found = np.fromiter(out, dtype=np.int64, count=len(out))
            found = found[(words[found >> 5] >> (found & 31).astype(np.uint32)) & 1 == 1]
            np.bitwise_and.at(words, found >> 5, ~(np.uint32(1) << (found & 31).astype(np.uint32)))
            cleared = len(found)
        else:
            for i in out:
                w, bit = i >> 5, 1 << (i & 31)
                value = int(words[w])
                if value & bit:
                    words[w] = value ^ bit
                    cleared += 1
        self.cleared = cleared
        return cleared
