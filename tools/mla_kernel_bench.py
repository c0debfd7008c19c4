"""The absorbed-MLA decode attention kernel (kernels/mla_attention_triton.py) against its PyTorch reference
(kernels/mla_attention_ref.py) at a DeepSeek-V2-Lite layer's shape: 16 heads, a 512-wide latent and a
64-wide rope key per cached token, pages of 16, one query row per request (decode), bf16.

Each is checked against the other, and the kernel with split-KV (the default, --split-kv: the context split over
as many programs as fill two waves of SMs), then timed as a decode step runs it: the kernel replayed in a CUDA
graph (as the engine runs it), the reference eagerly (it reads host-side lengths, so it cannot be
graphed; its time includes its launches). The kernel's time is also put against reading the step's
latent rows at the copy bandwidth measured in the same run.

    python tools/mla_kernel_bench.py --batches 1,64 --contexts 256,2048 --out mla_kernel.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas.bench.common import copy_bandwidth, kernel_time_ms, machine  # noqa: E402
from atlas.kernels import settings  # noqa: E402
from atlas.kernels.mla_attention_ref import mla_attention_ref  # noqa: E402
from atlas.kernels.mla_attention_triton import mla_attention_triton  # noqa: E402
from atlas.kernels.paged_attention import block_shape, num_kv_splits, program_map, sm_count  # noqa: E402
from atlas.kernels.paged_attention_triton import split_scratch  # noqa: E402


def problem(batch: int, context: int, heads: int, latent: int, rope: int, page: int, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages_per = -(-context // page)
    num_pages = batch * pages_per
    perm = torch.randperm(num_pages, generator=g)
    tables = perm.view(batch, pages_per).to(torch.int32)
    cache = torch.randn(num_pages, page, latent + rope, generator=g).to(dtype)
    q_latent = (torch.randn(batch, heads, latent, generator=g) / latent ** 0.25).to(dtype)
    q_pe = torch.randn(batch, heads, rope, generator=g).to(dtype)
    qsl = list(range(batch + 1))
    return dict(q_latent=q_latent.to(device), q_pe=q_pe.to(device), cache=cache.to(device), qsl=qsl,
                seq_lens=[context] * batch, tables=tables.to(device), scale=(latent // 4 + rope) ** -0.5)


def measure(batch: int, context: int, args, bandwidth: float, device, dtype) -> dict:
    p = problem(batch, context, args.heads, args.latent, args.rope, args.page, dtype, device)
    block_q, _ = block_shape(args.heads, 1, 1)
    programs = program_map(p["qsl"], block_q, device)
    prog_req, prog_q0 = programs.req, programs.q0
    qsl = torch.tensor(p["qsl"], dtype=torch.int32, device=device)
    lens = torch.tensor(p["seq_lens"], dtype=torch.int32, device=device)

    splits = num_kv_splits(int(prog_req.numel()) * -(-args.heads // 64), 1, sm_count(torch.cuda.current_device()))
    scratch = split_scratch(batch, args.heads, args.latent, splits, device) if splits > 1 else None

    def kernel(num_splits: int = 1, num_stages: int | None = None):
        return mla_attention_triton(p["q_latent"], p["q_pe"], p["cache"], qsl, lens, p["tables"], prog_req, prog_q0,
                                    block_q, p["scale"], num_splits=num_splits, scratch=scratch, num_stages=num_stages)

    def split_kernel(num_stages: int | None = None):
        return kernel(splits, num_stages)

    def reference():
        return mla_attention_ref(p["q_latent"], p["q_pe"], p["cache"], p["qsl"], p["seq_lens"], p["tables"], p["scale"])

    exact = mla_attention_ref(p["q_latent"].float(), p["q_pe"].float(), p["cache"].float(), p["qsl"], p["seq_lens"],
                              p["tables"], p["scale"])
    err = ((kernel().float() - exact).abs().max() / (1 + exact.abs().max())).item()
    err_split = ((split_kernel().float() - exact).abs().max() / (1 + exact.abs().max())).item()
    err_ref = ((reference().float() - exact).abs().max() / (1 + exact.abs().max())).item()
    k_ms, r_ms = kernel_time_ms(kernel, args.repeats, graph=True), kernel_time_ms(reference, args.repeats, graph=False)
    s_ms = kernel_time_ms(split_kernel, args.repeats, graph=True)
    latent_bytes = batch * context * (args.latent + args.rope) * dtype.itemsize
    return {"batch": batch, "context": context, "kernel_us": round(1000 * k_ms, 2),
            "reference_us": round(1000 * r_ms, 1), "reference_x_kernel": round(r_ms / k_ms, 1),
            "latent_MB": round(latent_bytes / 1e6, 2),
            "kernel_of_copy_bw": round(latent_bytes / (k_ms / 1000) / bandwidth, 3),
            "kernel_max_err": float(f"{err:.3g}"), "reference_bf16_max_err": float(f"{err_ref:.3g}"),
            "programs": int(prog_req.numel()), "split_kv_splits": splits, "split_kv_us": round(1000 * s_ms, 2),
            "split_kv_of_copy_bw": round(latent_bytes / (s_ms / 1000) / bandwidth, 3),
            "split_kv_max_err": float(f"{err_split:.3g}"),
            **stage_times(kernel, split_kernel, args, latent_bytes, bandwidth)}


def stage_times(kernel, split_kernel, args, latent_bytes: int, bandwidth: float) -> dict:
    """Both kernels at each --stages count of latent tiles in flight (the default's figures are above)."""
    out = {}
    for stages in (int(s) for s in args.stages.split(",") if s):
        for name, fn in (("kernel", kernel), ("split_kv", split_kernel)):
            try:
                ms = kernel_time_ms(lambda fn=fn, stages=stages: fn(num_stages=stages), args.repeats, graph=True)
            except Exception as exc:  # noqa: BLE001 - a count that does not fit in shared memory here
                out[f"{name}_s{stages}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            out[f"{name}_s{stages}_us"] = round(1000 * ms, 2)
            out[f"{name}_s{stages}_of_copy_bw"] = round(latent_bytes / (ms / 1000) / bandwidth, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--stages", default="", help="also time these counts of latent tiles in flight (e.g. 1,2,3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tools/mla_kernel_bench.py times CUDA kernels: run it on a GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    bandwidth = copy_bandwidth(device)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            rows.append(measure(batch, context, args, bandwidth, device, dtype))
            print(rows[-1], flush=True)
    report = {"title": "MLA decode attention: Triton kernel (CUDA graph) against the PyTorch reference (eager)",
              "meta": {"machine": machine(), "heads": args.heads, "latent": args.latent, "rope": args.rope,
                       "page": args.page, "dtype": "bfloat16", "default_stages": settings.tuning.mla_kv_stages, "copy_bandwidth_GBps": round(bandwidth / 1e9)},
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
