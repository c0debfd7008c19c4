"""Decode-sized matmuls in two layouts on the GPU: y = x @ W^T as F.linear (cuBLAS tiles the rows of x,
M), and as (W @ x^T)^T (cuBLAS tiles the rows of W, N), with and without making the result contiguous.
At M = 256 cuBLAS covers the rows with tiles of 192 (two tiles, one a third full); the swapped layout
tiles N instead. Each time is a decode step's: one CUDA graph over enough copies of the weight to exceed
the L2 several times (kernels/gemv.py `graph_time_ms`), in TFLOP/s against the bf16 peak measured here.

    python tools/matmul_layouts.py --rows 64,128,256,512 --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from atlas.bench.roofline import matmul_peak
from atlas.kernels.gemv import graph_time_ms

SHAPES = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (24576, 4096), "down": (4096, 12288)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,128,192,256,320,384,512,1024")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    peak = matmul_peak(torch.device("cuda")) / 1e12
    results = {"peak_tflops": peak, "rows": []}
    print(f"bf16 matmul peak {peak:.0f} TFLOP/s")
    print(f"{'shape':8s} {'M':>5s} {'linear us':>10s} {'swapped us':>11s} {'+contig us':>11s} {'x linear':>9s}  TFLOP/s")
    for name, (n, k) in SHAPES.items():
        copies = max(4, (8 << 30) // (n * k * 2) // 4)  # several times the L2, at most ~2 GiB
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, 24))]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_lin = graph_time_ms(lambda w, x=x: F.linear(x, w), weights)
            t_swap = graph_time_ms(lambda w, x=x: torch.mm(w, x.t()).t(), weights)
            t_contig = graph_time_ms(lambda w, x=x: torch.mm(w, x.t()).t().contiguous(), weights)
            flop = 2 * m * n * k
            row = {"shape": name, "N": n, "K": k, "M": m, "linear_us": 1000 * t_lin, "swapped_us": 1000 * t_swap,
                   "swapped_contiguous_us": 1000 * t_contig, "x_linear": t_contig / t_lin,
                   "linear_tflops": flop / t_lin / 1e9, "swapped_contiguous_tflops": flop / t_contig / 1e9}
            results["rows"].append(row)
            print(f"{name:8s} {m:5d} {row['linear_us']:10.1f} {row['swapped_us']:11.1f} "
                  f"{row['swapped_contiguous_us']:11.1f} {row['x_linear']:9.2f}  "
                  f"{row['linear_tflops']:.0f} -> {row['swapped_contiguous_tflops']:.0f}")
        del weights
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
