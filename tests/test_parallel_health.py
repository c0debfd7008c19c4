"""The driver's watchdog (runtime/parallel_health.FailureWatch) names what went wrong with a rank from the
heartbeats in the store and the steps in flight, without processes: a rank that beats but does not finish an overdue
step did not finish it; a rank whose heartbeat stopped about when the step started is frozen, whichever deadline a
poll sees first (the test that freezes a real worker with SIGSTOP met both orders)."""

from __future__ import annotations

import time

from torch.distributed import HashStore

from atlas.runtime.parallel_health import STORE_KEY, FailureWatch


def _watch(timeout: float = 5.0) -> tuple[FailureWatch, HashStore]:
    store = HashStore()
    return FailureWatch(0, 2, timeout, store, children=[]), store


def test_a_rank_that_beats_but_does_not_finish_an_overdue_step_did_not_finish_it():
    watch, store = _watch()
    store.set(f"{STORE_KEY}hb/1", "1 114 3")
    now = time.monotonic()
    seen = {1: ("1 114 3", now - 0.2)}  # (a beat seen just now: the rank is alive)
    watch.step_launched(115)
    watch._inflight[115] = now - 6.0  # (launched 6 s ago: past the 5 s timeout)
    store.set(f"{STORE_KEY}hb/1", "2 114 3")
    assert watch._find_problem(seen) == (1, "rank 1 did not finish step 115 within --distributed-timeout 5 s")


def test_a_rank_whose_heartbeat_stopped_as_the_step_started_is_frozen_whichever_deadline_comes_first():
    watch, store = _watch()
    store.set(f"{STORE_KEY}hb/1", "7 114 3")
    now = time.monotonic()
    # Its last beat was seen 0.3 s after the step was launched (the watchdog polls every 0.5 s), 5.7 s ago: the
    # step's deadline has passed, the heartbeat's 5 s not yet counted from when it was seen.
    watch._inflight[115] = now - 6.0
    seen = {1: ("7 114 3", now - 5.7)}
    rank, words = watch._find_problem(seen, stale_after=10.0)
    assert rank == 1 and words.startswith("rank 1 stopped responding (no heartbeat for")
