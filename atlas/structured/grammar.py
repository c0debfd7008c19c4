"""Grammar compilation, per-sequence matchers and token bitmasks, over one of two grammar engines.

The engines (--structured-outputs-backend): llguidance, which refuses a JSON-schema keyword it does not
implement, and xgrammar, whose per-token host work is about half but which drops keywords it does not implement
without a word, so Atlas lets only a checked subset of JSON Schema reach it (json_schema.py). `auto` (the
default) routes each constraint to one of them (AutoBackend). A constraint is enforced exactly or refused with a
400 naming what is not supported.

Life of a constrained request:
1. `StructuredOutputManager.compile(spec)` -> a Future of the compiled grammar, computed in the
   manager's pool (an LRU cache by the spec's key first, bounded in entries and in bytes, see
   StructuredOutputManager). The server awaits it before queueing the
   request, so a schema that does not compile is a 400 and nothing else waits; the engine core holds a
   request whose grammar is still compiling out of the scheduler, and the other requests go on.
2. `RequestGrammar` (one per sequence) is a matcher over the compiled grammar. After each step the
   engine advances it by the tokens the sequence kept (`accept`). A token it refuses (a state with no
   continuation: the mask allowed nothing) ends the request with an error; nothing unconstrained follows.
   A JSON sequence whose schema has an object open to other names also has a DistinctKeys (distinct_keys.py),
   which takes the same tokens and clears from each mask the tokens that would repeat a property name in an object
   (which no grammar forbids there).
3. Before a step, `fill_step_bitmask` writes one bitmask row per sample row of every constrained
   sequence: row j of a verify is the state after its first j drafts (drafts were already cut to the
   ones the grammar accepts, `check_drafts`). The decodes' rows are filled by one call to the backend
   (`fill_batch`: llguidance computes them on its thread pool, --structured-outputs-mask-threads), and one pass
   over the bitmask finds the states with no continuation. The sampler applies the rows on the device.
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
from atlas.structured.json_schema import (
    GrammarCompileError,
    parse_schema,
    string_length_bounds,
    xgrammar_unsupported,
)
from atlas.structured.xgrammar_backend import over_length_budget

logger = logging.getLogger(__name__)

__all__ = ["GrammarCompileError", "RequestGrammar", "StructuredOutputManager", "make_backend"]


def make_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: list[int], mask_threads: int | None = None):
    """The grammar engine named by --structured-outputs-backend (auto: each constraint to the one that
    enforces it exactly at the lower cost, see AutoBackend). `mask_threads`: llguidance's threads for the masks
    of a step (--structured-outputs-mask-threads; None: its default, 0: none, the step's thread computes them)."""
    if name == "auto":
        return AutoBackend(tokenizer, vocab_size, stop_token_ids, mask_threads)
    if name == "llguidance":
        from atlas.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids, mask_threads)
    if name == "xgrammar":
        from atlas.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r}")


# Larger schemas go to llguidance: xgrammar's compile time grows much faster than the schema (an array of 10,000
# forced tools compiled for minutes on the step loop's compile pool), llguidance's stays within its limits.
XGRAMMAR_MAX_SCHEMA_CHARS = 32_768


