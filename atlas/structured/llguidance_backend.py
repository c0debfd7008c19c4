"""The llguidance grammar engine (--structured-outputs-backend llguidance, and `auto` for every constraint
outside xgrammar's checked subset).

Chosen for soundness: it refuses a JSON-schema keyword it does not implement ("Unimplemented keys: [\"not\"]")
instead of dropping it, and over the JSON Schema Test Suite every output it let through validated
(tests/test_json_schema_suite.py; counts in BENCHMARKS.md). Its token masks come from a lexer over the
tokenizer's byte strings, so a state with no continuation is an error state (`dead`), never a silent
free-for-all.
"""

from __future__ import annotations

import json
import re

import torch

from atlas.sampling_params import StructuredOutputsParams
from atlas.structured.json_schema import (
    GrammarCompileError,
    exact_other_names,
    parse_schema,
    pin_formats,
    refuse_json_quote_unsafe,
)

#: compiled_bytes' estimate: bytes per grammar, and per character of the constraint's text
LLG_BASE_BYTES = 16 << 10
LLG_BYTES_PER_CHAR = 96


def spec_chars(spec: StructuredOutputsParams) -> int:
    """Characters of the constraint's text (a schema or the choices as JSON, the regex, the grammar)."""
    return len(str(spec.cache_key()[1]))


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # (not llguidance.torch: its import compiles with torch.compile, seconds; the masks are
        #                       written through llguidance's pointer API here)
    except ImportError as exc:  # pragma: no cover - a dependency of atlas
        raise GrammarCompileError("structured outputs need the llguidance package (pip install llguidance)",
                                  param="structured_outputs") from exc
    return llguidance


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], mask_threads: int | None = None):
        llg = _llguidance()
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids))
        except Exception as exc:  # noqa: BLE001 - a slow (non-Rust) tokenizer, or one it cannot read
            raise GrammarCompileError(f"the llguidance grammar engine cannot use this tokenizer ({exc}); try "
                                      "--structured-outputs-backend xgrammar", param="structured_outputs") from None
        self.stop_token_ids = frozenset(stop_token_ids)
        if mask_threads is not None and mask_threads < 0:
            raise ValueError(f"mask_threads must be at least 0, got {mask_threads}")
        # llguidance's thread pool for the masks of a step (made on first use): None, its default size (80 % of
        # the CPUs this process may use, at most 32); 0, none (the step's thread computes them one by one).
        self.mask_threads = mask_threads
        self._executor = None

    def fill_batch(self, matchers: list[LLGuidanceMatcher], rows: list[int], bitmask: torch.Tensor) -> None:
        """Each matcher's current mask into its row of `bitmask` (int32, contiguous, on the host): all of them by
        one call, on llguidance's thread pool (each writes its own row; the GIL is released meanwhile)."""
        stride = _row_bytes(bitmask)
        base = bitmask.data_ptr()
        if len(matchers) > 1 and self.mask_threads != 0:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor(self.mask_threads)
            pairs = [(m._m, row) for m, row in zip(matchers, rows, strict=True)]
            self._executor.unsafe_compute_mask_ptr(pairs, base, stride, bitmask.shape[0])
            return
        for m, row in zip(matchers, rows, strict=True):
            if not 0 <= row < bitmask.shape[0]:
                raise IndexError(f"bitmask row {row} out of range")
            m._m.unsafe_compute_mask_ptr(base + row * stride, stride)

    def compile(self, spec: StructuredOutputsParams, checked: bool = False):
        """A matcher at the grammar's start (validated against the tokenizer), which each sequence's matcher
        copies; or GrammarCompileError. checked: this JSON schema already passed this same compile (the compile
        guard's trial), so its validation, which costs as much as building the matcher, is not run again."""
        matcher = _llguidance().LLMatcher
        kind = spec.kind
        if kind == "structural_tag":
            raise GrammarCompileError("structural tags are compiled by the xgrammar grammar engine only (start the "
                                      "server with --structured-outputs-backend auto or xgrammar)",
                                      param="structural_tag")
        if kind in ("json", "json_object"):
            # (an object open to other properties that lists names is given closed, its other names as a pattern:
            # llguidance's own rule for them lets an escape spell a listed name, json_schema.exact_other_names)
            # (and a pattern whose JSON quoting would let \" or \\ through is refused, json_schema.json_quote_unsafe)
            schema = pin_formats(parse_schema(spec.json)) if kind == "json" else {"type": "object"}
            if "x-guidance" in schema:  # (llguidance reads its compile options there: json_allowed_escapes without
                #                          u dropped a NUL from a const, "hello\u0000there" matched "hellothere")
                raise GrammarCompileError("'x-guidance' (llguidance's compile options) at # is not accepted: Atlas "
                                          "sets them", param="json_schema")
            refuse_json_quote_unsafe(schema)
            schema = exact_other_names(schema)
            item, key = (",", ":") if spec.disable_any_whitespace else (", ", ": ")
            # One layout (json.dumps's separators, no free whitespace): a weak model given free whitespace
            # spends its budget on blanks.
            try:
                grammar = matcher.grammar_from_json_schema(
                    schema, overrides={"whitespace_flexible": False, "item_separator": item, "key_separator": key})
            except ValueError as exc:  # (what llguidance cannot read, e.g. an integer past 64 bits)
                raise GrammarCompileError(f"the JSON schema cannot be enforced: {exc}", param="json_schema") from None
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                       for c in spec.choice))
        else:
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                lark = any_to_lark(spec.grammar)
            except Exception as exc:  # noqa: BLE001 - the GBNF converter raises plain Exceptions
                raise GrammarCompileError(f"the grammar cannot be compiled: {exc}", param="grammar") from None
            if re.search(r"%json\b", lark):
                # (a %json block would reach llguidance's JSON compiler past Atlas's checks and rewrites of JSON
                # schemas, json_schema.py: its other property names took \u escapes that spell a listed name)
                raise GrammarCompileError("a grammar's %json blocks are not accepted (a JSON schema is checked "
                                          "before it is enforced: give it as a json_schema constraint)",
                                          param="grammar")
            try:
                grammar = matcher.grammar_from_lark(lark)
            except Exception as exc:  # noqa: BLE001 - llguidance's errors
                raise GrammarCompileError(f"the grammar cannot be compiled: {exc}", param="grammar") from None
        failed, messages = ((False, []) if checked and kind in ("json", "json_object")
                            else matcher.validate_grammar_with_warnings(grammar, self.tokenizer))
        if failed or messages:  # (a warning is a refusal too: nothing is half-enforced)
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}[kind]
            verb = "cannot be enforced" if kind == "json" else "cannot be compiled"
            raise GrammarCompileError(f"the {what} {verb}: {_clean(messages)}",
                                      param="json_schema" if kind == "json" else kind)
        # A language with no string at all is found when the matcher starts.
        probe = matcher(self.tokenizer, grammar, log_level=0)
        probe.compute_bitmask()  # (the state's error shows once its mask is computed)
        if probe.is_error():
            why = probe.get_error().strip().splitlines()[0]
            if probe.stop_reason() in ("LexerTooComplex", "ParserTooComplex") or "too many" in why:
                raise GrammarCompileError(f"the constraint is too complex to enforce within the grammar engine's "
                                          f"limits ({why}); simplify it", param=kind)
            raise GrammarCompileError(f"the constraint admits no output ({why})", param=kind)
        # The probe, at the grammar's start, is what each sequence's matcher copies: building a matcher costs
        # as much as the compile (0.23 s for an array of 1,000 forced tools), and it happens here, in the
        # compile pool, instead of on the engine's step loop once per sequence.
        return probe

    def matcher(self, compiled) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self.stop_token_ids)

    def compiled_bytes(self, compiled, spec: StructuredOutputsParams) -> int:
        """An estimate of a compiled grammar's memory, for the compile cache's bound: llguidance reports none. It
        grows with the constraint's text (resident memory per character, measured with the default model's
        tokenizer: ~50 bytes for JSON schemas, ~110 for large choices); its lexer states grow further in use."""
        return LLG_BASE_BYTES + LLG_BYTES_PER_CHAR * spec_chars(spec)


