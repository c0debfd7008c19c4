"""The MXFP4 row tiles' loop on sm_90 in each decode form (`--tuning moe_mxfp4_decode=bits|words|e4m3`), counted per
useful weight at gpt-oss-20b's 2,880 columns and the default step (32 runs of 32 columns, 2 warps):
tools/sass_loop_mix.py's compile, on the CPU (session 79, issue 41).

bits (the default): each E2M1 code's float32 bits (sign to bit 31, magnitude to bits 22-24) come from its byte (a
byte extraction a byte, two shifts and a LOP3 a code) and are multiplied by 2^126 before the product with x. words:
W's 16 bytes of a run are read as 4 int32 words whose 8 codes each go to float32 bits by shifts of the word, and x is
multiplied by 2^63 once a step (shared by the program's 4 W rows) so that the code's bits multiply x directly; each
run's sum is multiplied by 2^63 again. e4m3: a few whole-word operations turn a word's codes into E4M3 bytes of their
values times 2^-6, which sm_89+'s cvt.rn.f16x2.e4m3x2 converts two at a time (inline PTX), then each half to
float32; each run's sum times 2^6. The products are the same in each; their float32 sum runs in another order in the
word forms.

    python benchmarks/s79/mxfp4_decode_probe.py
"""

import collections
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import sass_loop_mix as s  # noqa: E402

COLUMNS = 2880
ROWS = 4  # (both kernels: 4 W rows a program)
RUNS = 32  # (the default step at 2,880 columns: moe_mxfp4_row_runs=0)


def main() -> None:
    warnings.filterwarnings("ignore")
    table = s.kernels()
    for name in ("mxfp4-moe-gate-up-rt", "mxfp4-moe-down-rt"):
        kernel, sig, const, div, _, stages, _ = table[name]
        warps, steps = RUNS // 16, math.ceil(COLUMNS / 32 / RUNS)
        for decode, code in (("bits", 0), ("words", 1), ("e4m3", 2)):
            compiled = s.compile_sm90(kernel, sig, dict(const, RUNS=RUNS, EVEN_K=False, DECODE=code), div, warps,
                                      stages)
            loop = s.loop_of(compiled.asm["sass"])
            mix = collections.Counter(s.opcode(i) for i in loop).most_common(10)
            per_weight = len(loop) * warps * steps / (ROWS * COLUMNS)
            print(f"{name}, {decode}: {len(loop)} instructions a thread a step, {per_weight:.3f} warp "
                  f"instructions a useful weight ({4 / per_weight:.1f} weights a clock and SM); "
                  f"{s.occupancy(compiled, warps)}")
            print("   ", ", ".join(f"{op} {c}" for op, c in mix))


if __name__ == "__main__":
    main()
