"""Replay recorded per-request acceptances through the speculation policy, offline, in waves or continuously.

`record` runs the built-in model (CPU is fine) with a proposer drafting at every step (--speculative-policy always)
on the held-out code prompts and writes each request's accepted drafts per verify step (null where the proposer had
no draft). `replay` feeds those to atlas.speculative.policy.SpeculationPolicy, --concurrency at a time, in waves (a
group starts when the last has ended: nothing waits) or --continuous (a request starts as soon as a slot frees), one
policy throughout as an engine keeps one, and prints plain decoding's time over the policy's: drafting at every
step, the policy as it is, the policy reading each request's short running mean in the wall-time test, and the
policy knowing each request's future mean. Unit costs: a plain step 1, a verify step `ratio`, a drafting step where
no request had a draft --empty-cost, a step of the other kind than the last one --switch-cost more (the overlap lost
around a switch). A drafted step's acceptance is the recorded one at the request's nearest position, so the replay
is an approximation of the policy's decisions (plain steps shift the text a drafter sees), not a speed measurement.

    PYTHONPATH=. python3 tools/policy_replay.py record --method ngram --num 48 --out /tmp/acc_ngram.json \
        --stdlib-dir /tmp/stdlib
    PYTHONPATH=. python3 tools/policy_replay.py replay /tmp/acc_ngram.json --concurrency 16 --ratios 1.2,1.5,2
    PYTHONPATH=. python3 tools/policy_replay.py replay /tmp/acc_ngram.json --concurrency 1 --set acceptance_weight=0.5
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import statistics

from atlas.speculative.policy import SpeculationPolicy


def record(args: argparse.Namespace) -> None:
    from collections import defaultdict

    from atlas import LLM, SamplingParams
    from atlas.bench.offline import heldout_code_prompts

    accepted: dict[str, list[int | None]] = defaultdict(list)  # (None: the proposer had no draft that step)
    observe, observe_empty = SpeculationPolicy.observe_verify, SpeculationPolicy.observe_empty
    empty = [False]

    def recording(self, request_id, n, cut=None):
        accepted[request_id].append(None if empty[0] else n)
        return observe(self, request_id, n, cut)

    def recording_empty(self, request_id, batch_size):
        empty[0] = True
        try:
            return observe_empty(self, request_id, batch_size)
        finally:
            empty[0] = False

    SpeculationPolicy.observe_verify, SpeculationPolicy.observe_empty = recording, recording_empty
    llm = LLM(speculative=args.method, speculative_policy="always", kv_cache_memory="512MiB")
    prompts = heldout_code_prompts(llm.get_tokenizer(), args.num, args.input_len, stdlib_dir=args.stdlib_dir)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True))
    with open(args.out, "w") as f:
        json.dump({"method": args.method, "output_len": args.output_len,
                   "accepted": [accepted[f"req-{i}"] for i in range(len(prompts))]}, f)


class _Trace:
    """One request's recorded acceptances by the position each verify step started at."""

    def __init__(self, accepted: list[int | None]):
        self.accepted, self.starts, pos = accepted, [], 0
        for n in accepted:
            self.starts.append(pos)
            pos += 1 + (n or 0)

    def at(self, pos: int) -> int | None:
        """Accepted drafts at this position (None: no draft there)."""
        return self.accepted[max(0, bisect.bisect_right(self.starts, pos) - 1)]

    def future_mean(self, pos: int) -> float:
        ahead = [n or 0 for s, n in zip(self.starts, self.accepted, strict=True) if s >= pos]
        return statistics.fmean(ahead) if ahead else 0.0


def _policy(k: int, mode: str, settings: dict) -> SpeculationPolicy:
    policy = SpeculationPolicy(num_draft_tokens=k, always=mode == "always", **settings)
    if mode == "short means":
        policy._shrunk = lambda r, unknown: policy.acceptance.get(r, unknown)
    return policy


