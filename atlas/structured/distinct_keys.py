"""Distinct property names in constrained JSON output.

A grammar cannot forbid a repeated property name in an object whose other names are open (additionalProperties,
patternProperties): {"x": 1, "x": 2} is in its language. JSON parsers keep one of the two values (Python's json the
last), so the parsed object may break the schema the output was constrained to (minProperties 2: {"x": 2} has one
property), and strict parsers (I-JSON, RFC 7493) refuse the text. So every JSON-schema sequence also has a
DistinctKeys beside its grammar matcher: it follows the bytes of the tokens the sequence keeps (the object nesting,
the names each open object has used, whether the output is inside a name and what that name decodes to so far) and
takes out of each mask the tokens that would write a name its object already has:

- inside a name whose decoded text so far, P, begins a used name N: the tokens that spell the rest of N raw and
  the closing quote (found by bisection in the vocabulary's sorted byte strings), and every token that writes a
  backslash while the name is still a proper prefix of a used one (an escape could spell N another way: \\u0078 is
  "x"; such names are written raw there, a subset of the spellings, so nothing valid is let through);
- any token with two or more quotes or backslashes that the grammar allows (one such token can close a value and
  write a whole name, `", "x"`): its bytes are run from the current state and it is taken out if they complete a
  used name or escape a prefix of one. Tokens with one quote or backslash or none cannot finish a name other than
  the one being written.

Exact as a whole: a token is taken out only if its bytes write a used name (or an escape that could), so the
outputs are those of the grammar with no name repeated in an object. A state whose every continuation repeats a
name has an empty mask, which ends the sequence with the grammar's error (grammar.RequestGrammar.note_if_dead).
The tracker only reads JSON the grammar accepted; it stays total on any bytes.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

_OUT, _STRING, _NAME = 0, 1, 2  # between tokens of the structure, in a string value, in a property name
_QUOTE, _BACKSLASH = 0x22, 0x5C
_SHORT = {0x62: b"\b", 0x66: b"\f", 0x6E: b"\n", 0x72: b"\r", 0x74: b"\t"}  # (\" \\ \/ and others: the byte itself)
_HEX = {c: int(chr(c), 16) for c in b"0123456789abcdefABCDEF"}
# Undo records kept (a rollback goes back over drafts only: a few tokens).
MAX_ROLLBACK = 256


def _specials(data: bytes) -> int:
    return data.count(b'"') + data.count(b"\\")


class KeyTable:
    """The vocabulary's token byte strings arranged for DistinctKeys (one per tokenizer and vocabulary)."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        order = sorted(range(len(token_bytes)), key=token_bytes.__getitem__)
        self.sorted_bytes = [token_bytes[i] for i in order]
        self.sorted_ids = np.array(order, dtype=np.int64)
        multi = np.array([i for i, b in enumerate(token_bytes) if _specials(b) >= 2], dtype=np.int64)
        self.multi_ids = multi
        self.multi_words = multi >> 5
        self.multi_bits = (multi & 31).astype(np.uint32)
        # (tokens whose first quote or backslash is a backslash: the bytes before it and the token)
        self.escape_first = [(b[: b.index(b"\\")], i) for i, b in enumerate(token_bytes)
                             if b"\\" in b and (b'"' not in b or b.index(b"\\") < b.index(b'"'))]

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

    def starting_with(self, prefix: bytes) -> np.ndarray:
        """The tokens whose bytes start with `prefix` (which ends with a byte below 0xff)."""
        lo = bisect.bisect_left(self.sorted_bytes, prefix)
        hi = bisect.bisect_left(self.sorted_bytes, prefix[:-1] + bytes([prefix[-1] + 1]), lo)
        return self.sorted_ids[lo:hi]


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
        data = self.table.token_bytes[token] if 0 <= token < len(self.table.token_bytes) else b""
        before = (self._state, tuple(self._stack))
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
            self._state, self._stack = state, list(stack)

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
        words = bitmask[row].numpy().view(np.uint32)
        out: list[np.ndarray] = []
        mode, esc, _, high, key, _ = self._state
        if mode == _NAME and not esc and not high and self._stack[-1]:
            used = [u for u in self._stack[-1] if u.startswith(key)]
            if used:
                cut = len(key)
                prefixes: set[bytes] = set()
                for u in used:
                    out.append(table.starting_with(u[cut:] + b'"'))
                    prefixes.update(u[cut:j] for j in range(cut, len(u)))
                if len(prefixes) <= len(table.escape_first):
                    out.extend(table.starting_with(p + b"\\") for p in prefixes)
                else:
                    out.append(np.array([i for p, i in table.escape_first if p in prefixes], dtype=np.int64))
        if len(table.multi_ids):
            allowed = table.multi_ids[((words[table.multi_words] >> table.multi_bits) & 1).nonzero()[0]]
            if len(allowed):
                trial = [i for i in allowed.tolist()
                         if self._run(table.token_bytes[i], list(self._stack), None) is None]
                if trial:
                    out.append(np.array(trial, dtype=np.int64))
        ids = np.unique(np.concatenate(out)) if out else ()
        if len(ids):
            ids = ids[(words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1]
            np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        self.cleared = len(ids)
        return self.cleared
