"""Synthetic acceptance traces for tools/policy_replay.py: n-gram on a random model's greedy text, where a share of
the requests falls into a repeat at some point (every draft accepted from then on) and the others never match (no
draft). Session 76's H100 row of n-gram at 64 streams drafted 4.5 % of its steps with every draft accepted and ran
0.957x plain; these traces reproduce that loss in the replay (README.md here).

    python3 benchmarks/s76/mixed_repeat_traces.py --share 0.8 --out /tmp/mix_0.8.json
    python3 benchmarks/s76/mixed_repeat_traces.py --share 0.8 --latest 250 --out /tmp/mix_late.json   # (session 77)
    PYTHONPATH=. python3 tools/policy_replay.py replay /tmp/mix_0.8.json --concurrency 64 --ratios 1.2,1.5,2
"""

import argparse
import json
import random


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=float, required=True, help="share of the requests that fall into a repeat")
    p.add_argument("--latest", type=int, default=120, help="the latest token a repeat may begin at (from 10)")
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
