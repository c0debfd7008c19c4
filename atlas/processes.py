"""Whether another process of this server is still there (pid watching: no false deaths when a host is slow), and
the lower CPU priority of background work (grammar compiles)."""

from __future__ import annotations

import os
import threading

#: how much lower than the serving threads compiles run (nice): on a busy host the engine's step loop and the
#: front ends get the cores first, and a long compile takes what they leave (on an idle core it runs at full speed)
COMPILE_NICENESS = 5


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


def lower_priority(niceness: int = COMPILE_NICENESS) -> None:
    """Lower the calling thread's CPU priority by `niceness` (Linux: the nice value is per thread; elsewhere, or
    where it cannot be changed, nothing happens)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except (AttributeError, OSError):
        pass
