"""Whether another process of this server is still there (pid watching: no false deaths when a host is slow), and
giving freed heap memory back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: how much lower than the serving threads compiles run (nice): on a busy host the engine's step loop and the
#: front ends get the cores first, and a long compile takes what they leave (on an idle core it runs at full speed)


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