def _serve(policy: SpeculationPolicy, traces: list[_Trace], concurrency: int, continuous: bool, out_len: int,
           ratio: float, mode: str, empty_cost: float, switch_cost: float) -> float:
    """Every trace through `policy` (one policy throughout, as an engine keeps one: its step costs, its prior), at
    most `concurrency` at a time: in waves (a group starts when the last one has ended) or continuously (a request
    starts as soon as a slot frees; while some wait, the policy is told nothing of the remainders). -> plain
    decoding's time over this one's. A drafting step where no request has a draft costs `empty_cost` (a plain step
    that lost its overlap) and is not timed, as the engine does not time it. A step whose kind (drafting or plain)
    differs from the last one's costs `switch_cost` more (the overlap lost around a switch: the step before a probe
    is read back before it drafts, the one after it waits for its accepted count)."""
    waiting = list(range(len(traces)))
    live: list[int] = []
    pos, time, last = [0] * len(traces), 0.0, None
    while waiting or live:
        if not live or (continuous and len(live) < concurrency and waiting):
            while waiting and len(live) < concurrency:
                live.append(waiting.pop(0))
        ids = [f"r{i}" for i in live]
        if mode == "future means":  # (an oracle: each request's mean acceptance over the rest of its text)
            policy.prior = 0.0 if policy.prior is None else policy.prior
            for i, r in zip(live, ids, strict=True):
                policy.acceptance[r] = traces[i].future_mean(pos[i])
                policy.totals[r] = [traces[i].future_mean(pos[i]) * 1e6, 1e6]
        drafted = policy.decide(ids, None if continuous and waiting else [out_len - pos[i] for i in live])
        verified = False
        for i, r in zip(live, ids, strict=True):
            n = traces[i].at(pos[i]) if drafted else 0
            if drafted and n is None and mode != "future means":
                policy.observe_empty(r, len(live))
            elif drafted and mode != "future means":
                policy.observe_verify(r, n)
            verified |= bool(drafted and n is not None)
            pos[i] = min(out_len, pos[i] + 1 + (n or 0))
        cost = (ratio if verified else (empty_cost if drafted else 1.0)) + (switch_cost if last not in (None, drafted)
                                                                            else 0.0)
        last = drafted
        time += cost
        if drafted and not verified:
            policy.observe_gap()
        else:
            policy.observe_step(verified, len(live), cost)
        for i in [i for i in live if pos[i] >= out_len]:
            live.remove(i)
            policy.forget(f"r{i}")
    return -(-len(traces) // concurrency) * out_len / time


def replay(args: argparse.Namespace) -> None:
    with open(args.trace) as f:
        data = json.load(f)
    k = {"ngram": 4, "dflash": 7}.get(data["method"], args.k)
    traces = [_Trace(a) for a in data["accepted"] if a]
    settings = {}
    types = {f.name: f.type for f in dataclasses.fields(SpeculationPolicy)}
    for item in args.set:
        name, value = item.split("=", 1)
        settings[name] = int(value) if types.get(name) == "int" else float(value)  # (the field's own type)
    modes = ("always", "policy", "short means", "future means")
    schedule = "continuously" if args.continuous else "in waves"
    print(f"{data['method']}: {len(traces)} requests of {data['output_len']} tokens, {args.concurrency} at a time "
          f"{schedule}; tokens per unit of time against plain decoding")
    print("ratio  " + "  ".join(f"{m:>12}" for m in modes))
    for ratio in (float(r) for r in args.ratios.split(",")):
        speeds = [_serve(_policy(k, mode, settings), traces, args.concurrency, args.continuous, data["output_len"],
                         ratio, mode, args.empty_cost, args.switch_cost) for mode in modes]
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
    q.add_argument("--concurrency", type=int, default=16)
    q.add_argument("--continuous", action="store_true", help="A request starts as soon as a slot frees.")
    q.add_argument("--ratios", default="1.2,1.5,2,3")
    q.add_argument("--k", type=int, default=4)
    q.add_argument("--empty-cost", type=float, default=1.1,
                   help="A drafting step where no request had a draft, in plain steps (it lost its overlap).")
    q.add_argument("--switch-cost", type=float, default=0.45,
                   help="What a step costs more when the last step was of the other kind, in plain steps.")
    q.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="A SpeculationPolicy setting for the replay, e.g. acceptance_weight=0.25.")
    args = p.parse_args()
    (record if args.command == "record" else replay)(args)


if __name__ == "__main__":
    main()
