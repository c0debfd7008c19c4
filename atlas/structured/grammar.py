"""Grammar compilation, per-sequence matchers and token bitmasks (xgrammar).

Why xgrammar: measured against llguidance on the same tokenizers and JSON schemas
(`tools/compare_grammar_engines.py`, figures in BENCHMARKS.md), its per-token host work (next-token
bitmask + advancing the matcher) is 1.5-2x lower, and that work sits between two steps of every
constrained sequence; its compile is slower but runs once per schema, in a thread pool, and is cached.

Life of a constrained request:
1. `StructuredOutputManager.compile(spec)` -> a Future of the compiled grammar, computed in the
   manager's pool (an LRU cache by the spec's key first). The server awaits it before queueing the
   request, so a schema that does not compile is a 400 and nothing else waits; the engine core holds a
   request whose grammar is still compiling out of the scheduler, and the other requests go on.
2. `RequestGrammar` (one per sequence) is a matcher over the compiled grammar. After each step the
   engine advances it by the tokens the sequence kept (`accept`).
3. Before a step, `fill_step_bitmask` writes one bitmask row per sample row of every constrained
   sequence: row j of a verify is the state after its first j drafts (drafts were already cut to the
   ones the grammar accepts, `check_drafts`). The sampler applies the rows on the device.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from atlas.errors import InvalidRequestError
from atlas.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON output has one layout: json.dumps's separators (", " and ": "; "," and ":" with disable_any_whitespace),
# no newlines. Free whitespace lets a weak model spend its whole budget on blanks: on the default model,
# 80 greedy tokens of a 3-field schema were mostly runs of spaces and no document was complete.
_SEPARATORS = {False: (", ", ": "), True: (",", ":")}
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "; the rest is what the user needs.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


class GrammarCompileError(InvalidRequestError):
    """The constraint does not compile (a bad schema, regex or grammar)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a dependency of atlas
        raise InvalidRequestError("structured outputs need the xgrammar package (pip install xgrammar)",
                                  param="structured_outputs") from exc
    return xgrammar


def _clean(message: str) -> str:
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(message).strip().splitlines()]
    lines = [line for line in lines if line and not line.startswith("Stack trace")]
    return "; ".join(lines[:3]) or "it does not compile"


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256,
                 threads: int = 2):
        self.tokenizer = tokenizer  # a Hugging Face tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="atlas-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._compiler = None  # built lazily (tokenizer set-up takes a while for large vocabularies)
        self._compiler_lock = threading.Lock()
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row

    # ------------------------------------------------------------------ compiling
    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile_now(self, spec: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                try:
                    parsed = json.loads(schema)
                except ValueError as exc:
                    raise GrammarCompileError(f"the JSON schema is not valid JSON ({exc})", param="json_schema") \
                        from None
                if not isinstance(parsed, (dict, bool)):
                    raise GrammarCompileError("a JSON schema must be an object", param="json_schema")
                return compiler.compile_json_schema(schema, any_whitespace=False,
                                                    separators=_SEPARATORS[spec.disable_any_whitespace])
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    separators=_SEPARATORS[spec.disable_any_whitespace])
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except GrammarCompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError for bad input
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}[kind]
            raise GrammarCompileError(f"the {what} cannot be compiled: {_clean(exc)}", param=kind) from None

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar (raises GrammarCompileError on bad input). Cached by the spec."""
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            future = self._pool.submit(self._compile_now, spec)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

        def forget_failure(f: Future) -> None:
            if f.exception() is not None:  # a bad spec is not worth a cache entry
                with self._lock:
                    if self._cache.get(key) is f:
                        del self._cache[key]

        future.add_done_callback(forget_failure)
        return future

    def compile_sync(self, spec: StructuredOutputsParams):
        return self.compile(spec).result()

    def request_grammar(self, spec: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self, self.compile(spec))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ steps
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.words), -1, dtype=torch.int32)

    def fill_step_bitmask(self, batch) -> tuple[torch.Tensor, list[int], frozenset[int]] | None:
        """The bitmask rows of a step's constrained sample rows: (bitmask [rows, words] int32 on the host,
        the sample-row index of each, the batch indices of the constrained sequences), or None."""
        rows: list[tuple[int, RequestGrammar, list[int]]] = []  # (sample row, grammar, drafts before it)
        seqs: set[int] = set()
        r = 0
        for i, seq in enumerate(batch.seqs):
            m = batch.num_sample_rows[i]
            grammar = getattr(seq, "grammar", None)
            if m and grammar is not None and grammar.active:
                drafts = seq.spec_token_ids[: batch.num_drafts[i]]
                seqs.add(i)
                for j in range(m):
                    rows.append((r + j, grammar, drafts[:j]))
            r += m
        if not rows:
            return None
        bitmask = self.allocate_bitmask(len(rows))
        k = 0
        while k < len(rows):
            grammar = rows[k][1]
            n = 1
            while k + n < len(rows) and rows[k + n][1] is grammar:
                n += 1
            grammar.fill_rows(bitmask, k, rows[k + n - 1][2])
            k += n
        return bitmask, [row for row, _, _ in rows], frozenset(seqs)


class RequestGrammar:
    """The grammar state of one sequence: a matcher advanced by the tokens the sequence keeps."""

    def __init__(self, manager: StructuredOutputManager, compiled: Future):
        self.manager = manager
        self.compiled = compiled
        self.matcher = None
        self.failed = False  # a token the grammar refused reached it (should not happen): constraint dropped

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def start(self) -> None:
        """Create the matcher (the compiled grammar must be ready; raises its compile error)."""
        if self.matcher is None:
            xgr = _xgrammar()
            self.matcher = xgr.GrammarMatcher(self.compiled.result())

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not after the grammar ended, e.g. with ignore_eos)."""
        return self.matcher is not None and not self.failed and not self.matcher.is_terminated()

    def accept(self, tokens: list[int]) -> None:
        """Advance by the tokens the sequence kept this step."""
        if self.matcher is None:
            self.start()
        for t in tokens:
            if not self.active:
                return
            if not self.matcher.accept_token(t):
                logger.warning("the grammar refused token %d that was sampled under its mask; the constraint is "
                               "dropped for this sequence", t)
                self.failed = True
                return

    def fill_rows(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> None:
        """Rows first .. first + len(drafts): the state now, then after each draft (undone afterwards)."""
        matcher = self.matcher
        matcher.fill_next_token_bitmask(bitmask, first)
        accepted = 0
        for j, t in enumerate(drafts):
            if not matcher.accept_token(t):  # (drafts are checked first; a refusal leaves the rest open)
                break
            accepted += 1
            if matcher.is_terminated():  # the sequence stops at this draft: later rows are never read
                break
            matcher.fill_next_token_bitmask(bitmask, first + j + 1)
        if accepted:
            matcher.rollback(accepted)

    def check_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (the state is left unchanged)."""
        if not self.active:
            return len(drafts)
        matcher = self.matcher
        n = 0
        for t in drafts:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n
