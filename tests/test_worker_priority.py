"""A worker process's long task yields the cores (processes.YieldWhenLong): after the threshold every thread of the
process runs at a lower priority until the task ends, then at its own again; a short task is never touched. Shown
in this process and in a real preprocessing worker rendering a slow chat template, watched from outside."""

from __future__ import annotations

import os
import threading
import time

from atlas.processes import YieldWhenLong

ASSETS = "atlas/assets/default-model"
# A chat template that renders for about a second (a million empty loop turns) and then prints "x".
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(10) %}{% endfor %}{% endfor %}x"


def _nice(tid: int = 0) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_a_short_task_keeps_its_priority_and_a_long_one_yields_every_thread_until_it_ends():
    other_tid: list[int] = []
    stop = threading.Event()

    def bystander() -> None:  # (another thread of the process, as a grammar engine's native threads)
        other_tid.append(threading.get_native_id())
        stop.wait(10)

    thread = threading.Thread(target=bystander, daemon=True)
    thread.start()
    while not other_tid:
        time.sleep(0.01)
    base, other_base = _nice(), _nice(other_tid[0])
    with YieldWhenLong(0.3) as short:
        time.sleep(0.05)
    assert not short.lowered and _nice() == base
    with YieldWhenLong(0.1, niceness=5) as long:
        time.sleep(0.4)
        during = (_nice(), _nice(other_tid[0]))
    assert long.lowered and during == (min(base + 5, 19), min(other_base + 5, 19))
    if long.restored:  # (a privileged process raises its priority again; else the owner replaces the worker)
        assert (_nice(), _nice(other_tid[0])) == (base, other_base)
    stop.set()
    thread.join()


def test_a_preprocessing_worker_renders_a_slow_template_at_a_lower_priority_and_then_serves_at_its_own():
    from atlas.server.preprocess_workers import PreprocessWorkers

    workers = PreprocessWorkers((ASSETS, None, None), template_timeout=10.0)
    try:
        workers.start()
        assert workers.call("encode", "warm") == workers.call("encode", "warm")  # (started and answering)
        (pid,) = workers.pids()
        seen: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append(_nice(pid))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        text = workers.call("apply_chat_template", [{"role": "user", "content": "a"}], chat_template=SLOW_TEMPLATE)
        done.set()
        watcher.join()
        assert text == "x"
        base = seen[0]  # (its own priority, the server's, when the task came)
        assert base < 19 and max(seen) == min(base + 10, 19)  # (it yielded once past 0.5 s)
        if workers.pids() == [pid]:  # (kept: its priority is its own again; else it was replaced by a fresh one)
            assert _nice(pid) == base
        else:
            assert workers.recycled == 1
    finally:
        workers.close()
