"""`atlas bench structured`: what a JSON-schema constraint costs in decode throughput, against the same
requests unconstrained, in the same run.

Each concurrency runs the same prompts twice, greedy with a fixed output length: plainly, then with a JSON
schema (an array of at least 10,000 records, so the grammar is active for every token and no request
ends early). The constrained run pays for everything structured outputs add on the step's path: the
bitmask rows built on the host between steps, their copy and application in the sampler, the sampler
instead of the in-graph argmax, and no overlap of the next step with the last one's read-back. Two of
those parts are also timed alone: building the bitmasks (host, per step) and applying them in the sampler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from atlas.bench.common import engine_kwargs, machine, sync, write_report
from atlas.bench.offline import load_prompts
from atlas.config import EngineConfig

SCHEMA = {
    "type": "array",
    "minItems": 10000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kind": {"enum": ["module", "class", "function", "method"]},
            "line": {"type": "integer", "minimum": 0},
            "public": {"type": "boolean"},
        },
        "required": ["name", "kind", "line", "public"],
        "additionalProperties": False,
    },
}


def _params(output_len: int, constrained: bool):
    from atlas import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=not constrained,
                          structured_outputs={"json": SCHEMA} if constrained else None)


def _time_once(llm, prompts: list[list[int]], concurrency: int, output_len: int, constrained: bool
               ) -> tuple[float, int, int, float]:
    """(seconds, output tokens, engine steps, seconds spent building bitmasks) for all prompts."""
    engine = llm.engine
    params = _params(output_len, constrained)
    mask_seconds = [0.0]
    manager = engine._structured
    real_fill = manager.fill_step_bitmask if manager is not None else None
    if manager is not None:
        def timed(*step):
            t = time.perf_counter()
            try:
                return real_fill(*step)
            finally:
                mask_seconds[0] += time.perf_counter() - t

        manager.fill_step_bitmask = timed
    steps_before = engine.stats.num_steps
    sync(engine.device)
    t0 = time.perf_counter()
    outputs = []
    try:
        for i in range(0, len(prompts), concurrency):
            outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[i: i + concurrency]], params)
        sync(engine.device)
    finally:
        if manager is not None:
            manager.fill_step_bitmask = real_fill
    seconds = time.perf_counter() - t0
    if constrained and not all(o.outputs[0].finish_reason == "length" for o in outputs):
        raise SystemExit("a constrained request ended before --output-len: the workload is not what it claims")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return seconds, tokens, engine.stats.num_steps - steps_before, mask_seconds[0]


def measure(llm, prompts: list[list[int]], concurrency: int, output_len: int, repeats: int) -> list[dict]:
    """Both runs, alternated `repeats` times after a warm-up of each; the fastest repeat of each counts (on a
    shared machine the fastest is the one least slowed by others), the median is given too."""
    for constrained in (False, True):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:concurrency]], _params(output_len, constrained))
    times: dict[bool, list] = {False: [], True: []}
    for _ in range(repeats):
        for constrained in (False, True):
            times[constrained].append(_time_once(llm, prompts, concurrency, output_len, constrained))
    rows = []
    for constrained in (False, True):
        seconds, tokens, steps, mask = min(times[constrained])
        each = [1000 * t[0] / t[2] for t in times[constrained]]
        rows.append({"run": "json schema" if constrained else "unconstrained", "concurrency": concurrency,
                     "tok/s": tokens / seconds, "ms/step": 1000 * seconds / steps,
                     "median ms/step": statistics.median(each), "steps": steps,
                     "bitmask ms/step": 1000 * mask / steps if constrained else None,
                     "ms/step of each repeat": [round(x, 2) for x in each]})
    plain, constrained = rows
    plain["mask apply ms/step"] = None
    constrained["mask apply ms/step"] = 1000 * _apply_seconds(llm, concurrency)
    for key, name in (("ms/step", "overhead"), ("median ms/step", "overhead of medians")):
        constrained[name] = f"{100 * (constrained[key] / plain[key] - 1):+.1f} %"
        plain[name] = None
    return rows


def _apply_seconds(llm, rows: int, repeats: int = 30) -> float:
    """The sampler's share: applying `rows` bitmask rows to logits of the model's width (fastest of repeats;
    the work does not depend on the bits). It goes through `apply_token_bitmask` as the sampler does, so it
    times the path the sampler takes: on CUDA the Triton kernel and its copy of the logits (the first,
    compiling call is never the fastest), else the PyTorch ops."""
    import torch

    from atlas.runtime.sampler import apply_token_bitmask

    device = llm.engine.device
    vocab = llm.engine.model_config.vocab_size
    logits = torch.randn(rows, vocab, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, device=device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        apply_token_bitmask(logits, bitmask, None)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def cmd_structured(args: argparse.Namespace) -> int:
    from atlas import LLM

    llm = LLM(**engine_kwargs(args))
    rows = []
    for c in args.concurrency:
        prompts = load_prompts(args.prompts, llm, c * args.waves, args.input_len, args.stdlib_dir)
        rows += measure(llm, prompts, c, args.output_len, args.repeats)
    meta = {"machine": machine(), "model": args.model or "default", "input_len": args.input_len,
            "output_len": args.output_len, "waves": args.waves, "repeats": args.repeats, "schema": SCHEMA,
            "command": args.command_line}
    write_report(args.output_json, f"structured outputs: {args.input_len} in / {args.output_len} out, greedy, "
                                   "JSON schema against unconstrained (fastest of the repeats)", rows, meta)
    return 0


def add_structured_benchmark(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured", help="Decode throughput with a JSON-schema constraint vs the same requests "
                                          "unconstrained.")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 32])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--waves", type=int, default=1, help="Groups of `concurrency` requests per measurement.")
    p.add_argument("--repeats", type=int, default=3, help="Measurements of each run, alternated; the fastest counts.")
    p.add_argument("--prompts", default="heldout-code",
                   help="heldout-code (held-out stdlib files), random, or a text/JSONL file of prompts.")
    p.add_argument("--stdlib-dir", default=None)
    p.add_argument("--output-json", default=None, help="Write the results here (and a .txt beside it).")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_structured, command_line="atlas " + " ".join(sys.argv[1:]))
