"""Host time a step by engine function, for plain, n-gram and DFlash decoding of the shipped model: each function
of the step path is wrapped with perf_counter (a function's time includes the functions it calls), then generate()
of C held-out code prompts (128 out) runs after a warm-up, and the time of each function is divided by the engine
steps. On a small model the device is idle most of a step, so this is where a step's time goes.

    python tools/spec_host_probe.py OUT_DIR [--methods plain,ngram,dflash] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas import LLM, SamplingParams  # noqa: E402
from atlas.bench.offline import heldout_code_prompts  # noqa: E402
from atlas.engine.core import EngineCore  # noqa: E402
from atlas.engine.output_processor import OutputProcessor  # noqa: E402
from atlas.engine.scheduler import Scheduler  # noqa: E402
from atlas.runtime.cuda_graphs import StepGraphs  # noqa: E402
from atlas.runtime.model_runner import ModelRunner, StepHandle  # noqa: E402
from atlas.speculative.dflash import DFlashProposer  # noqa: E402
from atlas.speculative.ngram import NgramProposer  # noqa: E402

TIMED = [(EngineCore, ["_step", "_complete_inflight"]), (Scheduler, ["schedule", "update_from_output", "prepare_drafts"]),
         (OutputProcessor, ["process"]), (StepHandle, ["result"]), (StepGraphs, ["run", "device_step_meta"]),
         (ModelRunner, ["launch", "prepare_inputs", "_sample", "_verified_step", "_step_result", "_keep_captured_rows"]),
         (DFlashProposer, ["draft_after_verify", "propose", "on_commit", "_flush_pending", "_write_context"]),
         (NgramProposer, ["propose"])]
seconds: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def _timed(cls, name: str) -> None:
    fn, key = getattr(cls, name), f"{cls.__name__}.{name}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - t0
            calls[key] += 1

    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--methods", default="plain,ngram,dflash")
    ap.add_argument("--concurrency", default="1,16")
    args = ap.parse_args()
    for cls, names in TIMED:
        for name in names:
            _timed(cls, name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    memory = dict(gpu_memory_utilization=0.1) if torch.cuda.is_available() else dict(kv_cache_memory="256MiB")
    report = {}
    for method in args.methods.split(","):
        extra = {} if method == "plain" else dict(speculative=method, **({"num_draft_tokens": 4} if method == "ngram"
                                                                         else {}))
        llm = LLM(**memory, **extra)
        prompts = heldout_code_prompts(llm.engine.tokenizer, 32, 128)
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        for c in (int(x) for x in args.concurrency.split(",")):
            llm.generate([{"prompt_token_ids": p} for p in prompts[:c]], params)  # (warm-up)
            seconds.clear()
            calls.clear()
            steps0, t0 = llm.engine.stats.num_steps, time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts[16:16 + c]], params)
            wall, steps = time.perf_counter() - t0, llm.engine.stats.num_steps - steps0
            rows = {k: (1000 * v / steps, calls[k] / steps) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
            print(f"== {method} c={c}: {steps} steps, {1000 * wall / steps:.3f} ms a step, {c * 128 / wall:.0f} tok/s")
            for k, (ms, per_step) in rows.items():
                print(f"  {ms:7.3f} ms  x{per_step:.2f}  {k}")
            report[f"{method}_c{c}"] = {"ms_per_step": 1000 * wall / steps, "steps": steps, "rows": rows}
        del llm
    (out / "spec_host_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