class AutoBackend:
    """Soundness first, then speed: a JSON schema inside the subset that xgrammar was checked to enforce
    exactly (json_schema.xgrammar_unsupported), not large, and with string length bounds inside xgrammar's compile
    budget (xgrammar_backend.over_length_budget), goes to xgrammar, whose per-token host work
    is about half llguidance's; every other constraint (other schemas, regexes, choices, grammars) to llguidance, which
    refuses what it cannot enforce. A grammar llguidance cannot read (xgrammar's own EBNF extensions) is
    tried on xgrammar, which enforces a grammar as written."""

    name = "auto"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], mask_threads: int | None = None):
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._mask_threads = mask_threads
        self._engines: dict[str, object] = {}
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build both engines now (each reads the whole vocabulary once), not on the first constraint. One that
        cannot read this tokenizer is left unbuilt: a constraint that needs it gets that error when it compiles."""
        for name in ("llguidance", "xgrammar"):
            try:
                self._engine(name)
            except GrammarCompileError as exc:
                logger.info("structured outputs: the %s grammar engine is not available with this tokenizer (%s)",
                            name, exc)

    def _engine(self, name: str):
        with self._lock:
            if name not in self._engines:
                self._engines[name] = make_backend(name, *self._args, mask_threads=self._mask_threads)
            return self._engines[name]

    def compile(self, spec: StructuredOutputsParams, checked: bool = False):
        if spec.kind == "structural_tag":  # (llguidance does not read them; xgrammar's are checked first)
            return "xgrammar", self._engine("xgrammar").compile(spec)
        schema = parse_schema(spec.json) if spec.kind == "json" else {"type": "object"}
        if (spec.kind in ("json", "json_object") and xgrammar_unsupported(schema) is None
                and len(json.dumps(schema)) <= XGRAMMAR_MAX_SCHEMA_CHARS
                and over_length_budget(string_length_bounds(schema)[1], self._args[1]) is None):
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

    def compiled_bytes(self, compiled, spec: StructuredOutputsParams) -> int:
        name, grammar = compiled
        return self._engine(name).compiled_bytes(grammar, spec)

    def fill_batch(self, matchers: list, rows: list[int], bitmask: torch.Tensor) -> None:
        """Each matcher's current mask into its row of `bitmask`: each engine's matchers in one call to it."""
        engines = list(self._engines.values())  # (one C call: a compile thread may add an engine meanwhile)
        if len(engines) == 1:
            engines[0].fill_batch(matchers, rows, bitmask)
            return
        by_engine: dict[int, tuple[object, list, list[int]]] = {}
        for m, row in zip(matchers, rows, strict=True):
            engine = self._engines[m.engine]
            part = by_engine.setdefault(id(engine), (engine, [], []))
            part[1].append(m)
            part[2].append(row)
        for engine, ms, rs in by_engine.values():
            engine.fill_batch(ms, rs, bitmask)


#: default bound of the compiled-grammar cache in bytes (--structured-outputs-cache-memory)
DEFAULT_CACHE_BYTES = 512 << 20


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe.

    Compiled grammars are cached by the constraint, least recently used first out, within `cache_size` entries and
    `cache_bytes` bytes (each compiled grammar's memory as its engine reports it, xgrammar, or as estimated from the
    constraint's size, llguidance: `compiled_bytes`). A grammar larger than the whole bound is used by its request
    and not kept. Requests hold their own grammar, so an evicted one stays valid for them; the next request with
    that constraint compiles it again."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256,
                 threads: int = 2, backend: str = "auto", compile_timeout: float = 30.0,
                 compile_memory: int | None = None, mask_threads: int | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        if cache_size < 1 or cache_bytes < 1:
            raise ValueError(f"the grammar cache needs room for at least one entry and one byte, got {cache_size} "
                             f"entries and {cache_bytes} bytes")
        self.tokenizer = tokenizer  # a Hugging Face tokenizer
        self.backend_name = backend
        self.mask_threads = mask_threads  # llguidance's threads for a step's masks (None: its default)
        self.compile_timeout = compile_timeout  # seconds a request waits for its constraint to compile
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._sizes: dict[tuple, int] = {}  # bytes of the cached grammars that have compiled
        self.cached_bytes = 0  # their sum
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="atlas-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._backend = None  # built lazily (tokenizer set-up takes a while for large vocabularies)
        self._backend_lock = threading.Lock()
        self._key_table = None  # (the vocabulary's bytes for the JSON sequences' DistinctKeys, built lazily)
        self._repeats: dict[tuple, bool] = {}  # (per JSON constraint: whether its sequences need a DistinctKeys)
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
                                             self.stop_token_ids, mask_threads=self.mask_threads)
            return self._backend

    def key_table(self):
        """The vocabulary's token bytes for DistinctKeys (distinct_keys.py), built once (on a compile thread: the
        first JSON constraint's compile builds it)."""
        with self._backend_lock:
            if self._key_table is None:
                from atlas.structured.distinct_keys import KeyTable

                self._key_table = KeyTable.from_tokenizer(self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._key_table

    def _compile_now(self, spec: StructuredOutputsParams):
        if self._names_may_repeat(spec):
            self.key_table()
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
            box: list[Future] = []
            future = self._pool.submit(self._compile_counted, spec, key, box)
            box.append(future)  # (before the compile can take the lock to count itself)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._evict(next(iter(self._cache)))
        return future

    def _compile_counted(self, spec: StructuredOutputsParams, key: tuple, box: list[Future]):
        """Compile, then count the grammar's bytes in the cache (before its Future resolves) and evict the least
        recently used grammars past the bound; compiles still running hold nothing yet and stay."""
        try:
            compiled = self._compile_now(spec)
        except BaseException:
            with self._lock:
                if self._cache.get(key) is box[0]:  # a bad spec is not worth a cache entry
                    del self._cache[key]
            raise
        size = self._compiled_bytes(compiled, spec)
        with self._lock:
            if self._cache.get(key) is box[0]:  # (else evicted while it compiled)
                self._sizes[key] = size
                self.cached_bytes += size
                for old in [k for k in self._cache if k in self._sizes]:
                    if self.cached_bytes <= self.cache_bytes:
                        break
                    self._evict(old)
        return compiled

    def _compiled_bytes(self, compiled, spec: StructuredOutputsParams) -> int:
        try:
            return max(1, int(self.backend.compiled_bytes(compiled, spec)))
        except Exception:  # noqa: BLE001 - a size the engine cannot give: count the constraint's text
            logger.warning("no size for a compiled %s constraint; its text's length is counted", spec.kind,
                           exc_info=True)
            return max(1, len(str(spec.cache_key()[1])))

    def _evict(self, key: tuple) -> None:
        """(under the lock)"""
        del self._cache[key]
        self.cached_bytes -= self._sizes.pop(key, 0)

    def cached(self, spec: StructuredOutputsParams) -> bool:
        """Whether this constraint's grammar is in the cache (compiled or compiling); the recency is unchanged."""
        with self._lock:
            return spec.cache_key() in self._cache

    def cache_info(self) -> tuple[int, int]:
        """(cached grammars, their bytes)"""
        with self._lock:
            return len(self._cache), self.cached_bytes

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
        return RequestGrammar(self, self.compile(spec), distinct_keys=self._names_may_repeat(spec))

    def _names_may_repeat(self, spec: StructuredOutputsParams) -> bool:
        """Whether the constraint's outputs may repeat a property name in an object (a JSON constraint with an
        object open to other names: distinct_keys.names_cannot_repeat), so that its sequences need a DistinctKeys.
        Kept per constraint."""
        if spec.kind not in ("json", "json_object"):
            return False
        key = spec.cache_key()
        found = self._repeats.get(key)
        if found is None:
            from atlas.structured.distinct_keys import names_cannot_repeat

            try:
                found = spec.kind == "json_object" or not names_cannot_repeat(parse_schema(spec.json))
            except GrammarCompileError:
                found = True  # (the compile refuses it)
            if len(self._repeats) >= 1024:
                self._repeats.clear()
            self._repeats[key] = found
        return found

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ steps
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.words), -1, dtype=torch.int32)

    def fill_step_bitmask(self, requests: list, num_sample_rows: list[int], num_drafts: list[int]
                          ) -> tuple[torch.Tensor, list[int], frozenset[int]] | None:
        """The bitmask rows of a step's constrained sample rows: (bitmask [rows, words] int32 on the host,
        the sample-row index of each, the batch indices of the constrained sequences), or None. `requests`: the
        step's (each with its `grammar` and its drafts, `spec_token_ids`), with the step's sample rows and drafts.

        A sequence with one sample row (a decode) is filled with every other such sequence by one call to the
        backend (`fill_batch`: llguidance computes them on its thread pool); a verify's rows (the state after
        each draft) one sequence at a time. Then one pass over the whole bitmask finds the rows that allow
        nothing, and the sequences whose state has no continuation get their `error`."""
        sample_rows: list[int] = []
        seqs: list[int] = []
        single: list[RequestGrammar] = []  # (decodes: one row each, at single_rows)
        single_rows: list[int] = []
        multi: list[tuple[RequestGrammar, int, list[int]]] = []  # (grammar, first bitmask row, drafts before rows)
        r = k = 0
        for i, seq in enumerate(requests):
            m = num_sample_rows[i]
            if not m:
                continue
            grammar = getattr(seq, "grammar", None)
            if grammar is not None and grammar.active:
                seqs.append(i)
                if m == 1:
                    single.append(grammar)
                    single_rows.append(k)
                    sample_rows.append(r)
                else:
                    multi.append((grammar, k, seq.spec_token_ids[: min(num_drafts[i], m - 1)]))
                    sample_rows.extend(range(r, r + m))
                k += m
            r += m
        if not k:
            return None
        bitmask = self.allocate_bitmask(k)
        for grammar, first, drafts in multi:
            grammar.fill_rows(bitmask, first, drafts)
        if single:
            self.backend.fill_batch([g.matcher for g in single], single_rows, bitmask)
            for g, row in zip(single, single_rows, strict=True):
                if g.keys is not None:
                    g.keys.mask(bitmask, row)
            allows = bitmask.any(dim=1).tolist()  # (one pass: a row of zeros allows nothing)
            for g, row in zip(single, single_rows, strict=True):
                if not allows[row] or g.matcher.dead() is not None:
                    g.note_if_dead(bitmask, row)
        return bitmask, sample_rows, frozenset(seqs)


