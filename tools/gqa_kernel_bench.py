"""The paged GQA decode attention kernel (kernels/paged_attention_triton.py) at a Qwen3-8B layer's shape (32
query heads, 8 KV heads of 128, pages of 16, one query row per request), bf16, timed as a decode step runs
it (replayed in a CUDA graph) for each (key tiles in flight, keys a tile) setting, against reading the
step's K and V at the copy bandwidth measured in the same run; every setting is checked against the
float32 PyTorch reference first.

    python tools/gqa_kernel_bench.py --batches 1,64,256 --contexts 128,256,1024 --out gqa_kernel.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas.bench.common import copy_bandwidth, kernel_time_ms, machine  # noqa: E402
from atlas.kernels import settings as kernel_settings  # noqa: E402
from atlas.kernels.paged_attention import block_shape, program_map  # noqa: E402
from atlas.kernels.paged_attention_ref import paged_attention_ref  # noqa: E402
from atlas.kernels.paged_attention_triton import paged_attention_triton  # noqa: E402


def measure(batch: int, context: int, args, settings, bandwidth: float) -> dict:
    device, dtype = torch.device("cuda"), torch.bfloat16
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else dtype
    g = torch.Generator().manual_seed(0)
    pages_per = -(-context // args.page)
    num_pages = batch * pages_per
    tables = torch.randperm(num_pages, generator=g).view(batch, pages_per).to(torch.int32).to(device)
    cache = torch.randn(2, num_pages, args.page, args.kv_heads, args.head_dim, generator=g).to(device, kv_dtype)
    query = torch.randn(batch, args.heads, args.head_dim, generator=g).to(device, dtype)
    qsl = list(range(batch + 1))
    block_q, block_m = block_shape(args.heads, args.kv_heads, 1)
    programs = program_map(qsl, block_q, device)
    prog_req, prog_q0 = programs.req, programs.q0
    qsl_d = torch.tensor(qsl, dtype=torch.int32, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = args.head_dim ** -0.5
    exact = paged_attention_ref(query.float(), cache, qsl, [context] * batch, tables, scale)  # (widened per row)
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * kv_dtype.itemsize
    row = {"batch": batch, "context": context, "kv_MB": round(kv_bytes / 1e6, 2)}
    for stages, block_n, warps in settings:
        def kernel(stages=stages, block_n=block_n, warps=warps):
            return paged_attention_triton(query, cache, qsl_d, lens, tables, prog_req, prog_q0, block_q, block_m,
                                          scale, num_stages=stages, block_n=block_n, num_warps=warps)

        key = f"s{stages}n{block_n}" + (f"w{warps}" if warps else "")
        try:
            err = ((kernel().float() - exact).abs().max() / (1 + exact.abs().max())).item()
            ms = kernel_time_ms(kernel, args.repeats)
        except Exception as exc:  # noqa: BLE001 - a setting that does not compile here (shared memory)
            row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        row[f"{key}_us"] = round(1000 * ms, 2)
        row[f"{key}_of_copy_bw"] = round(kv_bytes / (ms / 1000) / bandwidth, 3)
        row[f"{key}_max_err"] = float(f"{err:.3g}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--contexts", default="128,256,1024,2048")
    ap.add_argument("--settings", default="1x64,2x64,3x64,2x32,3x32,4x32",
                    help="(key tiles in flight)x(keys a tile)[x(warps)], comma-separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the cache's element type")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tools/gqa_kernel_bench.py times CUDA kernels: run it on a GPU")
    settings = [(*(int(x) for x in s.split("x")), None)[:3] for s in args.settings.split(",")]
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            rows.append(measure(batch, context, args, settings, bandwidth))
            print(rows[-1], flush=True)
    report = {"title": "GQA paged decode attention: the Triton kernel's pipelining settings (CUDA graph)",
              "meta": {"machine": machine(), "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                       "page": args.page, "dtype": "bfloat16", "kv_dtype": args.kv_dtype, "default_stages": kernel_settings.tuning.kv_stages,
                       "copy_bandwidth_GBps": round(bandwidth / 1e9)},
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
