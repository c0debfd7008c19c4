"""A timeline of steady batch-1 decode steps: torch.profiler over a few engine steps, written as JSON events in
time order (device kernels and copies; the host's CUDA runtime calls, engine stages and a few aten ops), to place
the device's idle gaps against what the host was doing (BENCHMARKS.md, session 23).

    python tools/decode_timeline.py --model /tmp/q8 --out timeline_b1.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas import LLM, SamplingParams  # noqa: E402
from atlas.bench.kernel_profile import host_stages  # noqa: E402


def kept(name: str, on_device: bool) -> bool:
    return on_device or name.startswith(("atlas::", "cuda", "aten::copy_", "aten::index")) or "synchron" in name.lower()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--warmup-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="timeline_b1.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    llm = LLM(model=args.model, skip_tokenizer_init=True, gpu_memory_utilization=0.85, max_model_len=args.max_model_len)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(100, vocab - 1, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=args.warmup_steps + args.steps + 8, temperature=0, ignore_eos=True))
    for _ in range(args.warmup_steps):
        engine.step(final_only=True)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with host_stages(engine), profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step(final_only=True)
        if cuda:
            torch.cuda.synchronize()
    events = []
    for e in prof.events():
        on_device = "CUDA" in str(e.device_type)
        if kept(e.name, on_device):
            events.append({"name": e.name[:90], "dev": "gpu" if on_device else "cpu", "ts": e.time_range.start,
                           "dur": e.time_range.elapsed_us()})
    events.sort(key=lambda d: d["ts"])
    Path(args.out).write_text(json.dumps(events))
    print(f"{len(events)} events -> {args.out}")
    while engine.has_unfinished():
        engine.step(final_only=True)


if __name__ == "__main__":
    main()