def _row_bytes(bitmask: torch.Tensor) -> int:
    """Bytes per row of a bitmask llguidance may write through its pointer (checked: it writes raw memory)."""
    if (bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous()
            or bitmask.device.type != "cpu"):
        raise ValueError("a grammar bitmask must be a contiguous 2-D int32 tensor on the host")
    return bitmask.shape[1] * 4


def _clean(messages: list[str]) -> str:
    text = "; ".join(m.strip() for m in messages if m and m.strip())
    return text[:600] or "it does not compile"


class LLGuidanceMatcher:
    """One sequence's state. Tokens reach it only from under its own mask."""

    engine = "llguidance"

    def __init__(self, matcher, stop_token_ids: frozenset[int]):
        self._m = matcher
        self._stops = stop_token_ids
        self._ended_at: int | None = None  # tokens consumed when a stop token was taken
        self._consumed = 0

    def accept_token(self, token: int) -> bool:
        if not self._m.consume_token(token):
            return False
        self._consumed += 1
        if token in self._stops and self._ended_at is None:
            self._ended_at = self._consumed
        return True

    def rollback(self, n: int) -> None:
        self._m.rollback(n)
        self._consumed -= n
        if self._ended_at is not None and self._ended_at > self._consumed:
            self._ended_at = None

    def is_terminated(self) -> bool:
        return self._ended_at is not None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        stride = _row_bytes(bitmask)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"bitmask row {row} out of range")
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * stride, stride)

    def count_accepted(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar takes (the state is unchanged)."""
        if self.is_terminated():
            return 0
        n = self._m.validate_tokens(tokens)
        for i, t in enumerate(tokens[:n]):  # (nothing follows a stop token)
            if t in self._stops:
                return i + 1
        if n < len(tokens) and tokens[n] in self._stops:
            # (validate_tokens never takes a stop token: it ends the output where the grammar is complete)
            if n:
                self._m.consume_tokens(tokens[:n])
            complete = self._m.is_accepting()
            if n:
                self._m.rollback(n)
            return n + 1 if complete else n
        return n

    def dead(self) -> str | None:
        """Why no token can follow (the grammar's state has no continuation), or None."""
        if not self._m.is_error():
            return None
        return self._m.get_error().strip().splitlines()[0] or "the grammar's state has no continuation"
