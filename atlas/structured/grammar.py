"""Grammar compilation, per-sequence matchers and token bitmasks, over one of two grammar engines.

The engines (--structured-outputs-backend): llguidance, which refuses a JSON-schema keyword it does not
implement, and xgrammar, whose per-token host work is about half but which drops keywords it does not implement
without a word, so Atlas lets only a checked subset of JSON Schema reach it (json_schema.py). `auto` (the
default) routes each constraint to one of them (AutoBackend). A constraint is enforced exactly or refused with a
400 naming what is not supported.

Life of a constrained request:
1. `StructuredOutputManager.compile(spec)` -> a Future of the compiled grammar, computed in the
   manager's pool (an LRU cache by the spec's key first). The server awaits it before queueing the
   request, so a schema that does not compile is a 400 and nothing else waits; the engine core holds a
   request whose grammar is still compiling out of the scheduler, and the other requests go on.
2. `RequestGrammar` (one per sequence) is a matcher over the compiled grammar. After each step the
   engine advances it by the tokens the sequence kept (`accept`). A token it refuses (a state with no
   continuation: the mask allowed nothing) ends the request with an error; nothing unconstrained follows.
3. Before a step, `fill_step_bitmask` writes one bitmask row per sample row of every constrained
   sequence: row j of a verify is the state after its first j drafts (drafts were already cut to the
   ones the grammar accepts, `check_drafts`). The sampler applies the rows on the device.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError

import torch

from atlas.sampling_params import StructuredOutputsParams
from atlas.structured.json_schema import GrammarCompileError, parse_schema, xgrammar_unsupported

logger = logging.getLogger(__name__)

__all__ = ["GrammarCompileError", "RequestGrammar", "StructuredOutputManager", "make_backend"]


def make_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """The grammar engine named by --structured-outputs-backend (auto: each constraint to the one that
    enforces it exactly at the lower cost, see AutoBackend)."""
    if name == "auto":
        return AutoBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "llguidance":
        from atlas.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "xgrammar":
        from atlas.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r}")


# Larger schemas go to llguidance: xgrammar's compile time grows much faster than the schema (an array of 10,000
# forced tools compiled for minutes on the step loop's compile pool), llguidance's stays within its limits.
XGRAMMAR_MAX_SCHEMA_CHARS = 32_768


class AutoBackend:
    """Soundness first, then speed: a JSON schema inside the subset that xgrammar was checked to enforce
    exactly (json_schema.xgrammar_unsupported), and not large, goes to xgrammar, whose per-token host work
    is about half llguidance's; every other constraint (other schemas, regexes, choices, grammars) to llguidance, which
    refuses what it cannot enforce. A grammar llguidance cannot read (xgrammar's own EBNF extensions) is
    tried on xgrammar, which enforces a grammar as written."""

    name = "auto"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._engines: dict[str, object] = {}
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build both engines now (each reads the whole vocabulary once), not on the first constraint."""
        for name in ("llguidance", "xgrammar"):
            self._engine(name)

    def _engine(self, name: str):
        with self._lock:
            if name not in self._engines:
                self._engines[name] = make_backend(name, *self._args)
            return self._engines[name]

    def compile(self, spec: StructuredOutputsParams, checked: bool = False):
        if spec.kind == "structural_tag":  # (llguidance does not read them; xgrammar's are checked first)
            return "xgrammar", self._engine("xgrammar").compile(spec)
        schema = parse_schema(spec.json) if spec.kind == "json" else {"type": "object"}
        if (spec.kind in ("json", "json_object") and xgrammar_unsupported(schema) is None
                and len(json.dumps(schema)) <= XGRAMMAR_MAX_SCHEMA_CHARS):
            return "xgrammar", self._engine("xgrammar").compile(spec)
        try:
            return "llguidance", self._engine("llguidance").compile(spec, checked=checked)
        except GrammarCompileError:
            if spec.kind != "grammar":
                raise
            try:
                return "xgrammar", self._engine("xgrammar").compile(spec)
            except GrammarCompileError:
                pass
            raise

    def matcher(self, compiled):
        name, grammar = compiled
        return self._engine(name).matcher(grammar)

    def fill_many(self, rows: list[tuple[object, int]], bitmask: torch.Tensor) -> None:
        from atlas.structured.llguidance_backend import LLGuidanceMatcher

        llg = self._engines.get("llguidance")
        parallel = [(m, r) for m, r in rows if isinstance(m, LLGuidanceMatcher)]
        if len(parallel) > 1:
            llg.fill_many(parallel, bitmask)
        else:
            parallel = []
        done = {id(m) for m, _ in parallel}
        for m, r in rows:
            if id(m) not in done:
                m.fill_bitmask(bitmask, r)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256,
                 threads: int = 2, backend: str = "auto", compile_timeout: float = 30.0,
                 compile_memory: int | None = None):
        self.tokenizer = tokenizer  # a Hugging Face tokenizer
        self.backend_name = backend
        self.compile_timeout = compile_timeout  # seconds a request waits for its constraint to compile
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="atlas-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._backend = None  # built lazily (tokenizer set-up takes a while for large vocabularies)
        self._backend_lock = threading.Lock()
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        # compile_memory (bytes): each new constraint is first compiled in a worker process within the time and
        # memory limits (compile_guard.py); None: in the compile threads only.
        self.guard = None
        if compile_memory:
            from atlas.structured.compile_guard import shared_guard

            self.guard = shared_guard(backend, tokenizer, vocab_size, self.stop_token_ids, compile_timeout,
                                      compile_memory, workers=threads)

    # ------------------------------------------------------------------ compiling
    @property
    def backend(self):
        with self._backend_lock:
            if self._backend is None:
                self._backend = make_backend(self.backend_name, self.tokenizer, self.vocab_size,
                                             self.stop_token_ids)
            return self._backend

    def _compile_now(self, spec: StructuredOutputsParams):
        if self.guard is None:
            return self.backend.compile(spec)
        self.guard.check(spec)  # (raises past the limits; the worker, not this thread, did the long part)
        # The trial ran this same compile, checks included: they are not run twice.
        return self.backend.compile(spec, checked=True)

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
        """The compiled grammar, or GrammarCompileError (a bad constraint, or one past the compile timeout)."""
        try:
            return self.compile(spec).result(timeout=self.compile_timeout)
        except FutureTimeoutError:
            raise self.timeout_error() from None

    def timeout_error(self) -> GrammarCompileError:
        return GrammarCompileError(f"the constraint did not compile within {self.compile_timeout:g} s "
                                   "(--structured-outputs-compile-timeout); simplify it", param="structured_outputs")

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
        single: list[tuple[RequestGrammar, int]] = []  # (grammar, its one row): filled together where possible
        k = 0
        while k < len(rows):
            grammar = rows[k][1]
            n = 1
            while k + n < len(rows) and rows[k + n][1] is grammar:
                n += 1
            if n == 1:
                single.append((grammar, k))
            else:
                grammar.fill_rows(bitmask, k, rows[k + n - 1][2])
            k += n
        fill_many = getattr(self.backend, "fill_many", None)
        if fill_many is not None and len(single) > 1:
            fill_many([(g.matcher, row) for g, row in single], bitmask)
            for g, row in single:
                g.note_if_dead(bitmask, row)
        else:
            for g, row in single:
                g.fill_rows(bitmask, row, [])
        return bitmask, [row for row, _, _ in rows], frozenset(seqs)