class RequestGrammar:
    """The grammar state of one sequence: a matcher advanced by the tokens the sequence keeps, and for JSON
    (`distinct_keys`) a DistinctKeys beside it, which keeps property names from repeating in an object (a grammar
    cannot: distinct_keys.py): it takes the same tokens and clears the repeating ones from each mask."""

    def __init__(self, manager: StructuredOutputManager, compiled: Future, distinct_keys: bool = False):
        self.manager = manager
        self.compiled = compiled
        self.deadline = time.monotonic() + manager.compile_timeout  # (for the compile)
        self.matcher = None
        self.distinct_keys = distinct_keys
        self.keys = None  # (the DistinctKeys, made with the matcher)
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
            matcher = self.manager.backend.matcher(self.compiled.result())
            if self.distinct_keys:
                from atlas.structured.distinct_keys import DistinctKeys

                self.keys = DistinctKeys(self.manager.key_table())
            self.matcher = matcher

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not after the grammar ended, e.g. with ignore_eos)."""
        return self.matcher is not None and self.error is None and not self.matcher.is_terminated()

    def accept(self, tokens: list[int]) -> int:
        """Advance by the tokens the sequence kept this step. -> how many of them the grammar took: fewer than
        given only past its end (ignore_eos) or at a refusal, which sets `error` (the sequence must end)."""
        matcher = self.matcher
        if matcher is None:
            self.start()
            matcher = self.matcher
        if len(tokens) == 1 and self.error is None and not matcher.is_terminated():  # (a decode's one token)
            if self._take(tokens[0]):
                self._accepted += 1
                return 1
            return 0
        for k, t in enumerate(tokens):
            if not self.active:
                return k if self.error is not None else len(tokens)
            if not self._take(t, k):
                return k
            self._accepted += 1
        return len(tokens)

    def _take(self, token: int, k: int = 0) -> bool:
        """One token into the matcher and the DistinctKeys; False, with `error` set, where either refuses it."""
        keys = self.keys
        if keys is not None and not keys.accept(token):
            self._refused(k, token, "it repeats a property name of the object being written")
            return False
        if self.matcher.accept_token(token):
            return True
        if keys is not None:
            keys.rollback(1)
        self._refused(k, token)
        return False

    def _refused(self, k: int, token: int, reason: str | None = None) -> None:
        if reason is None:
            why = self.matcher.dead()
            reason = (f"the grammar engine stopped ({why})" if why else
                      "no output in its language continues the ones before it")
        self.error = f"the structured-output constraint refused output token {k + self._accepted} ({token}): {reason}"

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_bitmask(bitmask, row)
        if self.keys is not None:
            self.keys.mask(bitmask, row)

    def _count_accepted(self, tokens: list[int]) -> int:
        n = self.matcher.count_accepted(tokens)
        return n if self.keys is None else self.keys.count_accepted(tokens[:n])

    def fill_rows(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> None:
        """Rows first .. first + len(drafts): the state now, then after each draft (undone afterwards). Drafts
        the grammar refuses (a sampled one kept for rejection sampling) get no row: they are never followed."""
        matcher, keys = self.matcher, self.keys
        self._fill(bitmask, first)
        if not self.note_if_dead(bitmask, first):
            return
        accepted = 0
        for j, t in enumerate(drafts[: self._count_accepted(drafts)]):
            matcher.accept_token(t)
            if keys is not None:
                keys.accept(t)
            accepted += 1
            if matcher.is_terminated():  # the sequence stops at this draft: later rows are never read
                break
            self._fill(bitmask, first + j + 1)
        if accepted:
            matcher.rollback(accepted)
            if keys is not None:
                keys.rollback(accepted)

    def note_if_dead(self, bitmask: torch.Tensor, row: int) -> bool:
        """After the current state's row was filled: False, with `error` set, if no token continues the output
        (whatever that row samples is then refused by accept(), and the request ends with the error)."""
        why = self.matcher.dead()
        if why is None and bool(bitmask[row].any()):
            return True
        repeats = self.keys is not None and self.keys.cleared and why is None
        self.error = ("the structured-output constraint allows no token after the first "
                      f"{self._accepted} output token(s): no output in its language continues them"
                      + (f" ({why})" if why else "")
                      + (" without repeating a property name of the object being written" if repeats else ""))
        return False

    def check_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (the state is left unchanged)."""
        if not self.active:
            return len(drafts)
        return self._count_accepted(drafts)
