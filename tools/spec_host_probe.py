"""Host time a step by engine stage, for plain, n-gram and DFlash decoding of the shipped model: the stages of
kernel_profile.host_stages (perf_counter durations; a stage's time includes the stages it calls) and a few more
of the speculative path, over generate() of C held-out code prompts (128 out) after a warm-up, divided by the
engine steps. On a small model the device is idle most of a step, so this is where a step's time goes.

    python tools/spec_host_probe.py OUT_DIR [--methods plain,ngram,dflash] [--concurrency 1,16] [--static]
        [--schedule continuous --num-prompts 64]

--schedule continuous: --num-prompts prompts with C in flight (a new one as soon as one ends, bench spec's
--schedule continuous) instead of one group of C; steps that admit a request then mix its prompt with the others'
decodes or verifies, and run eagerly (`eager_forward`).

--static (for a CPU): the uniform steps through the static buffers CUDA graphs replay (--tuning static_steps=1, the
drafter's block graphs and the block behind each verify step run eagerly), the path a GPU takes, so its host stages
(not its times, which the CPU's forward swamps) can be read where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas import LLM, SamplingParams  # noqa: E402
from atlas.bench.kernel_profile import _stage_table, host_stages  # noqa: E402
from atlas.bench.offline import heldout_code_prompts, run_pass  # noqa: E402
from atlas.runtime import step_output  # noqa: E402
from atlas.runtime.step_output import StepHandle  # noqa: E402


def speculative_stages(engine) -> list[tuple[str, object, str]]:
    """The stages of a speculative step beyond host_stages' own."""
    runner, proposer = engine.runner, engine.proposer
    stages = [("step", engine, "_step"), ("eager_forward", runner.model, "forward"),
              ("sample", runner.output, "sample"), ("read_back", StepHandle, "result"),
              ("step_result", step_output, "step_result"), ("keep_captured_rows", step_output, "keep_captured_rows")]
    if proposer is not None:
        stages.append(("on_commit", proposer, "on_commit"))
    if runner.draft_after_verify is not None:
        stages.append(("draft_after_verify", runner, "draft_after_verify"))
    if getattr(proposer, "graphs", None) is not None:
        stages.append(("block_graph", proposer.graphs, "run_staged"))
    return stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--methods", default="plain,ngram,dflash")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--static", action="store_true", help="Static-buffer paths on the CPU (see above).")
    ap.add_argument("--schedule", choices=["waves", "continuous"], default="waves")
    ap.add_argument("--num-prompts", type=int, default=64, help="With --schedule continuous.")
    ap.add_argument("--policy", default="adaptive", help="--speculative-policy: always drafts every step.")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    memory = dict(gpu_memory_utilization=0.1) if torch.cuda.is_available() else dict(kv_cache_memory="256MiB")
    report = {}
    for method in args.methods.split(","):
        extra = {} if method == "plain" else dict(speculative=method, speculative_policy=args.policy,
                                                  **({"num_draft_tokens": 4} if method == "ngram" else {}))
        llm = LLM(**memory, **extra, tuning={"static_steps": args.static})
        engine = llm.engine
        proposer = engine.proposer
        if args.static and hasattr(proposer, "capture_block_graphs"):
            proposer.capture_block_graphs(use_graphs=False)
            if proposer.drafts_after_verify:
                proposer.bind_verify_graphs(engine.runner.step_graphs.get(proposer.num_draft_tokens + 1))
        prompts = heldout_code_prompts(engine.tokenizer, 16 + max(16, args.num_prompts) + 32, 128)
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        for c in (int(x) for x in args.concurrency.split(",")):
            llm.generate([{"prompt_token_ids": p} for p in prompts[:c]], params)  # (warm-up)
            if args.schedule == "continuous":  # (and the shapes of steps that admit requests)
                run_pass(llm, prompts[-32:], c, params, args.schedule)
            times: dict[str, list[float]] = {}
            steps0, t0 = engine.stats.num_steps, time.perf_counter()
            timed = prompts[16:16 + (c if args.schedule == "waves" else args.num_prompts)]
            with host_stages(engine, times, speculative_stages(engine)):
                run_pass(llm, timed, c, params, args.schedule)
            wall, steps = time.perf_counter() - t0, engine.stats.num_steps - steps0
            table = _stage_table(None, times, steps)
            print(f"== {method} c={c}: {steps} steps, {1000 * wall / steps:.3f} ms a step, {len(timed) * 128 / wall:.0f} tok/s")
            for name, row in sorted(table.items(), key=lambda kv: -kv[1]["ms_per_step"]):
                print(f"  {row['ms_per_step']:7.3f} ms  x{row['calls_per_step']:.2f}  {name}")
            report[f"{method}_c{c}"] = {"ms_per_step": 1000 * wall / steps, "steps": steps, "stages": table}
        del llm, engine
    (out / "spec_host_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
