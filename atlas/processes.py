"""Whether another process of this server is still there (pid watching: no false deaths when a host is slow),
giving freed heap memory back to the system, and worker processes that talk through two pipes."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any


def process_alive(pid: int) -> bool:
    """Is the process there and not a zombie (a dead child its parent has not reaped yet)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # (no /proc: os.kill's answer stands)
    return state not in ("Z", "X")


_LIBC: ctypes.CDLL | None | bool = False  # (False: not looked up yet)


def give_back_memory() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim): what a large request's work freed
    stays in the process's heap otherwise, and its resident size never comes down. Elsewhere nothing happens.
    (ctypes lets go of the interpreter lock during the call.)"""
    global _LIBC
    if _LIBC is False:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = None
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def start_worker(module: str) -> tuple[subprocess.Popen, Connection, Connection]:
    """`python -m module` in a fresh interpreter (not a fork of a threaded server), and this side's ends of its two
    one-way pipes: (the process, what it sends, what it receives). The worker takes its ends with `worker_pipes`."""
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", module, str(to_child_r), str(to_parent_w)],
                            pass_fds=(to_child_r, to_parent_w), stdin=subprocess.DEVNULL)
    os.close(to_child_r)
    os.close(to_parent_w)
    return proc, Connection(to_parent_r, writable=False), Connection(to_child_w, readable=False)


def worker_pipes() -> tuple[Connection, Connection]:
    """In a process started by `start_worker`: its ends of the two pipes, (what it receives, what it sends)."""
    return Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)


class Duplex:
    """One side's two one-way pipe ends, as one connection."""

    def __init__(self, reader: Connection, writer: Connection):
        self.reader, self.writer = reader, writer

    def send(self, obj: Any) -> None:
        self.writer.send(obj)

    def recv(self) -> Any:
        return self.reader.recv()

    def poll(self, timeout: float) -> bool:
        return self.reader.poll(timeout)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A size field of a process's /proc status ("VmRSS": resident, "VmSize": address space) in bytes (Linux), or
    None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes(pid: int) -> int | None:
    """A process's resident size in bytes (Linux), or None where it cannot be read."""
    return status_bytes("VmRSS", pid)


#: a worker's task still running after this long goes on at a lower priority (YieldWhenLong): the grammar compile
#: workers' trials and the preprocessing workers' tasks
YIELD_AFTER_S = 0.5


class YieldWhenLong:
    """`with YieldWhenLong(seconds):` around one task of a worker process: if the task is still running after
    `seconds`, every thread of the process (a grammar engine's native threads too) drops to nice +`niceness`, so
    that a long compile or render gives the cores back to the engine and the front end, which serve everyone else,
    while a short task never waits for them. On exit the threads' priority is restored; where the operating system
    does not let a process raise its own priority again (an unprivileged user), `restored` is False and the owner
    replaces the worker."""

    def __init__(self, seconds: float, niceness: int = 10):
        self.seconds, self.niceness = seconds, niceness
        self.lowered = False
        self.restored = True
        self._timer: threading.Timer | None = None
        self._before: dict[int, int] = {}
        self._lock = threading.Lock()
        self._done = False  # (the task ended: a timer that fires late lowers nothing)

    def __enter__(self) -> YieldWhenLong:
        self._timer = threading.Timer(self.seconds, self._lower)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _threads(self) -> list[int]:
        try:
            return [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:  # (no /proc: this process's main thread only)
            return [0]

    def _lower(self) -> None:
        with self._lock:
            if self._done:
                return
            for tid in self._threads():
                with contextlib.suppress(OSError):
                    before = os.getpriority(os.PRIO_PROCESS, tid)
                    os.setpriority(os.PRIO_PROCESS, tid, min(before + self.niceness, 19))
                    self._before[tid] = before
            self.lowered = True

    def __exit__(self, *exc: object) -> None:
        assert self._timer is not None
        self._timer.cancel()
        with self._lock:
            self._done = True
            for tid, before in self._before.items():
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, before)
                except PermissionError:
                    self.restored = False
                except OSError:  # (a native thread that has ended since)
                    pass
            self._before.clear()
