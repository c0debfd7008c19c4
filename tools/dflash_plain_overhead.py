"""What a DFlash engine's plain steps cost against a plain engine's, and how much of it is the drafter's context write:
the speculation policy keeps a drafting engine plain while drafts do not pay, and then each of its steps still
captures the target's hidden rows and writes the drafter's context K/V behind it (so that the drafter can draft at
once when it is switched back on). Three engines in turn, each timed as `atlas bench spec-cost` times a step (ms per
decode step once every request is past its prefill, median of iterations):

- plain: no proposer;
- dflash, off: the DFlash engine with the policy held at "do not draft" (every step plain; the captured rows kept in
  the drafter's backlog, written as context K/V in batches: --tuning draft_context_backlog, the default);
- dflash, off, written each step: the same with the context K/V written right behind each step (no backlog);
- dflash, off, no context: the same with the context write behind each step turned off (what the capture and the
  engine's bookkeeping for a drafting engine cost alone; the drafter's context is then stale, fine while it never
  drafts).

    python tools/dflash_plain_overhead.py --model /tmp/q8 --draft-model /tmp/q8/dflash-drafter --load-format dummy \\
        --batch-size 1,64,256 --out overhead.json
"""

from __future__ import annotations

import argparse
import json
import sys

from atlas.bench.common import release
from atlas.bench.spec_cost import time_steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch-size", default="1,64,256")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from atlas import LLM

    batches = [int(b) for b in args.batch_size.split(",")]
    common = dict(model=args.model, load_format=args.load_format, skip_tokenizer_init=True, max_model_len=args.max_model_len,
                  gpu_memory_utilization=args.gpu_memory_utilization)
    rows: dict[str, dict[int, float]] = {}

    llm = LLM(**common)
    rows["plain"] = {b: time_steps(llm, b, args.input_len, args.output_len, args.iters, seed=b)["ms_per_step"]
                     for b in batches}
    del llm
    release()

    llm = LLM(**common, speculative="dflash", draft_model=args.draft_model)
    engine = llm.engine
    engine.policy.decide = lambda request_ids, remaining=None: False  # (held plain: the drafting engine's plain steps)
    rows["dflash_off"] = {b: time_steps(llm, b, args.input_len, args.output_len, args.iters, seed=b)["ms_per_step"]
                          for b in batches}
    proposer = engine.proposer
    proposer.flush_backlog()
    proposer._backlog = None  # (write_context_behind then writes each step's rows at once)
    rows["dflash_off_written_each_step"] = {
        b: time_steps(llm, b, args.input_len, args.output_len, args.iters, seed=b)["ms_per_step"] for b in batches}
    engine.runner.context_behind = None
    rows["dflash_off_no_context"] = {
        b: time_steps(llm, b, args.input_len, args.output_len, args.iters, seed=b)["ms_per_step"] for b in batches}
    verify_steps = engine.stats.spec_num_verify_steps  # (0 expected: the policy was held plain)
    del llm, engine, proposer
    release()

    report = {"rows_ms_per_step": rows, "dflash_verify_steps": verify_steps,
              "x_plain": {k: {b: v[b] / rows["plain"][b] for b in batches} for k, v in rows.items()}}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
