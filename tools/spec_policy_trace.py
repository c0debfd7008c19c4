"""Trace the speculation policy's decisions during `atlas bench spec`: every decision with the batch size, the gain
by both tests (the module note of atlas/speculative/policy.py), the cost ratio it compared with, the longest
remainder (None: requests waiting), and the cost table at the end. Arguments after the script's name are
`atlas bench spec`'s; the trace goes to --trace (JSON lines) and a summary to stdout.

    python tools/spec_policy_trace.py --trace /tmp/trace.jsonl -- --model M --methods ngram --concurrency 64 ...
"""

from __future__ import annotations

import argparse
import json
import sys

from atlas.speculative import policy as policy_module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trace", required=True)
    p.add_argument("bench", nargs=argparse.REMAINDER)
    args = p.parse_args()
    bench = [a for a in args.bench if a != "--"]
    decide = policy_module.SpeculationPolicy._decide
    policies: list = []
    with open(args.trace, "w") as out:

        def traced(self, ids, remaining=None):
            if self not in policies:
                policies.append(self)
            drafting = decide(self, ids, remaining)
            out.write(json.dumps({
                "policy": policies.index(self), "drafting": drafting, "batch": len(ids),
                "gain": self.expected_tokens(ids, remaining), "mean_gain": self.expected_tokens(ids),
                "ratio": self.cost_ratio(len(ids)), "longest": None if remaining is None else max(remaining),
                "plain_run": self.plain_run, "probes": self.probes}) + "\n")
            return drafting

        policy_module.SpeculationPolicy._decide = traced
        from atlas.cli import main as atlas_main
        sys.argv = ["atlas", "bench", "spec", *bench]
        try:
            atlas_main()
        finally:
            for i, pol in enumerate(policies):
                table = {f"{'verify' if k[0] else 'plain'}@{k[1]}": (round(c.seconds * 1e3, 3), c.samples)
                         for k, c in sorted(pol.costs.items(), key=lambda kv: (kv[0][1], kv[0][0]))}
                print(f"policy {i}: {pol.decisions} decisions, {pol.probes} probes, {pol.switches} switches; "
                      f"cost ms (median, samples): {table}")


if __name__ == "__main__":
    main()
