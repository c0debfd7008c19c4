"""The routed-expert kernels of a one-token decode step (kernels/moe_triton.py: the fused gate|up + activation and
the fused down + routing-weights sum) at a published MoE shape, bf16 activations, for bf16 and MXFP4 weights and a
few tile widths (BLOCK_K) and warp counts: each replayed in a CUDA graph (as a decode step runs it), its time put
against reading the expert weights it touches at the copy bandwidth measured in the same run; down also as the
kernel that loads a token's choices in one tile (`rows=True`, the moe_down_rows knob); each MXFP4 config's
outputs against the bf16 kernels over the dequantized weights (max abs difference). With --prefill-tokens, also
prefill's grouped expert matmuls (the Triton grouped kernel; bf16's grouped GEMM) against the bf16 matmul peak.

    python tools/moe_decode_kernel_bench.py --shape gpt-oss-20b --out moe_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas.bench.common import copy_bandwidth, kernel_time_ms, machine  # noqa: E402
from atlas.bench.roofline import matmul_peak  # noqa: E402
from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU, ACT_SILU  # noqa: E402
from atlas.kernels.moe_triton import moe_grouped_matmul, moe_pairs_down_combine, moe_pairs_gate_up_act  # noqa: E402
from atlas.kernels.mxfp4 import dequantize_mxfp4  # noqa: E402

# experts, hidden, intermediate, top-k, gpt-oss's clamped SwiGLU (with biases) or plain SiLU
SHAPES = {"gpt-oss-20b": (32, 2880, 2880, 4, True), "qwen3-30b-a3b": (128, 2048, 768, 8, False)}


def weights(e: int, n: int, k: int, mxfp4: bool, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random [e, n, k] weights: bf16, or MXFP4 (uint8 codes [e, n, k / 2], E8M0 scales [e, n, k / 32] at 2^-7)."""
    if not mxfp4:
        return torch.randn(e, n, k, device=device, dtype=torch.bfloat16) * 0.02, None
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    return codes, torch.full((e, n, k // 32), 120, dtype=torch.uint8, device=device)


def sweep(fmt: str, x, ids, rw, act: dict, e: int, hidden: int, inter: int, gpt_oss: bool, args,
          bandwidth: float, device) -> list[dict]:
    """Both kernels with one weight format at every tile width and warp count."""
    mx = fmt == "mxfp4"
    w13, s13 = weights(e, 2 * inter, hidden, mx, device)
    w2, s2 = weights(e, hidden, inter, mx, device)
    b13 = torch.zeros(e, 2 * inter, device=device, dtype=torch.bfloat16) if gpt_oss else None
    b2 = torch.zeros(e, hidden, device=device, dtype=torch.bfloat16) if gpt_oss else None
    per_weight = 0.5 + 1 / 32 if mx else 2.0
    touched = len(set(ids.flatten().tolist()))
    bytes_up = touched * 2 * inter * hidden * per_weight
    bytes_down = touched * hidden * inter * per_weight
    h = moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, bias=b13, **act)
    y = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2)
    if mx:  # (each config's outputs against the dequantized weights' bf16 kernels: a fast wrong kernel is no result)
        d13, d2 = (dequantize_mxfp4(w.view(*w.shape[:2], -1, 16), sc, torch.bfloat16, device)
                   for w, sc in ((w13, s13), (w2, s2)))
        h_ref = moe_pairs_gate_up_act(x, d13, ids, rw, bias=b13, **act)
        y_ref = moe_pairs_down_combine(h, d2, ids, rw, bias=b2)
    else:
        h_ref, y_ref = h, y
    rows = []
    for block_k in [int(b) for b in args.block_k.split(",")]:
        for warps in [int(w) for w in args.warps.split(",")]:
            row = dict(format=fmt, block_k=block_k, num_warps=warps)
            try:
                up = kernel_time_ms(lambda bk=block_k, nw=warps: moe_pairs_gate_up_act(
                    x, w13, ids, rw, scale=s13, bias=b13, block_k=bk, num_warps=nw, **act))
                down = kernel_time_ms(lambda bk=block_k, nw=warps: moe_pairs_down_combine(
                    h, w2, ids, rw, bias=b2, scale=s2, block_k=bk, num_warps=nw, rows=False))
                # (the rows kernel, a token's choices in one tile: its own K tile, these warps)
                down_rows = kernel_time_ms(lambda nw=warps: moe_pairs_down_combine(
                    h, w2, ids, rw, bias=b2, scale=s2, num_warps=nw, rows=True))
            except Exception as exc:  # (a config that does not compile or fit: recorded, the sweep goes on)
                row["error"] = repr(exc)[:300]
            else:
                h_c = moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, bias=b13, block_k=block_k, num_warps=warps,
                                            **act)
                y_c = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, block_k=block_k, num_warps=warps,
                                             rows=False)
                y_rows = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, num_warps=warps, rows=True)
                row.update(gate_up_max_diff=(h_c.float() - h_ref.float()).abs().max().item(),
                           down_max_diff=(y_c.float() - y_ref.float()).abs().max().item(),
                           down_rows_max_diff=(y_rows.float() - y_ref.float()).abs().max().item(),
                           gate_up_max=h_ref.float().abs().max().item(), down_max=y_ref.float().abs().max().item())
                row.update(gate_up_us=up * 1e3, down_us=down * 1e3, down_rows_us=down_rows * 1e3,
                           down_rows_of_roofline=bytes_down / bandwidth / (down_rows * 1e-3),
                           gate_up_of_roofline=bytes_up / bandwidth / (up * 1e-3),
                           down_of_roofline=bytes_down / bandwidth / (down * 1e-3))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def grouped(fmt: str, tokens: int, e: int, hidden: int, inter: int, topk: int, peak: float, device) -> dict:
    """Prefill's expert matmuls at `tokens` tokens (rows sorted by expert, random routing): the Triton grouped kernel
    on w13 and on w2 (the row chunks by rows per expert, the default), and for bf16 layers/moe.grouped_matmul (the
    grouped GEMM bf16 experts take above moe_triton_max_tokens); time and the share of the bf16 matmul peak."""
    from atlas.layers.moe import grouped_matmul

    mx = fmt == "mxfp4"
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(tokens)]).flatten()
    counts = torch.bincount(ids, minlength=e).to(device)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    rows = tokens * topk
    x13 = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    x2 = torch.randn(rows, inter, device=device, dtype=torch.bfloat16)
    w13, s13 = weights(e, 2 * inter, hidden, mx, device)
    w2, s2 = weights(e, hidden, inter, mx, device)
    flops13, flops2 = 2 * rows * 2 * inter * hidden, 2 * rows * hidden * inter
    row = dict(format=fmt, tokens=tokens)
    t13 = kernel_time_ms(lambda: moe_grouped_matmul(x13, w13, offsets, scale=s13))
    t2 = kernel_time_ms(lambda: moe_grouped_matmul(x2, w2, offsets, scale=s2))
    row.update(triton_w13_us=t13 * 1e3, triton_w2_us=t2 * 1e3,
               triton_of_peak=(flops13 + flops2) / peak / ((t13 + t2) * 1e-3))
    if not mx:
        g13 = kernel_time_ms(lambda: grouped_matmul(x13, w13, counts))
        g2 = kernel_time_ms(lambda: grouped_matmul(x2, w2, counts))
        row.update(grouped_mm_w13_us=g13 * 1e3, grouped_mm_w2_us=g2 * 1e3,
                   grouped_mm_of_peak=(flops13 + flops2) / peak / ((g13 + g2) * 1e-3))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--block-k", default="256,512,1024,2048")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--formats", default="bf16,mxfp4")
    parser.add_argument("--prefill-tokens", default="", help="also the grouped (prefill) matmuls at these token "
                        "counts, e.g. 128,2048")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    e, hidden, inter, topk, gpt_oss = SHAPES[args.shape]
    bandwidth = copy_bandwidth(device)  # (bytes read + written a second: the decode roofline's rate)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.tokens, hidden, generator=gen).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(args.tokens)]).to(device)
    rw = torch.softmax(torch.randn(args.tokens, topk, generator=gen), -1).to(device)
    act = dict(act=ACT_CLAMPED_SWIGLU, alpha=1.702, limit=7.0) if gpt_oss else dict(act=ACT_SILU)
    results = []
    for fmt in args.formats.split(","):
        results += sweep(fmt, x, ids, rw, act, e, hidden, inter, gpt_oss, args, bandwidth, device)
    prefill = []
    if args.prefill_tokens:
        peak = matmul_peak(device)
        for tokens in [int(t) for t in args.prefill_tokens.split(",")]:
            prefill += [grouped(fmt, tokens, e, hidden, inter, topk, peak, device) for fmt in args.formats.split(",")]
    args.out.write_text(json.dumps(dict(machine=machine(), shape=args.shape, tokens=args.tokens,
                                        read_bandwidth_gbs=bandwidth / 1e9, results=results, prefill=prefill),
                                   indent=1))


if __name__ == "__main__":
    main()
