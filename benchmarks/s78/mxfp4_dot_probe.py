"""Probe (session 78, not the product): would gpt-oss's one-token MXFP4 expert GEMVs run faster with the decoded
weights multiplied on tensor cores (tl.dot, the x row padded to 16 columns) than on CUDA cores, as the shipped
kernels do? Section 7.3 of BENCHMARKS.md: the CUDA-core decode is issue-bound (0.25-0.58 warp instructions a
weight against the 0.12 a half byte a weight at the copy rate leaves).

A dense MXFP4 GEMV y = W x, W [N, K] as codes [N, K / 2] and E8M0 scales [N, K / 32], x [K] bf16, at the bytes of
gpt-oss-20b's four chosen experts (gate|up: N = 4 x 5,760, K = 2,880; down: N = 4 x 2,880, K = 2,880), through
`_dot_kernel` at several tiles; beside it the shipped one-token expert kernels at that shape (moe_pairs_gate_up_act
and moe_pairs_down_combine, pairs and row tiles) for the same bytes. Each time is a CUDA-graph replay
(bench.common.kernel_time_ms) against the copy bandwidth of the same run; each output against the dequantized
weights' product in float32 (max abs difference over max abs value).

    python benchmarks/s78/mxfp4_dot_probe.py --out probe.json            # GPU
    TRITON_INTERPRET=1 python benchmarks/s78/mxfp4_dot_probe.py --check  # CPU: the kernel's numbers only
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from atlas.kernels.mxfp4 import dequantize_mxfp4  # noqa: E402


@triton.jit
def _dot_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, RUNS: tl.constexpr,
                NUM_STAGES: tl.constexpr, PAD: tl.constexpr, DECODE: tl.constexpr):
    """Rows pid * BLOCK_N ..: each step one run of 32 columns a row (16 bytes, one scale), every code decoded exactly
    to bf16 up to a power of two, [BLOCK_N, 16] x [16, PAD] on tensor cores for the even and the odd columns (x's
    even and odd columns broadcast over PAD columns; column 0 is kept), the run's partial sums times its scale
    (2^(s - 127), a power of two: exact) into the float32 sums. DECODE 0: bits 3 / 2-0 to a float32's sign /
    exponent-and-mantissa bits (the value times 2^-126), times 2^126, to bf16. DECODE 1: to an FP8 E4M3's bits (the
    value times 2^-6), converted to bf16 by the hardware's conversion; the 2^6 goes with the scale. RUNS steps are
    unrolled per loop iteration."""
    DT: tl.constexpr = x_ptr.dtype.element_ty  # (bf16 on the GPU; float32 in the interpreter, whose bf16 dot is wrong)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    acc = tl.zeros([BLOCK_N, PAD], tl.float32)
    j = tl.arange(0, 16)  # byte columns of a run
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + rows.to(tl.int64) * stride_sn
    for k0 in tl.range(0, K, RUNS * 32, num_stages=NUM_STAGES):
        for r in tl.static_range(RUNS):
            kr = k0 + r * 32
            b = tl.load(w_rows + (kr // 2 + j)[None, :], mask=r_ok[:, None], other=0)
            s = tl.load(s_rows + kr // 32, mask=r_ok, other=127).to(tl.int32)
            if DECODE == 0:
                b = b.to(tl.int32)
                lo = ((((b & 8) << 28) | ((b & 7) << 22)).to(tl.float32, bitcast=True) * 8.507059173023462e37)
                hi = ((((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True) * 8.507059173023462e37)
                lo = lo.to(DT)
                hi = hi.to(DT)
                # 2^(s - 127) from its float32 bits (s = 0: the subnormal 2^-127)
                sc = tl.where(s == 0, 0x400000, s << 23).to(tl.float32, bitcast=True)
            else:
                lo = (((b & 8) << 4) | ((b & 7) << 2)).to(tl.float8e4nv, bitcast=True).to(DT)
                hi = ((b & 0x80) | ((b & 0x70) >> 2)).to(tl.float8e4nv, bitcast=True).to(DT)
                # 2^(s - 121) = 2^6 2^(s - 127) (s <= 6: 2^(s - 121) is still a float32 normal)
                sc = ((s + 6) << 23).to(tl.float32, bitcast=True)
            xe = tl.broadcast_to(tl.load(x_ptr + kr + 2 * j)[:, None], [16, PAD])
            xo = tl.broadcast_to(tl.load(x_ptr + kr + 2 * j + 1)[:, None], [16, PAD])
            t = tl.dot(lo, xe)
            t = tl.dot(hi, xo, t)
            acc += t * sc[:, None]
    col = tl.arange(0, PAD)
    y = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1)
    tl.store(y_ptr + rows, y, mask=r_ok)


def dot_gemv(codes, scales, x, block_n=64, runs=1, warps=4, stages=3, pad=16, decode=0):
    n, half_k = codes.shape
    k = 2 * half_k
    assert k % (32 * runs) == 0
    y = torch.empty(n, dtype=torch.float32, device=codes.device)
    _dot_kernel[(triton.cdiv(n, block_n),)](codes, scales, x, y, n, k, codes.stride(0), scales.stride(0),
                                            BLOCK_N=block_n, RUNS=runs, NUM_STAGES=stages, PAD=pad, DECODE=decode,
                                            num_warps=warps)
    return y


def reference(codes, scales, x):
    n, half_k = codes.shape
    w = dequantize_mxfp4(codes.view(n, half_k // 16, 16), scales, torch.float32, codes.device)
    return w @ x.float()


def rel_diff(got, want):
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def check():
    """The kernel's numbers on small shapes (the interpreter on a CPU): scales spread over a wide range."""
    torch.manual_seed(0)
    for n, k, runs in ((64, 64, 1), (80, 128, 2), (64, 96, 1)):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        scales = torch.randint(100, 140, (n, k // 32), dtype=torch.uint8)
        x = torch.randn(k, dtype=torch.bfloat16).float()  # (bf16 values; the interpreter's tl.dot in float32)
        for decode in (0, 1):
            got = dot_gemv(codes, scales, x, block_n=64, runs=runs, warps=4, stages=1, decode=decode)
            d = rel_diff(got, reference(codes, scales, x))
            print(f"check n={n} k={k} runs={runs} decode={decode}: max diff / max {d:.2e}")
            assert d < 1e-5, d


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    if args.check:
        return check()
    from atlas.bench.common import copy_bandwidth, kernel_time_ms, machine
    from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU
    from atlas.kernels.moe_triton import moe_pairs_down_combine, moe_pairs_gate_up_act

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    e, hidden, inter, topk = 32, 2880, 2880, 4
    torch.manual_seed(0)
    rows = []
    # the shipped one-token expert kernels at gpt-oss-20b's shape (4 distinct experts)
    ids = torch.tensor([[3, 9, 17, 30]], device=dev, dtype=torch.int32)
    rw = torch.full((1, topk), 0.25, device=dev, dtype=torch.bfloat16)
    x1 = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    w13 = torch.randint(0, 256, (e, 2 * inter, hidden // 2), dtype=torch.uint8, device=dev)
    s13 = torch.full((e, 2 * inter, hidden // 32), 120, dtype=torch.uint8, device=dev)
    w2 = torch.randint(0, 256, (e, hidden, inter // 2), dtype=torch.uint8, device=dev)
    s2 = torch.full((e, hidden, inter // 32), 120, dtype=torch.uint8, device=dev)
    b13 = torch.zeros(e, 2 * inter, device=dev, dtype=torch.bfloat16)
    b2 = torch.zeros(e, hidden, device=dev, dtype=torch.bfloat16)
    act = dict(act=ACT_CLAMPED_SWIGLU, alpha=1.702, limit=7.0)
    per_w = 0.5 + 1 / 32
    up_bytes, down_bytes = topk * 2 * inter * hidden * per_w, topk * hidden * inter * per_w
    try:
        for rt in (False, True):
            t = kernel_time_ms(lambda rt=rt: moe_pairs_gate_up_act(x1, w13, ids, rw, scale=s13, bias=b13, row_tiles=rt,
                                                                   **act))
            h = moe_pairs_gate_up_act(x1, w13, ids, rw, scale=s13, bias=b13, row_tiles=rt, **act)
            td = kernel_time_ms(partial(moe_pairs_down_combine, h, w2, ids, rw, bias=b2, scale=s2, rows=False,
                                        row_tiles=rt))
            rows.append(dict(kernel="shipped", row_tiles=rt, gate_up_us=t * 1e3, gate_up_of_copy=up_bytes / bw / (t * 1e-3),
                             down_us=td * 1e3, down_of_copy=down_bytes / bw / (td * 1e-3)))
            print(json.dumps(rows[-1]), flush=True)
    except Exception as exc:  # (recorded; the probe goes on)
        rows.append(dict(kernel="shipped", error=repr(exc)[:300]))
        print(rows[-1], flush=True)
    # the dense probe at the same bytes
    for name, n in (("gate_up", 4 * 2 * inter), ("down", 4 * hidden)):
        codes = torch.randint(0, 256, (n, hidden // 2), dtype=torch.uint8, device=dev)
        scales = torch.randint(110, 130, (n, hidden // 32), dtype=torch.uint8, device=dev)
        x = torch.randn(hidden, device=dev, dtype=torch.bfloat16)
        want = reference(codes, scales, x)
        nbytes = n * hidden * per_w
        for block_n in (64, 128):
            for runs in (1, 3):
                if hidden % (32 * runs):
                    continue
                for warps, stages, decode in ((4, 2, 0), (4, 3, 0), (8, 3, 0), (4, 3, 1)):
                        row = dict(kernel="dot", shape=name, block_n=block_n, runs=runs, warps=warps, stages=stages,
                                   decode=decode)
                        try:
                            t = kernel_time_ms(partial(dot_gemv, codes, scales, x, block_n, runs, warps, stages, 16,
                                                       decode))
                            got = dot_gemv(codes, scales, x, block_n, runs, warps, stages, 16, decode)
                            row.update(us=t * 1e3, of_copy=nbytes / bw / (t * 1e-3), rel_diff=rel_diff(got, want))
                        except Exception as exc:
                            row["error"] = repr(exc)[:300]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(machine=machine(), copy_bandwidth=bw, rows=rows), indent=1))


if __name__ == "__main__":
    main()
