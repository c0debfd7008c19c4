"""Host time of one decode step's preparation, on whatever device the engine runs: the scheduler's `schedule()`
(which snapshots the step for the runner), and the runner's binding of the step to its per-request state plus its
input preparation (ModelRunner.bind + ModelRunner.prepare_inputs), the latter the general way and through the
plain-decode shortcut.

    python tools/prepare_inputs_bench.py --model PATH [--batch-size 1,64] [--iters 2000]

Runs a greedy generation; half-way through it, at a decode step of the whole batch, it times bind + prepare on
that very step (the runner's state is the step's then: a step's inputs read state its requests drop when they
end), the best of 10 rounds. `schedule()` is timed over every decode step of the whole batch (median).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 64


def measure(model: str, b: int, iters: int, kv_cache_memory: str) -> str:
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=512, kv_cache_memory=kv_cache_memory,
              max_num_seqs=max(b, 8), max_num_batched_tokens=max(2048, 32 * b))
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    prepare, schedule = runner.prepare_inputs, scheduler.schedule
    decode_steps, schedule_times, times = [0], [], {}

    def is_decode(batch) -> bool:
        return len(batch.num_scheduled) == b and batch.num_scheduled.count(1) == b

    def timed_schedule():
        t0 = time.perf_counter()
        out = schedule()
        if is_decode(out.batch):
            schedule_times.append(time.perf_counter() - t0)
        return out

    def timed_prepare(batch):
        inputs = prepare(batch)
        if is_decode(batch):
            decode_steps[0] += 1
            if decode_steps[0] == MAX_TOKENS // 2:
                for shortcut in (False, True):
                    runner.inputs.decode_shortcut = shortcut
                    # (the best of 10 rounds: other processes on the host only ever add time)
                    rounds = timeit.repeat(lambda: (runner.bind(batch), prepare(batch)), number=max(1, iters // 10),
                                           repeat=10)
                    times[shortcut] = min(rounds) / max(1, iters // 10)
                runner.inputs.decode_shortcut = True
        return inputs

    runner.prepare_inputs, scheduler.schedule = timed_prepare, timed_schedule
    llm.generate([[5, 6, 7, 8 + i] * 8 for i in range(b)],
                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    llm.shutdown()
    return (f"batch {b}: schedule {statistics.median(schedule_times) * 1e6:.1f} us; bind + prepare: general "
            f"{times[False] * 1e6:.1f} us, decode shortcut {times[True] * 1e6:.1f} us "
            f"({times[True] / times[False]:.2f}x)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", default="1,64")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--kv-cache-memory", default="256MiB")
    args = p.parse_args()
    for b in (int(x) for x in args.batch_size.split(",")):
        print(measure(args.model, b, args.iters, args.kv_cache_memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
