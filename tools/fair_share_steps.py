"""The fair-share figures of the README's Scheduling section, in scheduler steps (no model: the scheduler and page
manager alone, each step's tokens made up): 256 slots, one API call of 2 prompts x n = 128 x 200 tokens, and at
step 20 one newcomer or a burst of 300 (16 prompt tokens, 16 output tokens each), for shares of 256 (off), 128
(the default) and 64. Prints, per case, the newcomers' mean and longest wait for their first step, the step at
which the big request ends and the preemptions.

    python tools/fair_share_steps.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_scheduler import _big, _request, _step  # noqa: E402  (the scheduler tests' made-up steps)

from atlas.engine.kv_cache import KVCacheManager  # noqa: E402
from atlas.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402


def run(share: int, newcomers: int) -> tuple[float, int, int | None, int]:
    s = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096,
                                  max_seqs_per_request=share), KVCacheManager(100_000, 16, True))
    big = [r for p in range(2) for r in _big(s, 128, prompt_len=8, max_tokens=200, parent=f"p{p}", group="call")]
    step, first, big_end = 0, {}, None
    while s.has_unfinished() or step <= 20:
        if step == 20:
            for i in range(newcomers):
                s.add(_request(f"new{i}", 16, max_tokens=16))
        batch, _ = _step(s)
        step += 1
        for r in batch.seqs:
            if r.request_id.startswith("new"):
                first.setdefault(r.request_id, step - 20)
        if big_end is None and all(r.status.is_finished for r in big):
            big_end = step
    return sum(first.values()) / len(first), max(first.values()), big_end, s.num_preemptions


def main() -> None:
    print("| newcomers | share | mean wait (steps) | longest wait | big request ends at step | preemptions |")
    print("|---:|---:|---:|---:|---:|---:|")
    for newcomers in (1, 300):
        for share in (256, 128, 64):
            mean, longest, end, preemptions = run(share, newcomers)
            print(f"| {newcomers} | {share} | {mean:.1f} | {longest} | {end} | {preemptions} |")


if __name__ == "__main__":
    main()
