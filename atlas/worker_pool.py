"""Worker processes kept for the next task: a task takes an idle one (or starts one), then puts it back or, when
the owner decides it has served its share or failed, kills it; a spare can start in the background meanwhile.

The owners (the structured-output compile guard, the server's preprocessing workers) keep their own policies:
when a worker is worn out, what a failure means to their callers, and what they count."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections import deque

from atlas.processes import Duplex, resident_bytes, start_worker


class WorkerProcess:
    """`python -m module`, sent `args` as its first message; it answers "ready" once it can take tasks."""

    def __init__(self, module: str, args: tuple, name: str):
        self.proc, reader, writer = start_worker(module)
        self.conn = Duplex(reader, writer)
        self.conn.send(args)
        self.name = name  # (for the error when it does not start)
        self.ready = False
        self.ready_rss: int | None = None
        self.tasks = 0  # (the owner counts them, where its policy needs it)

    def wait_ready(self, timeout: float) -> None:
        """Wait for its "ready" (once); RuntimeError if it does not come within `timeout` seconds."""
        if self.ready:
            return
        if not self.conn.poll(timeout) or self.conn.recv() != "ready":
            raise RuntimeError(f"the {self.name} did not start")
        self.ready = True
        self.ready_rss = resident_bytes(self.proc.pid)

    def grew_more_than(self, limit_bytes: int) -> bool:
        """Whether its resident memory grew by more than `limit_bytes` since it was ready."""
        rss = resident_bytes(self.proc.pid)
        return rss is not None and self.ready_rss is not None and rss - self.ready_rss > limit_bytes

    def kill(self) -> None:
        self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.conn.close()


class IdleWorkers:
    """The idle workers of one kind; after close() none is kept (one put back is killed instead)."""

    def __init__(self, module: str, args: tuple, name: str):
        self._module, self._args, self._name = module, args, name
        self._idle: deque[WorkerProcess] = deque()
        self._lock = threading.Lock()
        self.closed = False

    def _new(self) -> WorkerProcess:
        return WorkerProcess(self._module, self._args, self._name)

    def start_spare(self) -> None:
        """Start a worker now, unless one is idle (or the pool is closed)."""
        with self._lock:
            if not self._idle and not self.closed:
                self._idle.append(self._new())

    def start_spare_in_background(self, thread_name: str) -> None:
        """start_spare in a thread: the caller does not wait for the worker's start-up."""
        threading.Thread(target=self.start_spare, name=thread_name, daemon=True).start()

    def take(self) -> WorkerProcess:
        """An idle worker, or a new one (not ready yet: wait_ready before its first task)."""
        with self._lock:
            if self._idle:
                return self._idle.popleft()
        return self._new()

    def put_back(self, worker: WorkerProcess) -> None:
        with self._lock:
            if self.closed:
                worker.kill()
            else:
                self._idle.append(worker)

    def idle(self) -> list[WorkerProcess]:
        with self._lock:
            return list(self._idle)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            workers, self._idle = list(self._idle), deque()
        for worker in workers:
            worker.kill()
