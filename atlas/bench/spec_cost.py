"""`atlas bench spec-cost`: what one speculative step costs, against one plain decode step measured in
the same run, and the speed-up that a drafter of acceptance length tau would give.

Three kinds of engine step, each timed as (whole generate - its prefill) / decode steps, so host work
between steps counts:
- plain: one token per step;
- verify K: every step verifies exactly K drafts (a proposer that always proposes K tokens, so the
  cost is the target's alone);
- dflash K (with --draft-model): a DFlash step with K drafts: the verify, the drafter's context write
  and block, and the host work between them; with --speculative eagle3 or draft_model, that drafter's step
  instead (its pass over committed rows, its K chained steps, the verify).
With random weights almost no draft is accepted, so every step is a full step whose cost does not
depend on acceptance. A drafter that accepts tau tokens a step then gives tau x plain / (its step).
--profile DIR adds torch.profiler summaries of each kind of step (kernels by kind, host gap).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from atlas.bench.common import (
    engine_kwargs,
    machine,
    random_prompts,
    release,
    step_until_decoding,
    sync,
    write_report,
)
from atlas.config import DFLASH_ONLY_OPTIONS
from atlas.errors import AtlasError

logger = logging.getLogger(__name__)

TAUS = (3, 5, 7)
#: the drafters a --draft-model row can time (--speculative picks one; dflash when not given)
DRAFTERS = ("dflash", "eagle3", "draft_model")


def fixed_drafts(num_draft_tokens: int):
    """A proposer of always K drafts (the last token repeated): isolates what verifying K drafts costs the
    target. (Made here so that `atlas bench --help` does not import torch.)"""
    from atlas.speculative.proposer import Draft, DraftProposer

    class FixedDrafts(DraftProposer):
        def __init__(self, k: int):
            self.num_draft_tokens = k

        def propose(self, requests) -> list[Draft]:
            return [Draft([r.all_token_ids[-1]] * self.num_draft_tokens) for r in requests]

    return FixedDrafts(num_draft_tokens)


def time_steps(llm, batch: int, input_len: int, output_len: int, iters: int, seed: int) -> dict[str, Any]:
    """Median ms per decode step of `batch` requests, and the acceptance length seen. Each iteration times the
    engine's steps once every request is past its prefill, to the end (timing whole generations and subtracting a
    prefill-only one instead could come out negative on a busy host)."""
    from atlas import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size

    def run(s: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        for p in random_prompts(vocab, batch, input_len, seed=s):
            engine.add_request({"prompt_token_ids": p}, params)
        step_until_decoding(engine)
        sync(engine.device)
        before = engine.stats.num_steps
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step(final_only=True)
        sync(engine.device)
        return time.perf_counter() - t0, engine.stats.num_steps - before

    run(seed)  # warm-up with the measured shapes
    per_step = []
    stats0 = (engine.stats.spec_num_accepted_tokens, engine.stats.spec_num_verify_steps)
    for i in range(iters):
        elapsed, steps = run(seed + 1 + i)
        if steps:
            per_step.append(elapsed / steps)
    accepted = engine.stats.spec_num_accepted_tokens - stats0[0]
    verifies = engine.stats.spec_num_verify_steps - stats0[1]
    if not per_step:
        raise AtlasError(f"--output-len {output_len} leaves no decode step to time: use --output-len 4 or more")
    return {"ms_per_step": 1000 * statistics.median(per_step),
            "acceptance_length": (accepted + verifies) / verifies if verifies else None}


def profile_steps(llm, batch: int, args: argparse.Namespace, step_s: float, seed: int) -> tuple[dict[str, Any], str]:
    """torch.profiler over --profile-steps engine steps once every request is past its prefill
    (kernel_profile.profile_running): kernels and device time a step by kind, the device's idle gaps, and the
    engine's host stages (profiled and unprofiled)."""
    from atlas import SamplingParams
    from atlas.bench.kernel_profile import profile_running

    engine = llm.engine

    def add_requests() -> None:
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        for p in random_prompts(engine.model_config.vocab_size, batch, args.input_len, seed=seed):
            engine.add_request({"prompt_token_ids": p}, params)

    steps = max(1, min(args.profile_steps, (args.output_len - 4) // 2))
    return profile_running(engine, add_requests, steps, engine.model_config.num_hidden_layers, engine.device)


def _write_profile(root: Path, stem: str, profile: tuple[dict[str, Any], str]) -> None:
    from atlas.bench.kernel_profile import format_summary

    summary, table = profile
    root.mkdir(parents=True, exist_ok=True)
    (root / f"spec_cost_{stem}.json").write_text(json.dumps(summary, indent=2))
    (root / f"spec_cost_{stem}_table.txt").write_text(table)
    text = format_summary(f"spec-cost {stem}", summary)
    with open(root / "spec_cost_summary.txt", "a") as f:
        f.write(text + "\n\n")
    print(text)


def cmd_spec_cost(args: argparse.Namespace) -> int:
    from atlas import LLM

    rows: list[dict[str, Any]] = []
    if args.profile:
        (Path(args.profile) / "spec_cost_summary.txt").unlink(missing_ok=True)  # (summaries are appended)
    methods: list[tuple[str, int | None]] = [("plain", None)]
    methods += [("verify", k) for k in args.draft_lengths]
    drafter = args.speculative if args.speculative in DRAFTERS else "dflash"
    if args.draft_model:
        methods += [(drafter, k) for k in args.draft_lengths]
    for name, k in methods:
        # (every step of a verify or drafter row drafts: the cost of such steps is what is measured)
        overrides: dict[str, Any] = {"speculative": None, "num_draft_tokens": None, "speculative_policy": "always"}
        if name == "verify":
            overrides.update(speculative="ngram", num_draft_tokens=k)
        elif name == drafter:  # (its own options as given: --draft-model, --speculative-token-map)
            overrides.update(speculative=drafter, num_draft_tokens=k)
        if name != drafter:
            overrides.update(dict.fromkeys(DFLASH_ONLY_OPTIONS))
        llm = LLM(**engine_kwargs(args, **overrides))
        if name == "verify":
            llm.engine.proposer = fixed_drafts(k)
        for b in args.batch_size:
            result = time_steps(llm, b, args.input_len, args.output_len, args.num_iters, seed=1000 * b)
            row = {"step": name, "K": k, "batch_size": b, "ms_per_step": result["ms_per_step"],
                   "acceptance_length": result["acceptance_length"]}
            if name == "plain":
                row["x_plain"] = 1.0
            if llm.engine.runner.prelaunches:  # (verify steps queued behind their drafted block)
                row.update(prelaunched=llm.engine.runner.prelaunches,
                           prelaunches_adopted=llm.engine.runner.prelaunches_adopted)
            rows.append(row)
            logger.info("%s K=%s batch %d: %.3f ms/step", name, k, b, result["ms_per_step"])
            if args.profile:
                _write_profile(Path(args.profile), f"{name}{k or ''}_b{b}",
                               profile_steps(llm, b, args, result["ms_per_step"] / 1000, seed=5000 + b))
        del llm
        release()
        _report(args, rows)  # after every engine, so a run cut short keeps what it measured
    return 0


def _report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import torch
    for row in rows:
        plain_ms = next(r for r in rows if r["step"] == "plain" and r["batch_size"] == row["batch_size"])["ms_per_step"]
        row["x_plain"] = row["ms_per_step"] / plain_ms
        for tau in TAUS:  # (for verify rows: what a drafter that costs nothing would give)
            row[f"speedup_tau{tau}"] = tau * plain_ms / row["ms_per_step"] if row["step"] != "plain" else None
    meta = {"machine": machine(), "model": args.model or "default", "draft_model": args.draft_model,
            "input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
            "command": args.command_line, "torch": torch.__version__}
    write_report(args.output_json, f"speculative step cost: {args.input_len} in, {args.output_len} out, greedy, "
                 f"against one plain decode step", rows, meta)


def add_spec_cost_benchmark(sub: argparse._SubParsersAction) -> None:
    from atlas.bench.speed import _ints
    from atlas.config import EngineConfig

    p = sub.add_parser("spec-cost", help="Cost of a verify step and of a drafter's step (DFlash; --speculative eagle3 or "
                                         "draft_model) against a plain decode step.")
    g = p.add_argument_group("workload")
    g.add_argument("--batch-size", type=_ints, default=[1], help="Requests decoding at once (comma-separated).")
    g.add_argument("--draft-lengths", type=_ints, default=[7, 15], help="K values to measure (comma-separated).")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--num-iters", type=int, default=3)
    g.add_argument("--output-json", default=None, help="Write the results here (and a .txt beside it).")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="Also run torch.profiler over each engine's steps; summaries and tables go to DIR.")
    g.add_argument("--profile-steps", type=int, default=10, help="Engine steps profiled per engine and batch size.")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_spec_cost, command_line="atlas " + " ".join(sys.argv[1:]))
