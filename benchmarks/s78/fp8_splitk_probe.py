"""Probe (session 78, not the product): would issue 34's block-FP8 GEMMs at 128-512 rows run faster split along K
over two CUDA streams? At 256 rows cuBLASLt's block-scaled kernel takes 128 x 128 tiles, so o_proj and down (N =
4,096) make 64 tiles for 132 SMs (session 77's profile); two half-K products side by side fill the GPU, at the cost
of float32 outputs and their sum.

For the Qwen3-8B shape's four layers at M rows: (a) one torch._scaled_mm with bf16 out (the shipped path,
fp8_linear._blockwise_mm); (b) the same with float32 out; (c) K split in two, one half on a second stream, float32
outs summed and rounded to bf16; (d) the same two halves one after the other. Each replayed in a CUDA graph
(bench.common.kernel_time_ms); (c)'s output against (a)'s (max abs difference over max abs value).

    python benchmarks/s78/fp8_splitk_probe.py --out splitk.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def one(q, s, w, ws, dtype):
    return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=ws.t(), out_dtype=dtype)


def halves(q, s, w, ws):
    """Each K half as its own tensors in the layouts _scaled_mm takes (activation scales M-major), as a quantizer
    and a loader writing halves would leave them."""
    k = q.shape[1]
    h, g = k // 2, k // 256

    def m_major(t):
        return t.t().contiguous().t()

    return ((q[:, :h].contiguous(), m_major(s[:, :g]), w[:, :h].contiguous(), ws[:, :g].contiguous()),
            (q[:, h:].contiguous(), m_major(s[:, g:]), w[:, h:].contiguous(), ws[:, g:].contiguous()))


def split_streams(a, b, side: torch.cuda.Stream):
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        y2 = one(*b, torch.float32)
    y1 = one(*a, torch.float32)
    main.wait_stream(side)
    return (y1 + y2).to(torch.bfloat16)


def split_serial(a, b):
    return (one(*a, torch.float32) + one(*b, torch.float32)).to(torch.bfloat16)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="128,256,512")
    p.add_argument("--out")
    args = p.parse_args()
    from atlas.bench.common import kernel_time_ms, machine
    from atlas.kernels import fp8_linear_triton as kt

    dev = torch.device("cuda")
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            q, s = kt.quantize_groups_triton(x, 128, pad_rows_to=4, m_major=True)
            w = (torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            ws = torch.rand(n // 128, k // 128, device=dev) * 1e-4 + 1e-4
            row = dict(rows=m, layer=name, n=n, k=k)
            try:
                ref = one(q, s, w, ws, torch.bfloat16)
                a, b = halves(q, s, w, ws)
                got = split_streams(a, b, side)
                row["split_rel_diff"] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                row["bf16_us"] = kernel_time_ms(partial(one, q, s, w, ws, torch.bfloat16)) * 1e3
                row["f32_us"] = kernel_time_ms(partial(one, q, s, w, ws, torch.float32)) * 1e3
                row["split_streams_us"] = kernel_time_ms(partial(split_streams, a, b, side)) * 1e3
                row["split_serial_us"] = kernel_time_ms(partial(split_serial, a, b)) * 1e3
                row["speedup"] = row["bf16_us"] / row["split_streams_us"]
                # (the halves as views of the whole tensors, no copies: whether _scaled_mm takes them)
                h, g = k // 2, k // 256
                va = (q[:, :h], s[:, :g], w[:, :h], ws[:, :g])
                vb = (q[:, h:], s[:, g:], w[:, h:], ws[:, g:])
                try:
                    got_v = split_streams(va, vb, side)
                    row["views_rel_diff"] = ((got_v.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    row["split_views_us"] = kernel_time_ms(partial(split_streams, va, vb, side)) * 1e3
                except Exception as exc:
                    row["views_error"] = repr(exc)[:200]
            except Exception as exc:  # (recorded; the probe goes on)
                row["error"] = repr(exc)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(machine=machine(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
