"""Replay recorded per-request acceptances through the speculation policy, offline, for waves of requests.

`record` runs the built-in model (CPU is fine) with a proposer drafting at every step (--speculative-policy
always) on the held-out code prompts and writes each request's accepted drafts per verify step. `replay` feeds
those to atlas.speculative.policy.SpeculationPolicy in waves (all requests start together, nothing waits), with
a plain step costing 1 and a verify step `ratio`, and prints each wave's tokens per unit of time against plain
decoding (1.0): drafting at every step, the policy as it is, the policy reading each request's short running
mean in the wall-time test (its estimate before session 59), and the policy knowing each request's future mean.
A draft step's acceptance is the recorded one at the request's nearest position, so the replay is approximate
(plain steps shift the text a drafter sees), not a speed measurement.

    PYTHONPATH=. python3 tools/policy_replay.py record --method ngram --num 48 --out /tmp/acc_ngram.json \
        --stdlib-dir /tmp/stdlib
    PYTHONPATH=. python3 tools/policy_replay.py replay /tmp/acc_ngram.json --ratios 1.2,1.5,2,3
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics

from atlas.speculative.policy import SpeculationPolicy


def record(args: argparse.Namespace) -> None:
    from collections import defaultdict

    from atlas import LLM, SamplingParams
    from atlas.bench.offline import heldout_code_prompts

    accepted: dict[str, list[int]] = defaultdict(list)
    observe = SpeculationPolicy.observe_verify

    def recording(self, request_id, n, cut=None):
        accepted[request_id].append(n)
        return observe(self, request_id, n, cut)

    SpeculationPolicy.observe_verify = recording
    llm = LLM(speculative=args.method, speculative_policy="always", kv_cache_memory="512MiB")
    prompts = heldout_code_prompts(llm.get_tokenizer(), args.num, args.input_len, stdlib_dir=args.stdlib_dir)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True))
    with open(args.out, "w") as f:
        json.dump({"method": args.method, "output_len": args.output_len,
                   "accepted": [accepted[f"req-{i}"] for i in range(len(prompts))]}, f)


class _Trace:
    """One request's recorded acceptances by the position each verify step started at."""

    def __init__(self, accepted: list[int]):
        self.accepted, self.starts, pos = accepted, [], 0
        for n in accepted:
            self.starts.append(pos)
            pos += 1 + n

    def at(self, pos: int) -> int:
        return self.accepted[max(0, bisect.bisect_right(self.starts, pos) - 1)]

    def future_mean(self, pos: int) -> float:
        ahead = [n for s, n in zip(self.starts, self.accepted, strict=True) if s >= pos]
        return statistics.fmean(ahead) if ahead else 0.0


def _policy(k: int, mode: str) -> SpeculationPolicy:
    policy = SpeculationPolicy(num_draft_tokens=k, always=mode == "always")
    if mode == "short means":
        policy._shrunk = lambda r, unknown: policy.acceptance.get(r, unknown)
    return policy


def _wave(policy: SpeculationPolicy, traces: list[_Trace], wave: int, out_len: int, ratio: float, mode: str
          ) -> float:
    """One wave through `policy` (kept from wave to wave, as an engine keeps it: its step costs, its prior)."""
    ids = [f"w{wave}r{i}" for i in range(len(traces))]
    pos, time = [0] * len(traces), 0.0
    while True:
        live = [i for i in range(len(traces)) if pos[i] < out_len]
        if not live:
            for r in ids:
                policy.forget(r)
            return out_len / time
        if mode == "future means":  # (an oracle: each request's mean acceptance over the rest of its text)
            for i in live:
                policy.acceptance[ids[i]] = traces[i].future_mean(pos[i])
                policy.totals[ids[i]] = [traces[i].future_mean(pos[i]) * 1e6, 1e6]
        drafted = policy.decide([ids[i] for i in live], [out_len - pos[i] for i in live])
        for i in live:
            n = traces[i].at(pos[i]) if drafted else 0
            if drafted and mode != "future means":
                policy.observe_verify(ids[i], n)
            pos[i] += 1 + n
        time += ratio if drafted else 1.0
        policy.observe_step(drafted, len(live), ratio if drafted else 1.0)


def replay(args: argparse.Namespace) -> None:
    with open(args.trace) as f:
        data = json.load(f)
    k = {"ngram": 4, "dflash": 7}.get(data["method"], args.k)
    traces = [_Trace(a) for a in data["accepted"] if a]
    waves = [traces[i: i + args.wave] for i in range(0, len(traces) - args.wave + 1, args.wave)]
    modes = ("always", "policy", "short means", "future means")
    print(f"{data['method']}: {len(waves)} waves of {args.wave}, {data['output_len']} tokens; "
          "tokens per unit of time against plain decoding")
    print("ratio  " + "  ".join(f"{m:>12}" for m in modes))
    for ratio in (float(r) for r in args.ratios.split(",")):
        speeds = []
        for mode in modes:
            policy = _policy(k, mode)
            speeds.append(statistics.fmean(_wave(policy, w, i, data["output_len"], ratio, mode)
                                           for i, w in enumerate(waves)))
        print(f"{ratio:<5}  " + "  ".join(f"{s:>12.2f}" for s in speeds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("--method", default="ngram", choices=("ngram", "dflash"))
    r.add_argument("--num", type=int, default=48)
    r.add_argument("--input-len", type=int, default=128)
    r.add_argument("--output-len", type=int, default=128)
    r.add_argument("--stdlib-dir", default=None)
    r.add_argument("--out", required=True)
    q = sub.add_parser("replay")
    q.add_argument("trace")
    q.add_argument("--wave", type=int, default=16)
    q.add_argument("--ratios", default="1.2,1.5,2,3")
    q.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    (record if args.command == "record" else replay)(args)


if __name__ == "__main__":
    main()
