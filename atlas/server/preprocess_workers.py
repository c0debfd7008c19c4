"""Large preprocessing in worker processes: a client's own chat template (trusted-template mode), chats with many
or long messages or tools, and large texts to tokenize or ids to detokenize.

A chat template is Python (jinja2) and a tokenization of megabytes holds the interpreter for seconds; in a thread of
the front end either one took the interpreter from the event loop for as long (8 client templates held benign chats
at 2 s). Here they run in a worker process (a fresh interpreter, `python -m atlas.server.preprocess_workers`, which
loads the same tokenizer), so the front end's thread only waits on a pipe. The limits stay what they were: the
template sandbox's own (--chat-template-timeout, its size limits) inside the worker, and its errors come back as the
same exception with the same message and field; on top of them a wall-clock limit kills a worker that does not
answer (WORKER_GRACE_S past the template limit). Memory is given back: a worker whose resident size grew by more than
RECYCLE_GROWTH_BYTES since it started, or that served RECYCLE_TASKS tasks, is replaced (it exits, and the next one
starts in the background), so what a large request allocated does not stay in any process. A task still running
after YIELD_AFTER_S goes on at a lower priority (nice +10), so that on a small host the engine and the front end keep
their cores while it runs.

`--preprocess-workers N` (default 1; 0: the front end's one heavy thread does the work, as before) sets how many run
at once; requests beyond that wait for their turn, in the heavy thread's queue (ordinary requests never wait for them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from atlas.engine.chat_template import TemplateLimitError, TemplateLimits
from atlas.errors import InvalidRequestError, PromptTooLongError
from atlas.processes import YIELD_AFTER_S, Duplex, YieldWhenLong, worker_pipes
from atlas.worker_pool import IdleWorkers, WorkerProcess

logger = logging.getLogger(__name__)

#: how long a new worker may take to start (imports and the tokenizer)
STARTUP_TIMEOUT_S = 300.0
#: a task that has not answered within the template time limit plus this much gets its worker killed
WORKER_GRACE_S = 60.0
#: a worker whose resident memory grew by more than this since it was ready is replaced after its task
RECYCLE_GROWTH_BYTES = 256 * 2**20
#: ... and one that served this many tasks
RECYCLE_TASKS = 256

# Exceptions that cross back by name (message and field kept); anything else is re-raised as a RuntimeError.
_ERRORS = {cls.__name__: cls for cls in (InvalidRequestError, TemplateLimitError, PromptTooLongError)}


# ---------------------------------------------------------------------------------- the worker process
def _serve(conn: Any, source: tuple, template_timeout: float) -> None:
    from atlas.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(*source)
    tokenizer.set_template_limits(TemplateLimits(timeout_s=template_timeout))
    conn.send("ready")
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return
        with YieldWhenLong(YIELD_AFTER_S) as priority:
            try:
                answer: tuple = ("ok", getattr(tokenizer, method)(*args, **kwargs))
            except InvalidRequestError as exc:
                answer = ("error", type(exc).__name__ if type(exc).__name__ in _ERRORS else "InvalidRequestError",
                          str(exc), exc.param)
            except Exception as exc:  # noqa: BLE001 - said as the in-process call would have failed
                answer = ("failed", f"{type(exc).__name__}: {exc}", None)
        conn.send((answer, priority.restored))


# ---------------------------------------------------------------------------------- the front end's side
class PreprocessWorkers:
    """Worker processes with the front end's tokenizer; `tokenizer` is a stand-in whose apply_chat_template,
    encode and decode run in one of them (called from a thread: each call blocks until its answer)."""

    def __init__(self, source: tuple, template_timeout: float, workers: int = 1):
        self._workers = IdleWorkers("atlas.server.preprocess_workers", (tuple(source), template_timeout),
                                    "preprocessing worker")
        self.limit_s = template_timeout + WORKER_GRACE_S
        self._slots = threading.Semaphore(workers)
        self.recycled = 0  # workers replaced after their task (tests and the probe read it)
        self.killed = 0  # workers killed past the wall-clock limit
        self.tokenizer = RemoteTokenizer(self)

    def start(self) -> None:
        """Start a worker now (its start-up then overlaps the server's), unless one is there."""
        self._workers.start_spare()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers.idle()]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """tokenizer.method(*args, **kwargs) in a worker: its result, or its exception."""
        with self._slots:
            worker = self._workers.take()
            try:
                worker.wait_ready(STARTUP_TIMEOUT_S)
                worker.conn.send((method, args, kwargs))
                if not worker.conn.poll(self.limit_s):
                    self._discard(worker, killed=True)
                    raise TemplateLimitError(
                        f"preprocessing this request ran for more than {self.limit_s:g} s (--chat-template-timeout "
                        f"plus {WORKER_GRACE_S:g} s); it was stopped", param="messages")
                answer, restored = worker.conn.recv()
            except (EOFError, OSError) as exc:  # the worker died (out of memory, or killed)
                self._discard(worker)
                raise RuntimeError(f"the preprocessing worker process stopped while serving this request "
                                   f"({type(exc).__name__})") from None
            except RuntimeError:  # (did not start)
                self._discard(worker)
                raise
            worker.tasks += 1
            if not restored or worker.tasks >= RECYCLE_TASKS or worker.grew_more_than(RECYCLE_GROWTH_BYTES):
                # (served its share, or kept the lower priority of a long task that it could not raise again)
                self._discard(worker)
                self.recycled += 1
                self._workers.start_spare_in_background("atlas-preprocess-spare")
            else:
                self._workers.put_back(worker)
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "error":
            raise _ERRORS[answer[1]](answer[2], param=answer[3])
        raise RuntimeError(answer[1])

    def _discard(self, worker: WorkerProcess, killed: bool = False) -> None:
        worker.kill()
        if killed:
            self.killed += 1

    def close(self) -> None:
        self._workers.close()


class RemoteTokenizer:
    """The calls of atlas.engine.tokenizer.Tokenizer that large preprocessing makes, run in a worker process."""

    def __init__(self, workers: PreprocessWorkers):
        self._workers = workers

    def chat_ids(self, *args: Any, **kwargs: Any) -> list[int]:
        return self._workers.call("chat_ids", *args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        return self._workers.call("encode", *args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self._workers.call("decode", *args, **kwargs)


def main() -> None:
    """The worker process: its two pipe ends from the command line, the tokenizer's arguments from the first
    message."""
    parent = os.getppid()

    def orphaned() -> None:  # (the front end is gone, perhaps while this worker was still starting: exit now)
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    conn = Duplex(*worker_pipes())
    try:
        _serve(conn, *conn.recv())
    except (EOFError, OSError):  # (the front end went away)
        return


if __name__ == "__main__":
    main()
