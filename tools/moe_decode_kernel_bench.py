"""The routed-expert kernels of a one-token decode step (kernels/moe_triton.py: the fused gate|up + activation and
the fused down + routing-weights sum) at a published MoE shape, bf16 activations, for bf16, MXFP4 and block-FP8
weights and a few tile widths (BLOCK_K), warp counts and stage counts: each replayed in a CUDA graph (as a decode step
runs it), its time put against reading the expert weights it touches at the copy bandwidth measured in the same run;
down also as the kernel that loads a token's choices in one tile (`rows=True`, the moe_down_rows knob; at its own
tile and at the sweep's), FP8's and MXFP4's gate|up also in row tiles (the moe_row_tiles / moe_mxfp4_row_tiles knobs); each quantized
config's outputs against the bf16 kernels over the dequantized weights (max abs difference). With --prefill-tokens, also
prefill's grouped expert matmuls (the Triton grouped kernel; bf16's grouped GEMM) against the bf16 matmul peak.

    python tools/moe_decode_kernel_bench.py --shape gpt-oss-20b --out moe_kernels.json
    python tools/moe_decode_kernel_bench.py --shape qwen3-30b-a3b --formats bf16 --down-tiles n4k256w4s2,n8k128w4s2 \
        --out tiles.json     # the fused kernels at the moe_pairs_tiles knob's tiles instead of the sweep
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
SHAPES = {"gpt-oss-20b": (32, 2880, 2880, 4, True), "qwen3-30b-a3b": (128, 2048, 768, 8, False),
          "deepseek-v2-lite": (64, 2048, 1408, 6, False)}


FP8_BLOCK = (128, 128)  # (the fp8 format: the Qwen -FP8 / DeepSeek-V3 layout)


def weights(e: int, n: int, k: int, fmt: str, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random [e, n, k] weights: bf16; MXFP4 (uint8 codes [e, n, k / 2], E8M0 scales [e, n, k / 32] at 2^-7); or
    FP8 (float8_e4m3fn with float32 scales per 128 x 128 block)."""
    if fmt == "mxfp4":
        codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
        return codes, torch.full((e, n, k // 32), 120, dtype=torch.uint8, device=device)
    w = torch.randn(e, n, k, device=device, dtype=torch.bfloat16) * 0.02
    if fmt == "bf16":
        return w, None
    bn, bk = FP8_BLOCK
    scale = torch.rand(e, -(-n // bn), -(-k // bk), device=device) * 1e-4 + 1e-4
    return (torch.randn(e, n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def dequantized(w: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """The bf16 weights the quantized ones stand for (the reference kernels' input)."""
    if fmt == "mxfp4":
        return dequantize_mxfp4(w.view(*w.shape[:2], -1, 16), scale, torch.bfloat16, w.device)
    from atlas.layers.moe import dequantize_experts

    return dequantize_experts(w, scale, FP8_BLOCK, torch.bfloat16)


def experts(fmt: str, ids, e: int, hidden: int, inter: int, gpt_oss: bool, device) -> tuple:
    """Random experts in one weight format: (w13, its scales, w2, its scales, the gate|up and down biases (gpt-oss:
    zeros; else None), the bytes gate|up and down read for the experts `ids` touch, the FP8 block or None)."""
    w13, s13 = weights(e, 2 * inter, hidden, fmt, device)
    w2, s2 = weights(e, hidden, inter, fmt, device)
    b13 = torch.zeros(e, 2 * inter, device=device, dtype=torch.bfloat16) if gpt_oss else None
    b2 = torch.zeros(e, hidden, device=device, dtype=torch.bfloat16) if gpt_oss else None
    per_weight = {"mxfp4": 0.5 + 1 / 32, "fp8": 1.0 + 4 / (FP8_BLOCK[0] * FP8_BLOCK[1]), "bf16": 2.0}[fmt]
    touched = len(set(ids.flatten().tolist()))
    return (w13, s13, w2, s2, b13, b2, touched * 2 * inter * hidden * per_weight, touched * hidden * inter * per_weight,
            FP8_BLOCK if fmt == "fp8" else None)


def sweep(fmt: str, x, ids, rw, act: dict, e: int, hidden: int, inter: int, gpt_oss: bool, args,
          bandwidth: float, device) -> list[dict]:
    """Both kernels with one weight format at every tile width, warp count and stage count; FP8's and MXFP4's gate|up
    also in row tiles (the moe_row_tiles / moe_mxfp4_row_tiles knobs, their own tiles)."""
    w13, s13, w2, s2, b13, b2, bytes_up, bytes_down, block = experts(fmt, ids, e, hidden, inter, gpt_oss, device)
    h = moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, bias=b13, block=block, **act)
    y = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, block=block)
    if fmt != "bf16":  # (each config's outputs against the dequantized weights' bf16 kernels: a fast wrong kernel is
        # no result)
        d13, d2 = dequantized(w13, s13, fmt), dequantized(w2, s2, fmt)
        h_ref = moe_pairs_gate_up_act(x, d13, ids, rw, bias=b13, **act)
        y_ref = moe_pairs_down_combine(h, d2, ids, rw, bias=b2)
    else:
        h_ref, y_ref = h, y

    def diff(got, want):
        return (got.float() - want.float()).abs().max().item()

    rows = []
    if fmt == "mxfp4" or (fmt == "fp8" and b13 is None):
        for tiles in (False, True):
            up = kernel_time_ms(lambda rt=tiles: moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, block=block,
                                                                       bias=b13, row_tiles=rt, **act))
            h_c = moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, block=block, bias=b13, row_tiles=tiles, **act)
            row = dict(format=fmt, gate_up_row_tiles=tiles, gate_up_us=up * 1e3, gate_up_max_diff=diff(h_c, h_ref),
                       gate_up_max=h_ref.float().abs().max().item(),
                       gate_up_of_roofline=bytes_up / bandwidth / (up * 1e-3))
            if fmt == "mxfp4":  # (its down + combine too: the walk, and the row tiles)
                down = kernel_time_ms(lambda rt=tiles: moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2,
                                                                              rows=False, row_tiles=rt))
                y_c = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, rows=False, row_tiles=tiles)
                row.update(down_us=down * 1e3, down_max_diff=diff(y_c, y_ref), down_max=y_ref.float().abs().max().item(),
                           down_of_roofline=bytes_down / bandwidth / (down * 1e-3))
            print(json.dumps(row), flush=True)
            rows.append(row)
    for block_k in [int(b) for b in args.block_k.split(",")]:
        for warps in [int(w) for w in args.warps.split(",")]:
            for stages in [int(st) for st in args.stages.split(",")]:
                row = dict(format=fmt, block_k=block_k, num_warps=warps, num_stages=stages)
                kw = dict(block_k=block_k, num_warps=warps, num_stages=stages, block=block)
                try:
                    up = kernel_time_ms(lambda kw=kw: moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, bias=b13,
                                                                            **kw, **act))
                    down = kernel_time_ms(lambda kw=kw: moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2,
                                                                               rows=False, **kw))
                    # (the rows kernel, a token's choices in one tile: its own K tile, and this one)
                    down_rows = kernel_time_ms(lambda kw=kw: moe_pairs_down_combine(
                        h, w2, ids, rw, bias=b2, scale=s2, rows=True, **dict(kw, block_k=None)))
                    down_rows_k = kernel_time_ms(lambda kw=kw: moe_pairs_down_combine(
                        h, w2, ids, rw, bias=b2, scale=s2, rows=True, **kw))
                except Exception as exc:  # (a config that does not compile or fit: recorded, the sweep goes on)
                    row["error"] = repr(exc)[:300]
                else:
                    h_c = moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, bias=b13, **kw, **act)
                    y_c = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, rows=False, **kw)
                    y_rows = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, rows=True,
                                                    **dict(kw, block_k=None))
                    y_rows_k = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, rows=True, **kw)
                    row.update(gate_up_max_diff=diff(h_c, h_ref), down_max_diff=diff(y_c, y_ref),
                               down_rows_max_diff=diff(y_rows, y_ref), down_rows_k_max_diff=diff(y_rows_k, y_ref),
                               gate_up_max=h_ref.float().abs().max().item(), down_max=y_ref.float().abs().max().item())
                    row.update(gate_up_us=up * 1e3, down_us=down * 1e3, down_rows_us=down_rows * 1e3,
                               down_rows_k_us=down_rows_k * 1e3,
                               down_rows_of_roofline=bytes_down / bandwidth / (down_rows * 1e-3),
                               down_rows_k_of_roofline=bytes_down / bandwidth / (down_rows_k * 1e-3),
                               gate_up_of_roofline=bytes_up / bandwidth / (up * 1e-3),
                               down_of_roofline=bytes_down / bandwidth / (down * 1e-3))
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def tile_sweep(fmt: str, x, ids, rw, act: dict, e: int, hidden: int, inter: int, gpt_oss: bool, tiles: dict,
               bandwidth: float, device) -> list[dict]:
    """The fused kernels at the tiles the moe_pairs_tiles knob would pass ({"gate_up": [...], "down": [...]}, each
    tile "nNkKwWsS"; down through the kernel the model runs, the rows one for bf16 and FP8): time, share of the
    copy roofline, and the largest difference from the default tiles' output (another summation order only)."""
    from atlas.kernels.moe_triton import parse_pairs_tiles

    w13, s13, w2, s2, b13, b2, bytes_up, bytes_down, block = experts(fmt, ids, e, hidden, inter, gpt_oss, device)
    h = moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, bias=b13, block=block, **act)
    y = moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, block=block)
    calls = {"gate_up": (lambda kw: moe_pairs_gate_up_act(x, w13, ids, rw, scale=s13, bias=b13, block=block, **act,
                                                          **kw), h, bytes_up),
             "down": (lambda kw: moe_pairs_down_combine(h, w2, ids, rw, bias=b2, scale=s2, block=block, **kw), y,
                      bytes_down)}
    rows = []
    for kernel, names in tiles.items():
        fn, default_out, nbytes = calls[kernel]
        for name in ["default"] + names:
            kw = {} if name == "default" else parse_pairs_tiles(f"{kernel}:{name}")[kernel]
            row = dict(format=fmt, kernel=kernel, tile=name)
            try:
                ms = kernel_time_ms(lambda kw=kw, fn=fn: fn(kw))
                out = fn(kw)
            except Exception as exc:  # (a tile that does not compile or fit: recorded, the sweep goes on)
                row["error"] = repr(exc)[:300]
            else:
                row.update(us=ms * 1e3, of_roofline=nbytes / bandwidth / (ms * 1e-3),
                           max_diff=(out.float() - default_out.float()).abs().max().item(),
                           max=default_out.float().abs().max().item())
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def grouped(fmt: str, tokens: int, e: int, hidden: int, inter: int, topk: int, peak: float, device) -> dict:
    """Prefill's expert matmuls at `tokens` tokens (rows sorted by expert, random routing): the Triton grouped kernel
    on w13 and on w2 (the row chunks by rows per expert, the default), and for bf16 layers/moe.grouped_matmul (the
    grouped GEMM bf16 experts take above moe_triton_max_tokens); time and the share of the bf16 matmul peak."""
    from atlas.layers.moe import grouped_matmul

    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(tokens)]).flatten()
    counts = torch.bincount(ids, minlength=e).to(device)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    rows = tokens * topk
    x13 = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    x2 = torch.randn(rows, inter, device=device, dtype=torch.bfloat16)
    w13, s13 = weights(e, 2 * inter, hidden, fmt, device)
    w2, s2 = weights(e, hidden, inter, fmt, device)
    block = FP8_BLOCK if fmt == "fp8" else None
    flops13, flops2 = 2 * rows * 2 * inter * hidden, 2 * rows * hidden * inter
    row = dict(format=fmt, tokens=tokens)
    t13 = kernel_time_ms(lambda: moe_grouped_matmul(x13, w13, offsets, scale=s13, block=block))
    t2 = kernel_time_ms(lambda: moe_grouped_matmul(x2, w2, offsets, scale=s2, block=block))
    row.update(triton_w13_us=t13 * 1e3, triton_w2_us=t2 * 1e3,
               triton_of_peak=(flops13 + flops2) / peak / ((t13 + t2) * 1e-3))
    if fmt == "bf16":
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
    parser.add_argument("--stages", default="3", help="software-pipeline stages (num_stages), e.g. 3,2,1")
    parser.add_argument("--formats", default="bf16,mxfp4", help="of bf16, mxfp4, fp8 (128 x 128 blocks)")
    parser.add_argument("--prefill-tokens", default="", help="also the grouped (prefill) matmuls at these token "
                        "counts, e.g. 128,2048")
    parser.add_argument("--gate-up-tiles", default="", help="instead of the sweep above: gate|up at these tiles "
                        "(nNkKwWsS, as the moe_pairs_tiles knob takes them), e.g. n8k2048w4s3,n4k1024w4s2")
    parser.add_argument("--down-tiles", default="", help="and down (the kernel the model runs) at these")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tiles = {kernel: names.split(",") for kernel, names in (("gate_up", args.gate_up_tiles),
                                                            ("down", args.down_tiles)) if names}
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
        if tiles:
            results += tile_sweep(fmt, x, ids, rw, act, e, hidden, inter, gpt_oss, tiles, bandwidth, device)
        else:
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
