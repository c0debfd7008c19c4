"""--tuning late_scheduling: the device clock's estimate of when the step in flight ends (from the steps' own
measured times), and the engine process taking requests from its socket until then, so they join the next step."""

from __future__ import annotations

import logging
import pickle
import time

import pytest

from atlas.engine.device_clock import SAFE_SHARE, DeviceClock


class Clock:
    """A settable time source for the device clock (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_step_time_is_measured_from_back_to_back_read_backs():
    t = Clock()
    clock = DeviceClock(t)
    t.now = 0.000
    clock.launched(100, entered_at=0.000)  # step A
    assert clock.busy_until() is None  # (no step of this size measured yet)
    t.now = 0.001
    clock.launched(100, entered_at=0.0005)  # step B, queued behind A
    assert clock.busy_until() is None  # (two in flight)
    t.now = 0.050
    clock.read_back(waited_from=0.002)  # the host waited: A ended at 0.050; its start is not known
    assert clock.busy_until() is None
    t.now = 0.051
    clock.launched(100, entered_at=0.0505)  # step C
    t.now = 0.100
    clock.read_back(waited_from=0.052)  # B ran from A's end: 50 ms
    assert clock.busy_until() == pytest.approx(0.100 + SAFE_SHARE * 0.050)  # C runs from B's end
    assert clock.hold_until() == pytest.approx(clock.busy_until() - clock.schedule_s)
    assert 0.0005 < clock.schedule_s < 0.001  # (launch - entry, averaged)


def test_no_estimate_for_an_unmeasured_size_a_finished_step_or_after_a_failure():
    t = Clock()
    clock = DeviceClock(t)
    for at in (0.0, 0.001):
        t.now = at
        clock.launched(100, at)
    t.now, waited = 0.05, 0.002
    clock.read_back(waited)
    t.now = 0.051
    clock.launched(5000, 0.051)  # (another bucket)
    t.now = 0.1
    clock.read_back(0.052)
    assert clock.busy_until() is None  # a 5,000-token step was never measured
    t.now = 0.30
    clock.read_back(waited_from=0.30)  # it had finished already: its end is not known
    t.now = 0.31
    clock.launched(100, 0.31)
    t.now = 0.32
    assert clock.busy_until() == pytest.approx(0.31 + SAFE_SHARE * 0.050)  # from its launch: no earlier start known
    clock.forget()
    assert clock.busy_until() is None


def test_the_engine_process_takes_requests_until_the_hold_ends(tmp_path, caplog):
    """A real engine behind its socket: a request sent while the loop holds is taken in during the hold, and the
    hold lasts until the time it was given."""
    zmq = pytest.importorskip("zmq")
    from atlas import SamplingParams
    from atlas.config import EngineConfig
    from atlas.engine import wire
    from atlas.engine.core import EngineCore
    from atlas.engine.engine_process import EngineServer, StatsLog

    core = EngineCore(EngineConfig.from_kwargs(model="atlas/assets/default-model", kv_cache_memory="8MiB", max_model_len=256,
                                               tuning={"late_scheduling": True}))
    assert core.device_clock is not None
    address = f"ipc://{tmp_path}/engine.sock"
    server = EngineServer(core, address, "default")
    front = zmq.Context.instance().socket(zmq.DEALER)
    front.connect(address)
    try:
        time.sleep(0.05)
        front.send(wire.encoder.encode(wire.Add(1, "held", [1, 2, 3], pickle.dumps(SamplingParams(max_tokens=2)),
                                                time.time(), 0)))
        until = time.monotonic() + 0.3
        server._hold(until)
        assert time.monotonic() >= until - 0.001
        assert core.device_clock.holds == 1 and core.device_clock.held_s >= 0.25  # (the stats line reports these)
        assert "held" in core.parents  # (taken in during the hold: the next step schedules it)
        assert core.has_unfinished()
        server._hold(None)  # (no estimate: no hold)
        assert core.device_clock.holds == 1
        stats = StatsLog(core)
        stats.last = 0.0  # (a line is due)
        with caplog.at_level(logging.INFO, logger="atlas.engine.engine_process"):
            stats.maybe_log()
        assert "scheduling held 1 times" in caplog.text
    finally:
        front.close(linger=0)
        server._close()


def test_a_step_dropped_unread_keeps_the_clock_in_step_with_the_engine():
    """A step whose every request was aborted is let go without a read-back (EngineCore.has_unfinished): the clock
    drops it too, so the next read-back is the next step's and the one left in flight gets an estimate."""
    t = Clock()
    clock = DeviceClock(t)
    for at in (0.0, 0.001):
        t.now = at
        clock.launched(100, at)
    t.now = 0.05
    clock.read_back(0.002)
    t.now = 0.051
    clock.launched(100, 0.051)
    t.now = 0.1
    clock.read_back(0.052)  # (measured: 50 ms)
    clock.dropped()  # (the step launched at 0.051: every request of it was aborted)
    assert clock.busy_until() is None
    t.now = 0.102
    clock.launched(100, 0.102)
    assert clock.busy_until() == pytest.approx(0.102 + SAFE_SHARE * 0.050)  # (from its launch: the end before unknown)


def test_the_engine_keeps_its_clock_in_step_with_its_steps_in_flight():
    """A real engine (asynchronous scheduling: a step stays in flight between step() calls): the clock holds what the
    engine holds, also when every request of the step in flight is aborted and the step is let go unread."""
    from atlas import SamplingParams
    from atlas.config import EngineConfig
    from atlas.engine.core import EngineCore

    core = EngineCore(EngineConfig.from_kwargs(model="atlas/assets/default-model", kv_cache_memory="8MiB",
                                               max_model_len=256, tuning={"late_scheduling": True}))
    core.add_request({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=50), "a")
    for _ in range(3):
        core.step()
        assert len(core.device_clock._inflight) == len(core._inflight) == 1
    core.abort_request("a")
    assert not core.has_unfinished()
    assert len(core.device_clock._inflight) == len(core._inflight) == 0
