"""Tensor / pipeline-parallel layouts of one checkpoint against one device, in one run (tools/gpu_parallel.sh).

    python tools/parallel_bench.py --model CKPT --layouts 1x1,2x1 --out results/check.json

For each layout TPxPP (1x1 first: the peer every ratio is against; TPxPP:nccl and TPxPP:symm_mem run it
with the tuning knob tp_all_reduce=nccl (NCCL for every all-reduce) or symm_mem (torch's symmetric-memory op)
instead of the default peer-memory all-reduce; TPxPP:gemv also with gemv=auto; TPxPP:eager with pp_graphs=0,
pipeline stages without their CUDA graphs), one engine at a time here:
  1. greedy tokens in --check-dtype (float32 by default: tensor parallelism sums partial products in another
     order, so only in float32 are the logits close enough for every greedy token to match one device),
     --check-prompts random prompts, --check-tokens each; they must equal 1x1's;
  2. in the checkpoint's dtype: the same greedy tokens (their agreement with 1x1 is reported, not required),
     then batch-1 decode: a --input-len prompt, time to the first token and to --output-len tokens, median
     of --iters runs after a warm-up; decode tok/s = (output-len - 1) / (total - first token).
With --profile-steps, the decode phase also profiles that many decode steps on the driver and asks each
worker for its host time over the same number of steps (waiting for each step's message, launching it).
Writes JSON and a .txt table beside it; exits 1 if a float32 check differs.

With --part LAYOUT:check or LAYOUT:decode, one engine in this process: its part goes to
<out>.parts/LAYOUT_PHASE.json and the process ends without leaving its process groups (on CUDA that can
take the 30 s of the shutdown's limit; the workers follow the driver out). --merge then builds the table
from those parts. tools/gpu_parallel.sh runs each part in its own process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas import LLM, SamplingParams  # noqa: E402


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (int(torch.randint(32, 160, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine(args, layout: str, dtype: str) -> LLM:
    shape, _, variant = layout.partition(":")
    tp, pp = (int(x) for x in shape.split("x"))
    if variant not in ("", "nccl", "symm_mem", "gemv", "eager"):
        raise SystemExit(f"unknown layout variant {variant!r} in {layout!r}: nccl, symm_mem, gemv or eager")
    tuning = {"tp_all_reduce": variant if variant in ("nccl", "symm_mem") else "peer",
              "pp_graphs": variant != "eager", "gemv": "auto" if variant == "gemv" else "default"}
    return LLM(args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=dtype, skip_tokenizer_init=True,
               tuning=tuning,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               gpu_memory_utilization=args.gpu_memory_utilization, **({"kv_cache_memory": "256MiB"}
                                                                       if not torch.cuda.is_available() else {}))


def free_device_memory() -> None:
    """After the caller's `llm.shutdown(); del llm`: give the engine's memory back before the next starts."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(llm: LLM, ps: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=n, temperature=0,
                                                                              ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def decode_speed(llm: LLM, args) -> dict:
    prompt = {"prompt_token_ids": prompts(1, llm.engine.model_config.vocab_size, seed=1)[0][:1] * args.input_len}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompt, full)  # warm-up (and prefix cache: every timed run computes the same prompt)
    firsts, totals = [], []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        llm.generate(prompt, one)
        firsts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm.generate(prompt, full)
        totals.append(time.perf_counter() - t0)
    first, total = statistics.median(firsts), statistics.median(totals)
    r = {"ttft_s": first, "total_s": total, "decode_tok_s": (args.output_len - 1) / max(total - first, 1e-9)}
    if args.profile_steps:
        r |= profile(llm, prompt, args, (total - first) / (args.output_len - 1))
    return r


