"""Whether session 85's kernel changes left the other callers' code alone: the grouped expert kernel without a bias
(bf16, FP8 and MXFP4 weights, the float32 decode) and the gated activation kernel's forms 0-2 (silu, gelu_tanh,
gelu) compiled for sm_90 on the CPU from this tree and from a revision before them, their PTX compared without the
parameter declarations, labels and debug sections.

    git show 56dadc3:atlas/kernels/moe_triton.py > /tmp/moe_old.py
    git show 56dadc3:atlas/kernels/fused_ops_triton.py > /tmp/fused_old.py
    python benchmarks/s85/same_ptx.py /tmp/moe_old.py /tmp/fused_old.py   # (in a venv with the GPU's Triton, 3.6)

Session 85 (Triton 3.6.0): every case "same code" at 9df6d93; since 194e633 (the MXFP4 scales read through
shared helpers) the MXFP4 case of the grouped kernel "same instructions, reordered"."""

from __future__ import annotations

import collections
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"atlas.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code(ptx: str) -> list[str]:
    out = []
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith(".section") and ".debug" in line:
            break
        if line and not line.startswith(("//", ".loc", ".file", ".param", "ld.param", "$L__tmp")):
            out.append(re.sub(r"_param_\d+", "_param", re.sub(r"\$L__tmp\d+", "T", line)))
    return out


def verdict(before: str, after: str) -> str:
    a, b = code(before), code(after)
    if a == b:
        return "same code"
    if sorted(a) == sorted(b):
        return "same instructions, reordered"
    if collections.Counter(line.split()[0] for line in a) == collections.Counter(line.split()[0] for line in b):
        return "same opcodes, registers renamed and reordered"
    return "differs"


def main() -> None:
    from triton_compile import compiled_for_sm90

    from atlas.kernels import fused_ops_triton, moe_triton

    old_moe, old_fused = load(sys.argv[1], "moe_old"), load(sys.argv[2], "fused_old")
    for w, s, fmt in (("*bf16", "*bf16", dict(FP8=False, GROUP_N=1, GROUP_K=1, MXFP4=False)),
                      ("*fp8e4nv", "*fp32", dict(FP8=True, GROUP_N=128, GROUP_K=128, MXFP4=False)),
                      ("*u8", "*u8", dict(FP8=False, GROUP_N=1, GROUP_K=32, MXFP4=True))):
        const = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=3, EVEN_N=False, EVEN_K=False, IEEE=False, **fmt)
        ptrs = {"x_ptr": "*bf16", "w_ptr": w, "y_ptr": "*bf16", "s_ptr": s, "b_ptr": "*bf16"}
        before = compiled_for_sm90(old_moe._moe_matmul_grouped_kernel, ptrs, const)
        after = compiled_for_sm90(moe_triton._moe_matmul_grouped_kernel, ptrs, dict(const, PAIRS=0, HAS_BIAS=False))
        print(f"grouped kernel, {w[1:]} weights: {verdict(before.asm['ptx'], after.asm['ptx'])}")
    for act in (0, 1, 2):
        const = dict(ACT=act, BLOCK=1024, LIBDEVICE=True, PDL=True)
        before = compiled_for_sm90(old_fused._act_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, const)
        after = compiled_for_sm90(fused_ops_triton._act_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16",
                                                                         "alpha": "fp32", "limit": "fp32"}, const)
        print(f"gated activation, ACT {act}: {verdict(before.asm['ptx'], after.asm['ptx'])}")


if __name__ == "__main__":
    main()
