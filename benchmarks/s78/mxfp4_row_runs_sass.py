"""The MXFP4 row tiles' loop on sm_90 at each step size (runs of 32 columns a step, warps = runs / 16), counted per
useful weight at gpt-oss-20b's 2,880 columns (90 runs: a step of 64 runs issues its loop for 128, of 32 for 96):
tools/sass_loop_mix.py's compile, on the CPU (session 78; the moe_mxfp4_row_runs knob).

    python benchmarks/s78/mxfp4_row_runs_sass.py
"""

import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import sass_loop_mix as s  # noqa: E402

COLUMNS = 2880
ROWS = 4  # (both kernels: 4 W rows a program)


def main() -> None:
    warnings.filterwarnings("ignore")
    table = s.kernels()
    for name in ("mxfp4-moe-gate-up-rt", "mxfp4-moe-down-rt"):
        kernel, sig, const, div, _, stages, _ = table[name]
        for runs in (64, 32, 16):
            warps = runs // 16
            compiled = s.compile_sm90(kernel, sig, dict(const, RUNS=runs, EVEN_K=COLUMNS % (32 * runs) == 0), div,
                                      warps, stages)
            loop = s.loop_of(compiled.asm["sass"])
            steps = math.ceil(COLUMNS / 32 / runs)
            per_weight = len(loop) * warps * steps / (ROWS * COLUMNS)
            print(f"{name} runs {runs}, {warps} warps: {len(loop)} instructions a thread a step, {steps} steps over "
                  f"{COLUMNS} columns: {per_weight:.3f} warp instructions a useful weight "
                  f"({4 / per_weight:.1f} weights a clock and SM); {s.occupancy(compiled, warps)}")


if __name__ == "__main__":
    main()