def profile(llm: LLM, prompt: dict, args, step_s: float) -> dict:
    """torch.profiler over --profile-steps decode steps of the timed request, on this process's device (the
    driver's: rank 0): kernels by kind, communication among them (an all-reduce kernel also waits for its
    peers, so a lagging rank shows here), and the host gap."""
    from atlas.bench.kernel_profile import format_summary, profile_decode

    n = min(args.profile_steps, args.output_len - 1)

    def call(max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return lambda: llm.generate(prompt, params)

    device = llm.engine.runner.device
    summary, _ = profile_decode(call, n, llm.engine.model_config.num_hidden_layers, step_s, device, llm.engine)
    text = format_summary(f"rank 0, {n} decode steps", summary)
    workers = worker_host_times(llm, n)
    for w in workers:
        wait, launch = w["wait_for_message_ms"]["median"], w["launch_ms"]["median"]
        text += (f"\n  rank {w['rank']} host, median of its last {w['steps']} steps: waits {wait:.3f} ms for each "
                 f"step's message, launches the step in {launch:.3f} ms")
    return {"profile": summary, "profile_text": text, "worker_host": workers}


def worker_host_times(llm: LLM, steps: int) -> list[dict]:
    """The workers' host time for their last `steps` steps (the unprofiled pass's decode steps): a worker
    that waits for its step messages keeps up with the driver; one that does not holds the devices back."""
    par = llm.engine.parallel
    if par is None:
        return []
    import tempfile

    prefix = str(Path(tempfile.mkdtemp(prefix="atlas-host-")) / "workers")
    paths = par.report_worker_host_times(prefix, steps)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(p.is_file() for p in paths):
        time.sleep(0.05)
    return [json.loads(p.read_text()) for p in paths if p.is_file()]


def measure(args, layout: str, phase: str, ps: list[list[int]]) -> tuple[LLM, dict]:
    """One engine of the layout: phase "check" (greedy tokens in --check-dtype) or "decode" (greedy tokens
    in the checkpoint's dtype, then batch-1 decode speed). -> (the engine, its results)."""
    t0 = time.perf_counter()
    llm = engine(args, layout, args.check_dtype if phase == "check" else "auto")
    if phase == "check":
        return llm, {"check_start_s": time.perf_counter() - t0, "check_tokens": greedy(llm, ps, args.check_tokens)}
    r = {"start_s": time.perf_counter() - t0, "tokens": greedy(llm, ps, args.check_tokens)}
    return llm, r | decode_speed(llm, args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--layouts", default="1x1,2x1", help="TPxPP[:nccl|:symm_mem|:gemv|:eager], comma-separated; 1x1 is added first "
                                                         "if missing.")
    p.add_argument("--check-dtype", default="float32")
    p.add_argument("--check-prompts", type=int, default=8)
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="decode phase: also profile this many decode steps on the driver (0: no profile)")
    p.add_argument("--out", required=True)
    p.add_argument("--part", help="LAYOUT:check or LAYOUT:decode: that engine alone (see above)")
    p.add_argument("--merge", action="store_true", help="the table of the parts written with --part")
    args = p.parse_args()
    parts = Path(args.out + ".parts")
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    ps = prompts(args.check_prompts, vocab)
    if args.part:
        layout, _, phase = args.part.rpartition(":")
        _, r = measure(args, layout, phase, ps)
        parts.mkdir(parents=True, exist_ok=True)
        (parts / f"{layout}_{phase}.json").write_text(json.dumps(r))
        print(f"{args.part}: {({k: v for k, v in r.items() if not k.endswith('tokens')})}", flush=True)
        sys.stdout.flush()
        os._exit(0)
    if args.merge:
        results = {}
        for layout in args.layouts.split(","):
            r = results[layout] = {"layout": layout}
            for phase in ("check", "decode"):
                f = parts / f"{layout}_{phase}.json"
                if f.is_file():
                    r |= json.loads(f.read_text())
        # (a layout measured for speed only, without its check part, is listed with "-" for the check)
        results = {k: v for k, v in results.items() if "tokens" in v}
        if "1x1" not in results:
            print("no complete 1x1 part to compare with", file=sys.stderr)
            return 1
        return report(args, results)
    layouts = args.layouts.split(",")
    if "1x1" not in layouts:
        layouts.insert(0, "1x1")
    layouts.sort(key=lambda t: t != "1x1")
    results: dict[str, dict] = {}
    for layout in layouts:
        r = results[layout] = {"layout": layout}
        for phase in ("check", "decode"):
            print(f"[{time.strftime('%H:%M:%S')}] {layout}: {phase}", flush=True)
            llm, measured = measure(args, layout, phase, ps)
            r |= measured
            llm.shutdown()
            del llm
            free_device_memory()
    return report(args, results)


def report(args, results: dict[str, dict]) -> int:
    base = results["1x1"]
    ok = True
    lines = [f"{'layout':<14}{'check':>10}{'agree':>8}{'decode tok/s':>14}{'vs 1x1':>8}{'TTFT ms':>9}{'start s':>9}"]
    for name, r in results.items():
        checked = "check_tokens" in r and "check_tokens" in base
        r["check_equal"] = r["check_tokens"] == base["check_tokens"] if checked else None
        same = sum(a == b for x, y in zip(r["tokens"], base["tokens"], strict=True) for a, b in zip(x, y, strict=True))
        r["agreement"] = same / sum(len(x) for x in base["tokens"])
        r["decode_speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
        ok &= r["check_equal"] is not False
        check = {True: "equal", False: "DIFFERS", None: "-"}[r["check_equal"]]
        lines.append(f"{name:<14}{check:>10}{r['agreement']:>8.3f}"
                     f"{r['decode_tok_s']:>14.1f}{r['decode_speedup']:>7.2f}x{1000 * r['ttft_s']:>9.1f}{r['start_s']:>9.1f}")
    text = "\n".join([f"greedy {args.check_dtype} check of {args.check_prompts} prompts x {args.check_tokens} tokens "
                      f"(agree: share of tokens equal to 1x1 in the checkpoint's dtype); batch-1 decode "
                      f"{args.input_len} in / {args.output_len} out", *lines])
    profiles = [f"{name}: {r['profile_text']}" for name, r in results.items() if r.get("profile_text")]
    if profiles:
        text += "\n\nkernel profiles of batch-1 decode steps (torch.profiler)\n" + "\n".join(profiles)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))
    out.with_suffix(".txt").write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
