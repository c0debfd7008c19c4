"""Every new constraint is first compiled in a separate process, bounded in time and memory.

A grammar engine's compile runs native code that Python cannot interrupt: a pathological regex or schema can
hold a core for minutes or take gigabytes, and a thread of the engine's process would keep doing so after the
request was refused. So the engine compiles a new constraint twice: first a trial in a worker process (a fresh
interpreter, `python -m atlas.structured.compile_guard`, so it shares nothing with the engine's CUDA state and
never re-runs the user's script), with a wall-clock limit (`--structured-outputs-compile-timeout`)
and an address-space limit (`--structured-outputs-compile-memory`) on top of what the worker had after start-up;
past either, the worker is killed (its core and memory come back at once, and a new worker replaces it) and the
request gets a 400 naming the limit. A constraint that passed is then compiled in the engine's compile threads
for use (engines' compiled grammars do not cross processes); it is cached there, so each constraint pays the
trial once. The trial's own errors (a keyword the engine cannot enforce, a grammar it cannot read) are the
request's error, with the engine's message. A worker whose resident memory grew by RECYCLE_GROWTH_BYTES over its
compiles is replaced after the compile that did it, so what a large constraint allocated is given back. A trial
still running after YIELD_AFTER_S goes on at a lower priority (nice +10), so that the engine's steps and the front
ends keep their cores while a pathological constraint compiles.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from atlas.processes import YIELD_AFTER_S, Duplex, YieldWhenLong, status_bytes, worker_pipes
from atlas.sampling_params import StructuredOutputsParams
from atlas.structured.json_schema import GrammarCompileError
from atlas.worker_pool import IdleWorkers, WorkerProcess

logger = logging.getLogger(__name__)

#: how long a new worker may take to start (imports, the tokenizer, the grammar engines' vocabulary tables)
STARTUP_TIMEOUT_S = 300.0
#: a worker whose resident memory grew by more than this during its compiles is replaced after the one that did
#: it (its memory comes back at once; the next one starts in the background)
RECYCLE_GROWTH_BYTES = 256 * 2**20


def _serve(conn, backend: str, tokenizer, vocab_size: int, stop_token_ids: list[int], memory_bytes: int) -> None:
    """The worker: build the grammar engine, cap the address space, then answer trial compiles until the pipe
    closes. Each answer: None (it compiled, or failed otherwise than as a constraint error: the engine's own compile
    then raises) or (message, param) of the GrammarCompileError."""
    from atlas.structured.grammar import make_backend

    engine = make_backend(backend, tokenizer, vocab_size, stop_token_ids)
    if hasattr(engine, "warm"):
        engine.warm()  # (the vocabulary tables before "ready": a trial's time limit is the compile's alone)
    size = status_bytes("VmSize")
    if memory_bytes and size is not None:
        import resource

        limit = size + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        with YieldWhenLong(YIELD_AFTER_S) as priority:
            try:
                engine.compile(spec)
                answer: Any = None
            except GrammarCompileError as exc:
                answer = (str(exc), exc.param)
            except MemoryError:
                answer = ("memory", None)
            except Exception:  # noqa: BLE001 (not a constraint error: the engine's own compile will say what it is)
                answer = None
        conn.send((answer, priority.restored))


class CompileGuard:
    """Trial compiles in worker processes (`workers` at most at once; more wait their turn)."""

    def __init__(self, backend: str, tokenizer, vocab_size: int, stop_token_ids: list[int], timeout: float,
                 memory_bytes: int, workers: int = 1):
        self.timeout = timeout
        self.memory_bytes = memory_bytes
        # (each worker's first message: the grammar engine's arguments, the tokenizer among them, pickled)
        self._workers = IdleWorkers("atlas.structured.compile_guard",
                                    (backend, tokenizer, vocab_size, list(stop_token_ids), memory_bytes),
                                    "grammar compile worker")
        self._slots = threading.Semaphore(workers)
        self.killed = 0  # workers killed past a limit (tests read it)
        self.recycled = 0  # workers replaced after a compile that grew them by RECYCLE_GROWTH_BYTES
        self._workers.start_spare()  # (started now: its start-up overlaps the first request)

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise GrammarCompileError if the constraint fails to compile, or not within the time and memory limits."""
        with self._slots:
            worker = self._workers.take()
            try:
                worker.wait_ready(STARTUP_TIMEOUT_S)
                worker.conn.send(spec)
                if not worker.conn.poll(self.timeout):
                    self._discard(worker)
                    raise GrammarCompileError(
                        f"the constraint did not compile within {self.timeout:g} s "
                        "(--structured-outputs-compile-timeout); simplify it", param="structured_outputs")
                answer, restored = worker.conn.recv()
            except EOFError:  # the worker died: past its memory limit (or the compiler crashed)
                self._discard(worker)
                raise GrammarCompileError(
                    f"compiling the constraint took more than {self.memory_bytes / 2**20:,.0f} MiB "
                    "(--structured-outputs-compile-memory) or crashed the grammar compiler; simplify it",
                    param="structured_outputs") from None
            except (TimeoutError, RuntimeError, OSError, BrokenPipeError) as exc:  # (no worker: the engine's own compile decides)
                self._discard(worker)
                logger.warning("grammar compile worker unavailable (%s); compiling without the trial", exc)
                return
            if not restored or worker.grew_more_than(RECYCLE_GROWTH_BYTES):
                # (what the compile allocated goes with the worker, as does a priority it could not raise again; a
                #  new one starts meanwhile)
                worker.kill()
                self.recycled += 1
                self._workers.start_spare_in_background("atlas-compile-spare")
            else:
                self._workers.put_back(worker)
        if answer == ("memory", None):
            raise GrammarCompileError(
                f"compiling the constraint took more than {self.memory_bytes / 2**20:,.0f} MiB "
                "(--structured-outputs-compile-memory); simplify it", param="structured_outputs")
        if answer is not None:
            raise GrammarCompileError(answer[0], param=answer[1] or "structured_outputs")

    def _discard(self, worker: WorkerProcess) -> None:
        worker.kill()
        self.killed += 1

    @property
    def closed(self) -> bool:
        return self._workers.closed

    def close(self) -> None:
        self._workers.close()


_SHARED: dict[tuple, CompileGuard] = {}
_SHARED_LOCK = threading.Lock()


def shared_guard(backend: str, tokenizer, vocab_size: int, stop_token_ids: list[int], timeout: float,
                 memory_bytes: int, workers: int = 1) -> CompileGuard:
    """One guard (and its workers) for all engines of this process with the same tokenizer and limits (an
    engine made again, as tests and notebooks do, does not start new workers). The workers end with the process:
    their pipe closes."""
    name = getattr(tokenizer, "name_or_path", None) or f"id{id(tokenizer)}"
    key = (backend, name, len(tokenizer), vocab_size, tuple(stop_token_ids), timeout, memory_bytes, workers)
    with _SHARED_LOCK:
        guard = _SHARED.get(key)
        if guard is None or guard.closed:
            guard = _SHARED[key] = CompileGuard(backend, tokenizer, vocab_size, stop_token_ids, timeout, memory_bytes,
                                                workers)
        return guard


def main() -> None:
    """The worker process: its two pipe ends from the command line, the engine's arguments from the first message."""
    from transformers.dynamic_module_utils import init_hf_modules

    init_hf_modules()  # (a tokenizer of the checkpoint's own code unpickles from the modules folder it was put in)
    conn = Duplex(*worker_pipes())
    try:
        _serve(conn, *conn.recv())
    except (EOFError, OSError):  # (the engine went away: nothing to answer)
        return


if __name__ == "__main__":
    main()
