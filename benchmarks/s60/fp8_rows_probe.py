"""Measuring script (one CUDA GPU): the linear layers of 36 Qwen3-8B-shaped decode layers at a few rows, in one CUDA
graph, with 128 x 128 block-scaled FP8 weights through each small-M kernel config, against the same layers in bf16
(the shipped bf16 path: the GEMV with the activation epilogue at one row, cuBLAS above). A layer is RMSNorm, q|k|v,
o (on q|k|v's first 4,096 columns: attention is left out), add + RMSNorm, gate|up (+ SiLU), down. Each config is
set as the engine's `fp8_gemv` tuning knob would set it, so the dispatcher (kernels/fp8_linear.py) runs it.

Stage 1 times a grid of "tq" / "tc" configs (fp8_w8a8_rows_triton: tensor cores, activations quantized by a launch
before it / in the kernel) at one row, with the shipped table's choice; stage 2 the best few at 2-64 rows against the table (W8A8 through cuBLASLt)
and bf16. Reports us a layer, the FP8 weights' bytes over that time against the copy bandwidth, and the speed-up
over bf16 in the same run:

    git apply benchmarks/s60/rows_kernel.patch   # (the kernel it times; not on main: BENCHMARKS.md 2.6)
    PYTHONPATH=. python benchmarks/s60/fp8_rows_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from atlas.bench.common import copy_bandwidth
from atlas.config import TuningConfig
from atlas.kernels import settings
from atlas.kernels.fp8_linear import FP8, FP8_MAX, fp8_linear
from atlas.kernels.fused_ops import act_and_mul, add_rms_norm
from atlas.kernels.fused_ops_triton import ACT_SILU
from atlas.kernels.gemv_triton import gemv_triton

HIDDEN, INTER, Q, KV = 4096, 12288, 4096, 1024
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gu": (2 * INTER, HIDDEN), "d": (HIDDEN, INTER)}


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    tiles = w.float().view(n // 128, 128, k // 128, 128)
    s = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    return (tiles / s[:, None, :, None]).view(n, k).to(FP8), s.contiguous()


def make_layers(n: int, dev, fp8: bool) -> list[dict]:
    layers = []
    g = torch.Generator(device=dev).manual_seed(0)
    for _ in range(n):
        layer = {"n1": torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16),
                 "n2": torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)}
        for name, (rows, cols) in SHAPES.items():
            w = torch.randn(rows, cols, device=dev, generator=g, dtype=torch.bfloat16) / cols ** 0.5
            layer[name] = block_fp8(w) if fp8 else w
            del w
        layers.append(layer)
    return layers


def layer_fp8(layer, x, residual):
    def lin(a, name, act=None):
        w, s = layer[name]
        return fp8_linear(a, w, s, (128, 128), act=act)
    h, residual = add_rms_norm(x, residual, layer["n1"], 1e-6)
    h, residual = add_rms_norm(lin(lin(h, "qkv")[:, :Q].contiguous(), "o"), residual, layer["n2"], 1e-6)
    return lin(lin(h, "gu", "silu"), "d"), residual


def layer_bf16(layer, x, residual):
    if x.shape[0] == 1:
        def lin(a, name, act=None):
            return gemv_triton(a, layer[name], None, 4, 2048, 4, 3, "sum", act=act)
        gu = lin
    else:
        def lin(a, name, act=None):
            return F.linear(a, layer[name])

        def gu(a, name, act):
            return act_and_mul(F.linear(a, layer[name]))
    h, residual = add_rms_norm(x, residual, layer["n1"], 1e-6)
    h, residual = add_rms_norm(lin(lin(h, "qkv")[:, :Q].contiguous(), "o"), residual, layer["n2"], 1e-6)
    return lin(gu(h, "gu", ACT_SILU), "d"), residual


def time_chain(step, layers, x, residual, replays: int = 9) -> tuple[float, bool]:
    def run():
        h, r = x, residual
        for layer in layers:
            h, r = step(layer, h, r)
        return h
    run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = run()
    graph.replay()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1000 / len(layers))
    del graph
    return sorted(times)[len(times) // 2], bool(torch.isfinite(out.float()).all())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", default="2,4,8,16,32,64")
    ap.add_argument("--top", type=int, default=3, help="stage-1 configs carried to stage 2")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--kinds", default="tq,tc", help="config kinds of the one-row grid")
    ap.add_argument("--extra", default="", help="configs timed at one row before the grid (comma-separated)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    copy = copy_bandwidth(dev)
    bf16 = make_layers(args.layers, dev, fp8=False)
    fp8 = make_layers(args.layers, dev, fp8=True)
    layer_bytes = sum(r * c for r, c in SHAPES.values())  # FP8: a byte a weight (scales: 1/16384 of it)
    report = {"copy_bytes_per_s": copy, "layers": args.layers, "fp8_bytes_per_layer": layer_bytes, "rows": {}}

    def measure(rows: int, name: str, table: str | None) -> dict:
        settings.set_kernel_settings(TuningConfig(fp8_gemv=table or ""))
        g = torch.Generator(device=dev).manual_seed(rows)
        x = torch.randn(rows, HIDDEN, device=dev, generator=g, dtype=torch.bfloat16)
        residual = torch.randn(rows, HIDDEN, device=dev, generator=g, dtype=torch.bfloat16)
        try:
            with torch.inference_mode():
                if name == "bf16":
                    us, ok = time_chain(layer_bf16, bf16, x, residual)
                else:
                    us, ok = time_chain(layer_fp8, fp8, x, residual)
        except Exception as e:  # (a config that does not compile or fit: recorded, the sweep goes on)
            return {"config": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        row = {"config": name, "us_per_layer": round(us, 2), "finite": ok,
               "fp8_bytes_of_copy_rate": round(layer_bytes / (us * 1e-6) / copy, 3)}
        print(f"rows {rows:3d} {name:24s} {us:8.2f} us a layer  {row['fp8_bytes_of_copy_rate']:.3f} of copy",
              flush=True)
        return row

    def sweep(rows: int, configs: list[str]) -> list[dict]:
        out = [measure(rows, "bf16", None), measure(rows, "table", None)]
        for cfg in configs:
            if time.time() - t0 > args.budget_s:
                out.append({"config": cfg, "error": "skipped: over the time budget"})
                continue
            out.append(measure(rows, cfg, f"{rows}:{cfg}"))
        base = out[0].get("us_per_layer")
        for r in out:
            if base and "us_per_layer" in r:
                r["x_bf16"] = round(base / r["us_per_layer"], 3)
        report["rows"][str(rows)] = out
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return out

    grid = [f"{kind}-n{bn}k{cols}w{w}s{s}" for kind in args.kinds.split(",") for bn, cols, w, s in itertools.product(
        (32, 64, 128), (128, 256), (4,), (3, 4, 5))]
    first = sweep(1, args.extra.split(",") + grid if args.extra else grid)
    ranked = sorted((r for r in first[2:] if "us_per_layer" in r), key=lambda r: r["us_per_layer"])
    best = [r["config"] for r in ranked[:args.top]]
    for rows in (int(v) for v in args.rows.split(",")):
        sweep(rows, best)
    report["seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
