"""Measuring script (one CUDA GPU): the projections of 36 decode layers at one row, in one CUDA graph, with
and without their neighbours fused into the GEMV, to tell the kernel's own speed from the fusions' and the
PDL trigger's. Attention is left out (o follows q|k|v directly). Variants, us a layer (median of replays):

- cublas: rms_norm, q|k|v, o, add_rms_norm, gate|up, silu-and-mul, down through F.linear (cuBLAS);
- gemv_s{1,3}: the same through the shipped GEMV (sum-n4k2048w4, 1 or 3 pipeline stages);
- gemv_act: the shipped default: the GEMV, with the activation as gate|up's epilogue (6 kernels a layer);
- weight_first: the GEMV of session 24 loading its first W tile before PDL's wait (copied below);
each with PDL's trigger before the wait (2) or after it (1), and 0 for no PDL. (The first version of this
script, in git history, also timed a GEMV double-buffering its tiles in registers and one taking the norms as
prologues: BENCHMARKS.md, session 25.)

    python tools/gemv_layer_chain_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atlas.config import TuningConfig
from atlas.kernels import settings
from atlas.kernels.fused_ops import act_and_mul, add_rms_norm
from atlas.kernels.fused_ops_triton import ACT_SILU
from atlas.kernels.gemv_triton import _load_tiles, _load_w, _load_x, _program_tiles, _sum_tile, gemv_triton
from atlas.kernels.pdl_triton import pdl_begin


@triton.jit
def _pipelined_sum_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                          PDL: tl.constexpr, WEIGHT_FIRST: tl.constexpr):
    offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, x_rows = _program_tiles(
        x_ptr, w_ptr, M, N, stride_xm, stride_wn, ROWS, BLOCK_N, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if WEIGHT_FIRST:
        w = _load_w(w_rows, offs_k, n_ok, K, True, True)
        pdl_begin(PDL)
        acc = _sum_tile(w, _load_x(x_rows, offs_k, m_ok, K, True), acc)
    else:
        pdl_begin(PDL)
    for k0 in tl.range(BLOCK_K if WEIGHT_FIRST else 0, K, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _load_tiles(x_rows, w_rows, k0 + offs_k, m_ok, n_ok, K, True, True)
        acc = _sum_tile(w, x, acc)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def pipelined(x, w, stages, weight_first, flag):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    opts = {"launch_pdl": True} if flag else {}
    _pipelined_sum_kernel[(N // 4,)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), ROWS=1, BLOCK_N=4,
                                     BLOCK_K=2048, NUM_STAGES=stages, PDL=flag, WEIGHT_FIRST=weight_first and flag > 0,
                                     num_warps=4, **opts)
    return y


def make_layers(n, hidden, inter, q, kv, dev):
    def w(a, b):
        return torch.randn(a, b, device=dev, dtype=torch.bfloat16) * 0.02
    return [dict(qkv=w(q + 2 * kv, hidden), o=w(hidden, q), gu=w(2 * inter, hidden), d=w(hidden, inter),
                 n1=torch.ones(hidden, device=dev, dtype=torch.bfloat16),
                 n2=torch.ones(hidden, device=dev, dtype=torch.bfloat16)) for _ in range(n)]


def layer_unfused(lin, layer, x, residual, q):
    h, residual = add_rms_norm(x, residual, layer["n1"], 1e-6)
    a = lin(h, layer["qkv"])[:, :q]
    h, residual = add_rms_norm(lin(a, layer["o"]), residual, layer["n2"], 1e-6)
    return lin(act_and_mul(lin(h, layer["gu"])), layer["d"]), residual


def layer_gemv_act(layer, x, residual, q):
    def lin(a, w, act=None):
        return gemv_triton(a, w, None, 4, 2048, 4, 3, "sum", act=act)
    h, residual = add_rms_norm(x, residual, layer["n1"], 1e-6)
    h, residual = add_rms_norm(lin(lin(h, layer["qkv"])[:, :q], layer["o"]), residual, layer["n2"], 1e-6)
    return lin(lin(h, layer["gu"], ACT_SILU), layer["d"]), residual


def time_chain(step, layers, x, residual, replays=7):
    def run():
        h, r = x, residual
        for layer in layers:
            h, r = step(layer, h, r)
        return h
    for _ in range(2):
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
    return sorted(times)[len(times) // 2], bool(torch.isfinite(out.float()).all())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=36)
    args = ap.parse_args()
    dev = torch.device("cuda")
    hidden, inter, q, kv = 4096, 12288, 4096, 1024
    layers = make_layers(args.layers, hidden, inter, q, kv, dev)
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    results = {}
    with torch.inference_mode():
        for flag, trigger in ((2, "first"), (1, "after-wait"), (0, None)):
            # (the engine's pdl / pdl_trigger knobs, set as ModelRunner sets them at start-up)
            settings.set_kernel_settings(TuningConfig(pdl=bool(flag), pdl_trigger=trigger or "first"))
            variants = {
                "cublas": lambda layer, h, r: layer_unfused(F.linear, layer, h, r, q),
                "gemv_act": lambda layer, h, r: layer_gemv_act(layer, h, r, q),
                "weight_first": lambda layer, h, r, f=flag: layer_unfused(
                    lambda a, w: pipelined(a, w, 3, True, f), layer, h, r, q),
            }
            for stages in (1, 3):
                variants[f"gemv_s{stages}"] = lambda layer, h, r, s=stages: layer_unfused(
                    lambda a, w: gemv_triton(a, w, None, 4, 2048, 4, s, "sum"), layer, h, r, q)
            for name, step in variants.items():
                us, finite = time_chain(step, layers, x, residual)
                results[f"{name}_pdl{flag}"] = {"us_per_layer": round(us, 2), "finite": finite}
                print(f"{name:22s} pdl {flag}: {us:7.2f} us a layer", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
