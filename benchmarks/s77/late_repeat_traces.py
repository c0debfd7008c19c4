"""Synthetic n-gram acceptance traces for tools/policy_replay.py, as benchmarks/s76/mixed_repeat_traces.py writes them
but with repeats that may begin late (at a token drawn from 10 .. --latest, 250 by default), to check that the
policy's onset rate (SpeculationPolicy.onset_window) does not give up on requests that match late: a share of the
requests falls into a repeat (every draft accepted from then on), the others never match.

    python3 benchmarks/s77/late_repeat_traces.py --share 0.8 --out /tmp/mix_late.json
    python3 benchmarks/s77/late_repeat_traces.py --share 1 --seed 1 --out /tmp/all_late.json
    PYTHONPATH=. python3 tools/policy_replay.py replay /tmp/mix_late.json --concurrency 64 --ratios 1.2,1.5,2
"""

import argparse
import json
import random


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=float, required=True, help="share of the requests that fall into a repeat")
    p.add_argument("--latest", type=int, default=250, help="the latest token a repeat may begin at")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--k", type=int, default=4, help="n-gram's drafts a step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rng = random.Random(args.seed)
    accepted = []
    for _ in range(args.requests):
        repeats = rng.random() < args.share
        start, steps, pos = rng.randint(10, args.latest), [], 0
        while pos < args.output_len:
            if repeats and pos >= start:
                steps.append(args.k)
                pos += args.k + 1
            else:
                steps.append(None)  # (no match: no draft this step)
                pos += 1
        accepted.append(steps)
    with open(args.out, "w") as f:
        json.dump({"method": "ngram", "output_len": args.output_len, "accepted": accepted}, f)


if __name__ == "__main__":
    main()
