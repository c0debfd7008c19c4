"""Session 88: the RMSNorm (+ residual add) then the one-row GEMV, against the GEMV that normalises the row itself
(the gemv_fused_norm knob's kernel), in CUDA graphs as a decode step runs them (PDL on), over enough weights of each
shape to exceed the L2 (gemv.graph_time_ms), at the default tile and at 8 x 1024. Prints and writes
$OUT/fused_norm_micro.json: microseconds a layer."""

from __future__ import annotations

import json
import os

import torch

from atlas.kernels.fused_ops_triton import rms_norm_triton
from atlas.kernels.gemv import CONFIGS, DEFAULT_CONFIG, NormedRow, graph_time_ms
from atlas.kernels.gemv_triton import gemv_triton

SHAPES = {"gpt-oss q|k|v": (5120, 2880), "gpt-oss router": (32, 2880), "qwen3-8b q|k|v": (6144, 4096),
          "qwen3-8b gate|up": (24576, 4096)}


def time_config(x, res, nw, weights, cfg, act) -> tuple[float, float, float]:
    """(the GEMV alone, the norm then the GEMV, the fused GEMV) in ms a weight."""
    geo = (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.kind)

    def apart(w):
        h, _ = rms_norm_triton(x, nw, 1e-6, residual=res)
        return gemv_triton(h, w, None, *geo, act=act)

    def fused(w):
        return gemv_triton(x, w, None, *geo, act=act, norm=NormedRow(x, res, nw, 1e-6, None))

    plain = graph_time_ms(lambda w: gemv_triton(x, w, None, *geo, act=act), weights)
    return plain, graph_time_ms(apart, weights), graph_time_ms(fused, weights)


def main() -> None:
    torch.manual_seed(0)
    rows = {}
    for name, (n, k) in SHAPES.items():
        count = max(4, int(3 * 60e6 // (n * k * 2)) + 1)  # (3x the L2 of bf16 weights)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(count)]
        x, res = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        for cfg in (DEFAULT_CONFIG, CONFIGS[2]):
            plain, apart, fused = time_config(x, res, nw, weights, cfg, 0 if "gate|up" in name else None)
            rows[f"{name} {cfg}"] = dict(gemv_us=1e3 * plain, norm_then_gemv_us=1e3 * apart, fused_us=1e3 * fused)
            print(f"{name} {cfg}: GEMV alone {1e3 * plain:.2f} us, norm + GEMV {1e3 * apart:.2f}, "
                  f"fused {1e3 * fused:.2f}", flush=True)
        del weights
    with open(os.path.join(os.environ.get("OUT", "."), "fused_norm_micro.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
