"""The xgrammar grammar engine (--structured-outputs-backend xgrammar): the lower per-token host cost, but it
drops JSON-schema keywords it does not implement without an error, so Atlas refuses every keyword outside the
subset checked over the JSON Schema Test Suite (json_schema.xgrammar_unsupported) before xgrammar sees it.
"""

from __future__ import annotations

import json
import re

import torch

from atlas.sampling_params import StructuredOutputsParams
from atlas.structured.json_schema import GrammarCompileError, parse_schema, xgrammar_unsupported

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


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

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
                # strict_mode off: properties the schema leaves open stay allowed, as JSON Schema (and llguidance)
                # have it.
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False,
                                                    separators=_SEPARATORS[spec.disable_any_whitespace])
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if kind == "structural_tag":
                from atlas.structured.structural_tag import normalize_structural_tag

                return compiler.compile_structural_tag(json.dumps(normalize_structural_tag(spec.structural_tag)))
            return compiler.compile_grammar(spec.grammar)
        except GrammarCompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError for bad input
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "structural_tag": "structural tag"}[kind]
            raise GrammarCompileError(f"the {what} cannot be compiled: {_clean(exc)}", param=kind) from None

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
