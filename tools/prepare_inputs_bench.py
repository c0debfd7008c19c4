"""Host time of one step's input preparation (ModelRunner.prepare_inputs) for a decode batch, the general
path against the plain-decode shortcut, on whatever device the engine runs.

    python tools/prepare_inputs_bench.py --model PATH [--batch-size 1,64] [--iters 2000]

Runs a short greedy generation to get a real decode batch, then times prepare_inputs on it both ways.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas import LLM, SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", default="1,64")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--kv-cache-memory", default="256MiB")
    args = p.parse_args()
    for b in (int(x) for x in args.batch_size.split(",")):
        llm = LLM(args.model, skip_tokenizer_init=True, max_model_len=512, kv_cache_memory=args.kv_cache_memory,
                  max_num_seqs=max(b, 8))
        runner, seen = llm.engine.runner, []
        prepare = runner.prepare_inputs
        runner.prepare_inputs = lambda batch, seen=seen, prepare=prepare: (seen.append(batch), prepare(batch))[1]
        llm.generate([[5, 6, 7, 8 + i] * 8 for i in range(b)],
                     SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        batch = next(x for x in reversed(seen) if len(x.seqs) == b)
        times = {}
        for shortcut in (False, True):
            runner.inputs.decode_shortcut = shortcut
            times[shortcut] = timeit.timeit(lambda batch=batch, prepare=prepare: prepare(batch),
                                            number=args.iters) / args.iters
        print(f"batch {b}: general {times[False] * 1e6:.1f} us, decode shortcut {times[True] * 1e6:.1f} us "
              f"({times[True] / times[False]:.2f}x)")
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
