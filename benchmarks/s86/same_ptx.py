"""Whether the kernels that ran on the GPU in session 86's call 1 (tree d8e47e6) compile to the same code after the
later changes that no GPU ran (the pairs decode's branches in the row tiles' helpers, the choices kernel read through
_mxfp4_tile_part and wrapped for the L2 prefetch's programs, here none, the gate|up columns kernel beside): the MXFP4
row tiles' gate|up and down (bits) and the down with the choices side by side (bits, the default) compiled for sm_90
on the CPU from both trees, compared as benchmarks/s85/same_ptx.py compares (PTX without parameter declarations,
labels and debug sections).

    git show d8e47e6:atlas/kernels/moe_triton.py > /tmp/moe_call1.py
    python benchmarks/s86/same_ptx.py /tmp/moe_call1.py   # (in a venv with the GPU's Triton, 3.6)

Session 86 (Triton 3.6.0, at f67d5c1 and again after the decode helpers' mend): the row tiles' gate|up and down
"same code", the choices kernel "same opcodes, registers renamed and reordered", each with EVEN_K False and True.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks" / "s85")]

from same_ptx import load, verdict  # noqa: E402  (benchmarks/s85/same_ptx.py)


def main() -> None:
    from triton_compile import compiled_for_sm90

    from atlas.kernels import moe_triton

    old = load(sys.argv[1], "moe_call1")
    ptrs = {"x_ptr": "*i32", "h_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "b_ptr": "*bf16", "y_ptr": "*bf16",
            "rw_ptr": "*fp32", "alpha": "fp32", "limit": "fp32"}
    cases = (("_mxfp4_gate_up_row_tiles_kernel", dict(TOPK=4, BLOCK_N=4, RUNS=32, NUM_STAGES=1, EVEN_K=False, ACT=3,
                                                       LIBDEVICE=True, PDL=0, HAS_BIAS=True, DECODE=0)),
             ("_mxfp4_down_row_tiles_kernel", dict(TOPK=4, RUNS=32, NUM_STAGES=1, EVEN_K=False, PDL=0, HAS_BIAS=True,
                                                   DECODE=0)),
             ("_mxfp4_down_choices_kernel", dict(TOPK=4, TOPK_P2=4, RUNS=32, NUM_STAGES=1, EVEN_K=False, PDL=0,
                                                 HAS_BIAS=True)))
    for name, const in cases:
        for even_k in (False, True):
            const = dict(const, EVEN_K=even_k)
            before = compiled_for_sm90(getattr(old, name), ptrs, const)
            after = compiled_for_sm90(getattr(moe_triton, name), ptrs, const)
            print(f"{name}, EVEN_K {even_k}: {verdict(before.asm['ptx'], after.asm['ptx'])}")


if __name__ == "__main__":
    main()
