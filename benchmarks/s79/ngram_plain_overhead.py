"""Issue 38's n-gram row at 256 streams runs 0.959-0.961x plain with 0.2-0.6 % of its steps drafted (sessions 78, 79):
is the loss the drafting engine's plain steps, or the policy's few drafted steps? Two engines loaded side by side (three
8B engines and their KV pages would not fit one 80 GB card), the n-gram one timed in two modes, their decode steps timed as `atlas bench spec-cost` times them (bench/spec_cost.time_steps: ms a decode step once every
request is past its prefill, median of iterations), alternated over passes:

- plain: no proposer;
- ngram, held plain: the n-gram engine with its policy held at "do not draft" (every step plain);
- ngram, adaptive: the n-gram engine as it ships.

    python benchmarks/s79/ngram_plain_overhead.py --model /tmp/q8 --load-format dummy --batch-size 256 --out o.json
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch-size", default="256")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from atlas import LLM
    from atlas.bench.spec_cost import time_steps

    memory = ({"num_gpu_blocks_override": args.num_gpu_blocks_override} if args.num_gpu_blocks_override
              else {"kv_cache_memory": args.kv_cache_memory or "12GiB"})
    common = dict(model=args.model, load_format=args.load_format, skip_tokenizer_init=True, max_model_len=args.max_model_len,
                  **memory)
    plain, ngram = LLM(**common), LLM(**common, speculative="ngram")
    policy = ngram.engine.policy
    adaptive = policy.decide
    held = lambda request_ids, remaining=None: False  # noqa: E731
    engines = {"plain": (plain, None), "ngram_held_plain": (ngram, held), "ngram_adaptive": (ngram, adaptive)}
    batches = [int(b) for b in args.batch_size.split(",")]
    rows: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in engines}
    drafted = dict.fromkeys(engines, 0)
    for i in range(args.passes):
        for b in batches:
            for name, (llm, decide) in engines.items():
                if decide is not None:
                    policy.decide = decide
                drafted0 = llm.engine.stats.spec_num_drafted_steps
                ms = time_steps(llm, b, args.input_len, args.output_len, args.iters, seed=100 * i + b)["ms_per_step"]
                rows[name][b].append(ms)
                drafted[name] += llm.engine.stats.spec_num_drafted_steps - drafted0
                print(f"pass {i} batch {b} {name}: {ms:.3f} ms a step", flush=True)
    report = {"ms_per_step": rows, "drafted_steps": drafted,
              "x_plain": {name: {b: [v / p for v, p in zip(r[b], rows["plain"][b], strict=True)] for b in batches}
                          for name, r in rows.items()}}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