class RequestGrammar:
    """The grammar state of one sequence: a matcher advanced by the tokens the sequence keeps."""

    def __init__(self, manager: StructuredOutputManager, compiled: Future):
        self.manager = manager
        self.compiled = compiled
        self.deadline = time.monotonic() + manager.compile_timeout  # (for the compile)
        self.matcher = None
        # Why the sequence cannot go on (a token its grammar refused: the state before it allowed none), or None.
        self.error: str | None = None
        self._accepted = 0  # tokens the matcher took

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def overdue(self) -> bool:
        """Still compiling past the compile timeout (start() then raises the timeout's error)."""
        return not self.compiled.done() and time.monotonic() > self.deadline

    def start(self) -> None:
        """Create the matcher (the compiled grammar must be ready or overdue; raises its compile error)."""
        if self.overdue:
            raise self.manager.timeout_error()
        if self.matcher is None:
            self.matcher = self.manager.backend.matcher(self.compiled.result())

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not after the grammar ended, e.g. with ignore_eos)."""
        return self.matcher is not None and self.error is None and not self.matcher.is_terminated()

    def accept(self, tokens: list[int]) -> int:
        """Advance by the tokens the sequence kept this step. -> how many of them the grammar took: fewer than
        given only past its end (ignore_eos) or at a refusal, which sets `error` (the sequence must end)."""
        if self.matcher is None:
            self.start()
        for k, t in enumerate(tokens):
            if not self.active:
                return k if self.error is not None else len(tokens)
            if not self.matcher.accept_token(t):
                why = self.matcher.dead()
                self.error = (f"the structured-output constraint refused output token {k + self._accepted} "
                              f"({t}): " + (f"the grammar engine stopped ({why})" if why else
                                            "no output in its language continues the ones before it"))
                return k
            self._accepted += 1
        return len(tokens)

    def fill_rows(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> None:
        """Rows first .. first + len(drafts): the state now, then after each draft (undone afterwards). Drafts
        the grammar refuses (a sampled one kept for rejection sampling) get no row: they are never followed."""
        matcher = self.matcher
        matcher.fill_bitmask(bitmask, first)
        if not self.note_if_dead(bitmask, first):
            return
        accepted = 0
        for j, t in enumerate(drafts[: matcher.count_accepted(drafts)]):
            matcher.accept_token(t)
            accepted += 1
            if matcher.is_terminated():  # the sequence stops at this draft: later rows are never read
                break
            matcher.fill_bitmask(bitmask, first + j + 1)
        if accepted:
            matcher.rollback(accepted)

    def note_if_dead(self, bitmask: torch.Tensor, row: int) -> bool:
        """After the current state's row was filled: False, with `error` set, if no token continues the output
        (whatever that row samples is then refused by accept(), and the request ends with the error)."""
        why = self.matcher.dead()
        if why is None and bool(bitmask[row].any()):
            return True
        self.error = ("the structured-output constraint allows no token after the first "
                      f"{self._accepted} output token(s): no output in its language continues them"
                      + (f" ({why})" if why else ""))
        return False

    def check_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (the state is left unchanged)."""
        if not self.active:
            return len(drafts)
        return self.matcher.count_accepted(drafts)
