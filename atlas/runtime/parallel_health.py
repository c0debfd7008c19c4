"""Failure detection of a parallel engine.

Workers publish a heartbeat (and the last step and start-up meeting point they reached) to the rendezvous
store; a watchdog thread on the driver checks the local workers' processes, the heartbeats, how long the
oldest step has been in flight and how long a start-up meeting point has waited. A worker that dies, stops
responding, or does not finish a step within --distributed-timeout ends the engine with a WorkerError that names
its rank: the watchdog kills the local workers and tells the remote ones to exit, which breaks any collective
the driver waits in. Spawned workers exit when the process that started them is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from atlas.errors import WorkerError
from atlas.processes import process_alive
from atlas.runtime.parallel_groups import exit_words

logger = logging.getLogger(__name__)

_HEARTBEAT_S = 0.5
STORE_KEY = "atlas/"


class FailureWatch:
    """The driver's watchdog over its workers, or a worker's heartbeat to it (a daemon thread from start())."""

    def __init__(self, rank: int, world_size: int, timeout: float, store, children: list,
                 parent_pid: int | None = None):
        self.rank, self.world_size = rank, world_size
        self.is_driver = rank == 0
        self.timeout = timeout
        self.store = store
        self.children = children  # (rank, multiprocessing.Process) started here
        self.parent_pid = parent_pid
        self.failure: WorkerError | None = None
        self.failure_listeners: list[Callable[[], None]] = []
        self.steps_done = 0  # (a worker: the last step it ran)
        self.meetings = 0  # start-up meeting points reached (agree_min)
        self._meeting: tuple[int, str, float] | None = None  # (the driver: the one it waits at, since when)
        self._inflight: dict[int, float] = {}  # (the driver: step number -> when it was launched)
        self._stop = threading.Event()

    def start(self) -> None:
        thread = threading.Thread(target=self._watch if self.is_driver else self._heartbeat,
                                  name=f"atlas-{'watchdog' if self.is_driver else 'heartbeat'}", daemon=True)
        thread.start()

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def meeting(self, what: str) -> Iterator[None]:
        """A start-up meeting point: a rank that does not reach it within the timeout is named."""
        self.meetings += 1
        self._meeting = (self.meetings, what, time.monotonic())
        yield
        self._meeting = None

    def step_launched(self, number: int) -> None:
        self._inflight[number] = time.monotonic()

    def step_ended(self, number: int) -> None:
        self._inflight.pop(number, None)

    def _heartbeat(self) -> None:
        beat = 0
        while not self._stop.wait(_HEARTBEAT_S):
            if self.parent_pid is not None and not process_alive(self.parent_pid):
                os._exit(1)  # the process that started this worker is gone
            beat += 1
            try:
                self.store.set(f"{STORE_KEY}hb/{self.rank}", f"{beat} {self.steps_done} {self.meetings}")
                if self.store.check([f"{STORE_KEY}abort"]):
                    logger.error("rank %d: the driver ended the engine; exiting", self.rank)
                    os._exit(1)
            except Exception as exc:  # noqa: BLE001 - the store is gone: so is the driver
                if not self._stop.is_set():
                    logger.warning("rank %d: lost the driver's store (%s: %s); exiting", self.rank,
                                   type(exc).__name__, exc)
                    logging.shutdown()
                    os._exit(1)
                return

    def _watch(self) -> None:
        seen: dict[int, tuple[str, float]] = {}
        while not self._stop.wait(_HEARTBEAT_S):
            try:
                problem = self._find_problem(seen)
            except Exception as exc:  # noqa: BLE001 - the store went away: only shutdown does that
                if not self._stop.is_set():
                    logger.debug("watchdog: %s", exc)
                continue
            if problem is not None:
                self.fail(*problem)
                return

    def _find_problem(self, seen: dict[int, tuple[str, float]], stale_after: float | None = None
                      ) -> tuple[int, str] | None:
        """The first failed rank and what happened to it, or None. `seen`: each rank's last heartbeat and
        when it changed (kept between calls); stale_after: seconds without a new one that count as dead."""
        stale_after = self.timeout if stale_after is None else stale_after
        for rank, proc in self.children:
            if proc.exitcode is not None:
                return rank, f"rank {rank} (pid {proc.pid}) {exit_words(proc.exitcode)}"
        now = time.monotonic()
        progress: dict[int, int] = {}
        met: dict[int, int] = {}
        for rank in range(1, self.world_size):
            if self.store.check([f"{STORE_KEY}error/{rank}"]):
                return rank, f"rank {rank} failed"
            key = f"{STORE_KEY}hb/{rank}"
            if not self.store.check([key]):
                continue  # still starting
            value = self.store.get(key).decode()
            if seen.get(rank, ("",))[0] != value:
                seen[rank] = (value, now)
            _, steps, meetings = value.split()
            progress[rank], met[rank] = int(steps), int(meetings)
            if now - seen[rank][1] > stale_after:
                return rank, f"rank {rank} stopped responding (no heartbeat for {now - seen[rank][1]:.0f} s)"
        meeting = self._meeting
        if meeting is not None and now - meeting[2] > self.timeout:
            behind = [r for r in range(1, self.world_size) if met.get(r, 0) < meeting[0]]
            if behind:
                return behind[0], (f"rank {behind[0]} did not reach the {meeting[1]} within --distributed-timeout "
                                   f"{self.timeout:g} s (still starting or loading?)")
        for number, started in sorted(self._inflight.items()):  # (a step left unread is no hang: ranks went on)
            if now - started <= self.timeout:
                break
            behind = [r for r in range(1, self.world_size) if progress.get(r, 0) < number]
            # A rank behind whose heartbeat has not changed since about when the step started is frozen, not slow:
            # said as such, whichever of the two deadlines this poll happens to see first (the heartbeat's change
            # is timed when this watchdog sees it, up to a poll or more after the beat).
            frozen = [r for r in behind if r in seen and seen[r][1] <= started + 4 * _HEARTBEAT_S]
            if frozen:
                rank = frozen[0]
                return rank, f"rank {rank} stopped responding (no heartbeat for {now - seen[rank][1]:.0f} s)"
            if behind:
                ranks = ", ".join(map(str, behind))
                return behind[0], (f"rank{'s' if len(behind) > 1 else ''} {ranks} did not finish step {number} "
                                   f"within --distributed-timeout {self.timeout:g} s")
        return None

    def _published_error(self, rank: int) -> str:
        with contextlib.suppress(Exception):
            key = f"{STORE_KEY}error/{rank}"
            if self.store.check([key]):
                return self.store.get(key).decode()
        return ""

    def fail(self, rank: int, what: str) -> None:
        """A worker failed: record it, and stop every worker so that nothing waits for it."""
        if self.failure is not None:
            return
        detail = self._published_error(rank)
        self.failure = WorkerError(f"{what}{f': {detail}' if detail else ''}; the engine stopped", rank=rank)
        logger.error("%s", self.failure)
        self.abort()
        for listener in self.failure_listeners:
            with contextlib.suppress(Exception):
                listener()

    def abort(self) -> None:
        """Kill the local workers and tell remote ones to exit (which also ends any collective in flight)."""
        with contextlib.suppress(Exception):
            self.store.set(f"{STORE_KEY}abort", "1")
        for _, proc in self.children:
            if proc.exitcode is None:
                proc.kill()

    def interrupted(self) -> None:
        """The driver was interrupted inside a step: the engine ends (its workers are stopped)."""
        if self.failure is None:
            self.failure = WorkerError("the engine was interrupted in the middle of a step and stopped", rank=0)
            self.abort()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def failure_from(self, exc: BaseException) -> WorkerError:
        """The error to end the engine with after `exc` broke a parallel step: the failed worker's, once the
        watchdog has named it (a collective fails as soon as a peer's connection drops), else exc's."""
        if isinstance(exc, WorkerError):
            return exc
        # A collective fails as soon as a peer's connection drops; the peer is then named by its exit (a
        # local worker), its published error, or its heartbeat stopping (4 beats missed: a remote one).
        deadline = time.monotonic() + 5.0
        seen: dict[int, tuple[str, float]] = {}
        while self.failure is None and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                problem = self._find_problem(seen, stale_after=4 * _HEARTBEAT_S)
                if problem is not None:
                    self.fail(*problem)
                    break
            time.sleep(0.05)
        if self.failure is None:
            self.failure = WorkerError(f"rank {self.rank} failed in a parallel step ({type(exc).__name__}: {exc}); "
                                       "the engine stopped", rank=self.rank)
            self.abort()
        return self.failure
