"""Profile windows of engine steps inside an offline run (many prompts submitted at once), where steps mix
prompt chunks with decode rows: kernels by kind, host gap and idle gaps of each window (torch.profiler), and
what the window's steps held. `atlas bench latency --profile` covers pure prefill and pure decode steps; this
covers the steps in between.

    python tools/offline_step_profile.py --model DIR --skip-tokenizer-init --num-prompts 300 \\
        --input-len 512 --output-len 256 --windows 4:3,40:3 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from atlas.bench.common import engine_kwargs, random_prompts
from atlas.bench.kernel_profile import format_summary, run_profiled, summarize
from atlas.bench.throughput import StepTimeline
from atlas.config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--windows", default="4:3,40:3",
                   help="FIRST:COUNT,...: profile COUNT steps from engine step FIRST of the run (0-based).")
    p.add_argument("--out", default=None, help="Write the summaries here (JSON).")
    EngineConfig.add_cli_args(p)
    args = p.parse_args(argv)
    windows = sorted((int(a), int(b)) for a, b in (w.split(":") for w in args.windows.split(",")))

    from atlas import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    device = next(engine.runner.model.parameters()).device
    vocab, layers = engine.model_config.vocab_size, engine.model_config.num_hidden_layers
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    warm = random_prompts(vocab, 8, args.input_len, seed=1)  # kernels compiled outside the windows
    llm.generate([{"prompt_token_ids": t} for t in warm], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for tokens in random_prompts(vocab, args.num_prompts, args.input_len, seed=2):
        engine.add_request({"prompt_token_ids": tokens}, params)
    timeline = StepTimeline(engine.runner, device)
    results, step = [], 0
    for first, count in windows:
        while step < first and engine.has_unfinished():
            engine.step()
            step += 1
        if not engine.has_unfinished():
            break
        held = len(timeline.rows)

        def steps(n: int = count) -> None:
            for _ in range(n):
                engine.step()

        events, wall, _ = run_profiled(steps, device)
        step += count
        summary = summarize(events, count, layers, wall / count, device)
        summary["steps_held"] = [{"prompt_tokens": a, "decode_rows": b} for a, b in timeline.rows[held:]]
        title = f"offline steps {first}..{first + count - 1}: {summary['steps_held']}"
        print(format_summary(title, summary), flush=True)
        results.append({"first": first, "count": count, **summary})
    while engine.has_unfinished():
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    overall = timeline.close()
    print("whole run:", json.dumps(overall))
    if args.out:
        Path(args.out).write_text(json.dumps({"windows": results, "timeline": overall, "argv": sys.argv}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
