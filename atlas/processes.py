"""Whether another process of this server is still there (pid watching: no false deaths when a host is slow)."""

from __future__ import annotations

import os


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
