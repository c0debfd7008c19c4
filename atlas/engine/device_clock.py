"""When the device will have run the step in flight: so that the server's engine can schedule the next step as late
as the device allows (`--tuning late_scheduling=1`).

With asynchronous scheduling the next step is scheduled and launched as soon as the previous one is, so a request
that arrives while a long step runs waits for that step and for the one already queued behind it. A server's
requests arrive at any time (a finished request's successor comes back through the front end and its client), so
they miss a step more than an offline engine's, which adds successors while it reads the outputs. Scheduling the
next step just before the device runs dry lets everything that arrived meanwhile join it.

The estimate comes from the steps' own measured times: when the host waits for a step's results, the device
finished it then; when it also waited for the step before, the device ran this one from that moment on (it was
queued behind it), so the difference is the step's device time. Those times are kept per power-of-two bucket of
scheduled tokens (an exponential average); a step of a bucket not seen yet gives no estimate, and nothing is held.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

#: A read-back that took less than this did not wait for the device (the step had already finished).
WAITED_S = 0.0002
#: Weight of a new measurement in the averages.
ALPHA = 0.25
#: Of a step's estimated device time, the share the hold may use (the rest absorbs steps shorter than estimated).
SAFE_SHARE = 0.85


@dataclass
class _Launched:
    tokens: int
    at: float  # when the host had launched it


def _bucket(tokens: int) -> int:
    return max(1, tokens).bit_length()


class DeviceClock:
    """Launches and read-backs of the engine's steps, oldest first -> when the device will be done (an estimate)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._inflight: deque[_Launched] = deque()
        self._device_s: dict[int, float] = {}  # token bucket -> device seconds of such a step
        self._done_at: float | None = None  # when the device finished the last step read back (None: not known)
        #: host seconds from the start of a step() to its launch: what a hold must leave for scheduling
        self.schedule_s = 0.001
        #: the engine process's holds so far (their count and seconds), for its stats line
        self.holds = 0
        self.held_s = 0.0

    def launched(self, tokens: int, entered_at: float) -> None:
        now = self.clock()
        self._inflight.append(_Launched(tokens, now))
        self.schedule_s += ALPHA * ((now - entered_at) - self.schedule_s)

    def read_back(self, waited_from: float) -> None:
        """The oldest step in flight was read back; the host began waiting for it at `waited_from`."""
        now = self.clock()
        step = self._inflight.popleft()
        if now - waited_from < WAITED_S:
            self._done_at = None  # (finished some time before: its end is not known)
            return
        if self._done_at is not None:
            # The device ran it from the end of the step before (it was queued behind it), or from its launch if
            # that came later.
            device_s = now - max(step.at, self._done_at)
            b = _bucket(step.tokens)
            seen = self._device_s.get(b)
            self._device_s[b] = device_s if seen is None else seen + ALPHA * (device_s - seen)
        self._done_at = now

    def dropped(self) -> None:
        """The oldest step in flight was let go unread (every request of it was aborted): its end is not known."""
        self._inflight.popleft()
        self._done_at = None

    def forget(self) -> None:
        """The steps in flight were dropped (a failed step)."""
        self._inflight.clear()
        self._done_at = None

    def busy_until(self) -> float | None:
        """When the device should still be running the one step in flight (the clock's time), with a margin; None
        when it cannot say (no step or several in flight, a step of a size never measured)."""
        if len(self._inflight) != 1:
            return None
        step = self._inflight[0]
        device_s = self._device_s.get(_bucket(step.tokens))
        if device_s is None:
            return None
        start = step.at if self._done_at is None else max(step.at, self._done_at)
        return start + SAFE_SHARE * device_s

    def hold_until(self) -> float | None:
        """Until when the next step's scheduling may wait: busy_until less the host's own scheduling time."""
        until = self.busy_until()
        return None if until is None else until - self.schedule_s
