"""The instruction mix of a GEMV kernel's main loop on sm_90 (H100 / H200), from a CPU: Triton compiles the kernel
for that target with the ptxas it bundles, and the loop (the longest backward branch of the SASS) is counted by
opcode. A one-row decode GEMV is memory-bound only if the SMs can issue its loop faster than the weights arrive:
an H200 SM issues 4 warp instructions a clock and, at the copy rate (~4.3 TB/s over 132 SMs at 1.98 GHz), takes
in ~16.5 bytes a clock, i.e. 16.5 FP8 weights or 8.2 bf16 ones. "weights/clk" below is 4 / (warp instructions a
weight): where it is near or under the bytes' rate the kernel is issue-bound, whatever its tiles. Each line also
gives the registers and shared memory a program takes and so how many programs an SM holds at once (a one-token MoE
kernel of 512 programs that fits 3 an SM runs in 1.3 waves).

    python tools/sass_loop_mix.py [--kernels fp8-sum,fp8-rt,bf16-sum] [--show fp8-rt]

Kernels: fp8-sum, fp8-rt, bf16-sum (the dense one-row GEMVs), fp8-rt2 and fp8-rt4 (the row tiles at 2 and 4 rows:
the counts are a weight's, all rows together), moe-gate-up, moe-down-rows and their fp8- forms (the
routed experts' decode kernels at one token, Qwen3-30B-A3B's shapes), fp8-moe-gate-up-rt (FP8 experts' gate|up
through the row tiles), mxfp4-moe-gate-up and mxfp4-moe-gate-up-rt (gpt-oss-20b's MXFP4 gate|up: pairs, row tiles), mxfp4-moe-down-rt
(its down + combine in row tiles: the counts are the loop over one choice's columns), mxfp4-moe-grouped and
mxfp4-moe-grouped-pairs (its experts above 4 tokens in the grouped tensor-core kernel, each code through float32 or
a byte's two codes to a bf16 pair: the counts are the K loop's, 32 rows a chunk; -fold: the pair scaled by one
multiply, FusedExperts.mxfp4_fold; -m128: 128 rows a chunk, 256 requests' chunk); -pairs-fma and -words-fma forms of
the gate|up columns and down choices kernels (moe_mxfp4_decode), down's also on 4 warps (-w4).

Compile-only: the numbers are the compiler's, for the Triton version installed here (the GPU machine's may differ:
install its version in a venv to read the same code). --show prints the loop's SASS of one kernel.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BYTES_PER_CLOCK = 16.5  # the copy rate a clock and SM (module docstring)
INNERMOST = "mxfp4-moe-grouped"  # (the kernels whose step is an inner loop: every row named with this prefix)


def loop_of(sass: str, innermost: bool = False) -> list[str]:
    """The instructions of the longest backward-branch span (the main loop); innermost: of the longest span that
    holds no other (a K loop inside a loop over row chunks, as the grouped expert kernel's)."""
    lines = sass.splitlines()
    labels = {line.rstrip(":"): i for i, line in enumerate(lines) if re.fullmatch(r"\w+:", line.strip())}
    spans = []
    for i, line in enumerate(lines):
        found = re.search(r"BRA (\w+);", line)
        if found and labels.get(found.group(1), i) < i:
            spans.append((labels[found.group(1)], i))
    if innermost:
        spans = [a for a in spans if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in spans)]
    best = max(spans, key=lambda span: span[1] - span[0], default=None)
    if best is None:
        return []
    out = []
    for line in lines[best[0]:best[1] + 1]:
        text = line.split("\t")[-1].strip()
        if text and not text.endswith(":"):
            out.append(text)
    return out


def occupancy(kernel, warps: int) -> str:
    """Registers a thread (cuobjdump's resource usage of the cubin), shared memory a program, and the programs an
    sm_90 SM holds at once by each (64K registers, 227 KiB of shared memory, 64 warps, 32 programs)."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", usage)
    regs = int(found.group(1)) if found else 0
    shared = kernel.metadata.shared
    fits = [32, 64 // warps]
    if regs:
        fits.append(65536 // (regs * 32 * warps))
    if shared:
        fits.append(227 * 1024 // shared)
    return f"{regs} registers, {shared / 1024:.0f} KiB shared: {min(fits)} programs an SM"


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].rstrip(";")


def compile_sm90(kernel, signature: dict, constants: dict, divisible: list[str], warps: int, stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # (constexprs not given take their defaults, as a launch does)
    constants = {**{n: p.default for n, p in zip(kernel.arg_names, kernel.params, strict=True)
                    if p.is_constexpr and p.has_default and n not in constants}, **constants}
    sig = dict(signature, **dict.fromkeys(constants, "constexpr"))
    # (the launcher specializes integer and pointer arguments divisible by 16; so does this compile, for those named)
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def kernels() -> dict:
    """name -> (kernel, signature, constants, divisible, warps, stages, weights a loop iteration)."""
    from atlas.kernels import fp8_linear_triton as kt
    from atlas.kernels import gemv_triton as gt
    from atlas.kernels import moe_triton as mt

    fp8_sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    fp8_div = ["x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "N", "K", "stride_wn", "stride_sn"]
    common = dict(HAS_BIAS=False, ACT=-1, LIBDEVICE=True, PDL=0)
    sum_sig = dict(fp8_sig, M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_sn="i32",
                   stride_sk="i32", stride_ym="i32")
    rt_sig = dict(fp8_sig, ids_ptr="*i32", rw_ptr="*bf16", M="i32", N="i32", K="i32", stride_wn="i32", stride_sn="i32",
                  stride_sk="i32", stride_xm="i32", stride_ym="i32", stride_we="i32", stride_se="i32", alpha="fp32",
                  limit="fp32")
    bf16_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32",
                "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "buffer_ptrs": "*i64",
                "own_ptr": "*bf16", "counter_ptr": "*i32"}
    moe_gu_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i32", "rw_ptr": "*bf16", "y_ptr": "*bf16",
                  "s_ptr": "*bf16", "b_ptr": "*bf16", **dict.fromkeys(
                      ["N", "K", "stride_xm", "stride_we", "stride_wn", "stride_ym", "stride_se", "stride_sn",
                       "stride_sk", "stride_be"], "i32"), "alpha": "fp32", "limit": "fp32"}
    moe_down_sig = {"h_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i32", "rw_ptr": "*bf16", "b_ptr": "*bf16",
                    "y_ptr": "*bf16", "s_ptr": "*bf16", **dict.fromkeys(
                        ["N", "K", "stride_hm", "stride_we", "stride_wn", "stride_be", "stride_ym", "scale_rows",
                         "stride_sn", "stride_sk"], "i32")}
    push = dict(PUSH=False, RANK=0, WORLD=1, EMPTY=0, ROW_SLOT=0, SOURCE_STRIDE=0, PARITY_STRIDE=0)
    table = {
        # the shipped one-row FP8 GEMV (sum-n4k2048w4s3) and the row-tiles one (rt-n4k2048w4s1), 128 x 128 blocks
        "fp8-sum": (kt._fp8_gemv_kernel, sum_sig, dict(GROUP_N=128, GROUP_K=128, ROWS=1, BLOCK_N=4, KB=16,
                                                      NUM_STAGES=3, CHANNEL=False, **common),
                    fp8_div + ["stride_xm", "stride_ym"], 4, 3, 4 * 2048),
        "fp8-rt": (kt._fp8_gemv_row_tiles_kernel, rt_sig, dict(GROUP_N=128, GROUP_K=128, ROWS=1, BLOCK_N=4, RUNS=128,
                                                              RUN=kt.ROW_TILES_RUN, NUM_STAGES=1, EVEN_K=True,
                                                              CHANNEL=False, PAIRS=False, TOPK=1, PREFETCH=False,
                                                              **common),
                   fp8_div, 4, 1, 4 * 2048),
        # the shipped bf16 GEMV (sum-n4k2048w4s3)
        "bf16-sum": (gt._gemv_sum_kernel, bf16_sig, dict(ROWS=1, BLOCK_N=4, BLOCK_K=2048, NUM_STAGES=3, EVEN_N=True,
                                                         EVEN_K=True, PREFETCH=False, **common, **push),
                     ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_ym"], 4, 3,
                     4 * 2048),
        # the MoE decode kernels at one token, Qwen3-30B-A3B's experts (bf16; K = 2048 for gate|up, 768 for down)
        "moe-gate-up": (mt._moe_gate_up_act_kernel, moe_gu_sig, dict(
            TOPK=8, BLOCK_N=mt.PAIRS_BLOCK_N, BLOCK_K=mt.PAIRS_BLOCK_K, NUM_STAGES=mt.PAIRS_NUM_STAGES, EVEN_N=True,
            EVEN_K=True, ACT=0, LIBDEVICE=True, PDL=0, FP8=False, GROUP_N=1, GROUP_K=1, MXFP4=False,
            HAS_BIAS=False), ["x_ptr", "w_ptr", "y_ptr", "N", "K", "stride_xm", "stride_we", "stride_wn",
                              "stride_ym"], mt.PAIRS_NUM_WARPS, mt.PAIRS_NUM_STAGES,
            mt.PAIRS_BLOCK_N * mt.PAIRS_BLOCK_K),
        "moe-down-rows": (mt._moe_down_combine_rows_kernel, moe_down_sig, dict(
            TOPK=8, TOPK_P2=8, BLOCK_N=mt.PAIRS_BLOCK_N, BLOCK_K=mt.DOWN_ROWS_TILE // (8 * mt.PAIRS_BLOCK_N),
            NUM_STAGES=mt.PAIRS_NUM_STAGES, EVEN_K=True, HAS_BIAS=False, PDL=0, FP8=False, GROUP_N=1, GROUP_K=1,
            MXFP4=False), ["h_ptr", "w_ptr", "y_ptr", "N", "K", "stride_hm", "stride_we", "stride_wn", "stride_ym"],
            mt.PAIRS_NUM_WARPS, mt.PAIRS_NUM_STAGES, mt.DOWN_ROWS_TILE),
    }
    # the same with 128 x 128 block-scaled FP8 experts (the Qwen -FP8 layout)
    for name in ("moe-gate-up", "moe-down-rows"):
        kernel, sig, const, div, warps, stages, weights = table[name]
        sig = dict(sig, w_ptr="*fp8e4nv", s_ptr="*fp32")
        table["fp8-" + name] = (kernel, sig, dict(const, FP8=True, GROUP_N=128, GROUP_K=128), div + ["s_ptr"],
                                warps, stages, weights)
    # the row tiles at 2 and 4 activation rows (each weight widened once for all)
    kernel, sig, const, div, warps, stages, weights = table["fp8-rt"]
    for rows in (2, 4):
        table[f"fp8-rt{rows}"] = (kernel, sig, dict(const, ROWS=rows), div + ["stride_xm", "stride_ym"], warps,
                                  stages, weights)
    # FP8 experts' gate|up through the row tiles (the moe_row_tiles knob): Qwen3-30B-A3B's w13, K = 2048
    kernel, sig, const, div, warps, stages, weights = table["fp8-rt"]
    table["fp8-moe-gate-up-rt"] = (kernel, sig, dict(const, ACT=0, PAIRS=True, TOPK=8),
                                   div + ["stride_xm", "stride_ym", "stride_we", "stride_se"], warps, stages, weights)
    # gpt-oss-20b's MXFP4 gate|up (K = 2880; its 1,024-column pairs tile) and the same in row tiles
    kernel, sig, const, div, warps, stages, weights = table["moe-gate-up"]
    table["mxfp4-moe-gate-up"] = (kernel, dict(sig, w_ptr="*u8", s_ptr="*u8"), dict(
        const, FP8=False, MXFP4=True, GROUP_N=1, GROUP_K=32, BLOCK_K=mt.MXFP4_PAIRS_BLOCK_K, EVEN_K=False, ACT=3),
        div + ["s_ptr"], warps, stages, mt.PAIRS_BLOCK_N * mt.MXFP4_PAIRS_BLOCK_K)
    # gpt-oss-20b's MXFP4 experts above 4 tokens: the grouped tensor-core kernel at its default tile (the K loop,
    # INNERMOST), each code through float32 and in bf16 pairs (moe_mxfp4_dot_pairs); 32 rows a chunk
    grouped_sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "offsets_ptr": "*i32", "y_ptr": "*bf16", "s_ptr": "*u8",
                   "b_ptr": "*bf16", **dict.fromkeys(["N", "K", "stride_xm", "stride_we", "stride_wn", "stride_ym",
                                                      "stride_se", "stride_sn", "stride_sk", "stride_be"], "i32"),
                   "rows_ptr": "*i32", "out_rows_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}
    for name, pairs in (("mxfp4-moe-grouped", mt.PAIRS_OFF), ("mxfp4-moe-grouped-pairs", mt.PAIRS_ON)):
        table[name] = (mt._moe_matmul_grouped_kernel, grouped_sig, dict(
            BLOCK_M=32, BLOCK_N=mt.GROUPED_BLOCK_N, BLOCK_K=mt.GROUPED_BLOCK_K, NUM_STAGES=mt.GROUPED_NUM_STAGES,
            EVEN_N=True, EVEN_K=True, IEEE=False, FP8=False, GROUP_N=1, GROUP_K=32, MXFP4=True, PAIRS=pairs,
            HAS_BIAS=False), ["x_ptr", "w_ptr", "y_ptr", "s_ptr", "N", "K", "stride_xm", "stride_we", "stride_wn",
                              "stride_ym", "stride_se", "stride_sn"], mt.GROUPED_NUM_WARPS, mt.GROUPED_NUM_STAGES,
            mt.GROUPED_BLOCK_N * mt.GROUPED_BLOCK_K)
    # (the pairs with the scales' fold, FusedExperts.mxfp4_fold: one multiply a pair; and both at 128 rows a chunk,
    # the chunk at 256 requests)
    gk, gsig, gconst, *grest = table["mxfp4-moe-grouped-pairs"]
    table["mxfp4-moe-grouped-pairs-fold"] = (gk, gsig, dict(gconst, FOLD=True), *grest)
    table["mxfp4-moe-grouped-pairs-m128"] = (gk, gsig, dict(gconst, BLOCK_M=128), *grest)
    table["mxfp4-moe-grouped-pairs-fold-m128"] = (gk, gsig, dict(gconst, BLOCK_M=128, FOLD=True), *grest)
    mx_sig = {"x_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "b_ptr": "*bf16", "y_ptr": "*bf16", "ids_ptr": "*i32",
              "rw_ptr": "*bf16", **dict.fromkeys(["N", "K", "stride_xm", "stride_we", "stride_wn", "stride_se",
                                                  "stride_sn", "stride_sk", "stride_be", "stride_ym"], "i32"),
              "alpha": "fp32", "limit": "fp32"}
    # (the default step at its 2,880 columns: 32 runs on 2 warps, the bits decode, mt.mxfp4_row_config; the scales'
    # column stride is 1, which the launcher specializes as a constant: without it the scale loads take another
    # layout, and the compile moves the run sums through shared memory where the device's does not)
    table["mxfp4-moe-gate-up-rt"] = (mt._mxfp4_gate_up_row_tiles_kernel, mx_sig, dict(
        TOPK=4, BLOCK_N=mt.ROW_TILES_BLOCK_N, RUNS=32, NUM_STAGES=1, EVEN_K=False, ACT=3, LIBDEVICE=True, PDL=0,
        HAS_BIAS=True, DECODE=0, stride_sk=1), ["x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "N", "K", "stride_xm", "stride_we",
                                   "stride_wn", "stride_se", "stride_sn", "stride_ym"], 2, 1,
        mt.ROW_TILES_BLOCK_N * 32 * 32)
    # (the pairs decode, moe_mxfp4_decode=pairs: a byte's two codes by two multiplies, x times 2^63)
    gu, sig_, consts_, *rest = table["mxfp4-moe-gate-up-rt"]
    table["mxfp4-moe-gate-up-rt-pairs"] = (gu, sig_, dict(consts_, DECODE=4), *rest)
    # (the gate|up of 4 and 8 output columns a program, moe_mxfp4_gate_up_cols, in the pairs decode)
    cols_consts = {key: v for key, v in consts_.items() if key != "BLOCK_N"}
    for cols in (4, 8):
        table[f"mxfp4-moe-gate-up-cols{cols}-pairs"] = (mt._mxfp4_gate_up_cols_kernel, sig_, dict(
            cols_consts, COLS=cols, DECODE=4), rest[0], cols, rest[2], cols * 2 * 32 * 32)
    down_sig = {"h_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "b_ptr": "*bf16", "y_ptr": "*bf16", "ids_ptr": "*i32",
                "rw_ptr": "*bf16", **dict.fromkeys(["N", "K", "stride_hm", "stride_we", "stride_wn", "stride_se",
                                                    "stride_sn", "stride_sk", "stride_be", "stride_ym"], "i32")}
    table["mxfp4-moe-down-rt"] = (mt._mxfp4_down_row_tiles_kernel, down_sig, dict(
        TOPK=4, RUNS=32, NUM_STAGES=1, EVEN_K=False, PDL=0, HAS_BIAS=True, DECODE=0, stride_sk=1),
        ["h_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "N", "K", "stride_hm", "stride_we", "stride_wn", "stride_se",
         "stride_sn", "stride_ym"], 2, 1, 4 * 32 * 32)
    # (the same with a token's 4 choices side by side, moe_mxfp4_down_choices: 8 warps, 4 choices' rows a step)
    table["mxfp4-moe-down-choices"] = (mt._mxfp4_down_choices_kernel, dict(
        down_sig, pf_ptr="*u8", pf_parts="i32", pf_part="i32", pf_last="i32"), dict(
        TOPK=4, TOPK_P2=4, RUNS=32, NUM_STAGES=1, EVEN_K=False, PDL=0, HAS_BIAS=True, stride_sk=1),
        ["h_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "N", "K", "stride_hm", "stride_we", "stride_wn", "stride_se",
         "stride_sn", "stride_ym"], 8, 1, 4 * 4 * 32 * 32)
    dc, sig_, consts_, *rest = table["mxfp4-moe-down-choices"]
    table["mxfp4-moe-down-choices-pairs"] = (dc, sig_, dict(consts_, DECODE=4), *rest)
    # (the FMA decodes, moe_mxfp4_decode=pairs-fma / words-fma; down also on 4 warps, moe_mxfp4_row_steps' WARPS)
    for form in ("pairs-fma", "words-fma"):
        table[f"mxfp4-moe-down-choices-{form}"] = (dc, sig_, dict(consts_, DECODE=mt.DECODES[form]), *rest)
        table[f"mxfp4-moe-down-choices-{form}-w4"] = (dc, sig_, dict(consts_, DECODE=mt.DECODES[form]), rest[0], 4,
                                                      *rest[2:])
        cu, cu_sig, cu_consts, *cu_rest = table["mxfp4-moe-gate-up-cols4-pairs"]
        table[f"mxfp4-moe-gate-up-cols4-{form}"] = (cu, cu_sig, dict(cu_consts, DECODE=mt.DECODES[form]), *cu_rest)
    # (with each program asking the L2 for its part of the next layer's weight first, moe_l2_prefetch)
    table["mxfp4-moe-down-choices-prefetch"] = (dc, sig_, dict(consts_, PREFETCH=True), *rest)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="fp8-sum,fp8-rt,bf16-sum,moe-gate-up,moe-down-rows,fp8-moe-gate-up,"
                                          "fp8-moe-down-rows,fp8-moe-gate-up-rt,fp8-rt2,fp8-rt4,mxfp4-moe-gate-up,"
                                          "mxfp4-moe-gate-up-rt,mxfp4-moe-gate-up-rt-pairs,mxfp4-moe-gate-up-cols4-pairs,"
                                          "mxfp4-moe-gate-up-cols8-pairs,mxfp4-moe-down-rt,mxfp4-moe-down-choices,"
                                          "mxfp4-moe-down-choices-pairs,mxfp4-moe-grouped,"
                                          "mxfp4-moe-grouped-pairs,mxfp4-moe-grouped-pairs-fold,"
                                          "mxfp4-moe-grouped-pairs-m128,mxfp4-moe-grouped-pairs-fold-m128,"
                                          "mxfp4-moe-gate-up-cols4-pairs-fma,"
                                          "mxfp4-moe-gate-up-cols4-words-fma,mxfp4-moe-down-choices-pairs-fma,"
                                          "mxfp4-moe-down-choices-words-fma,mxfp4-moe-down-choices-pairs-fma-w4,"
                                          "mxfp4-moe-down-choices-words-fma-w4")
    ap.add_argument("--show", default="", help="Print this kernel's loop.")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    table = kernels()
    for name in args.kernels.split(","):
        kernel, sig, const, div, warps, stages, weights = table[name]
        compiled = compile_sm90(kernel, sig, const, div, warps, stages)
        loop = loop_of(compiled.asm["sass"], innermost=name.startswith(INNERMOST))
        ops = collections.Counter(opcode(i) for i in loop)
        per_weight = len(loop) * warps / weights  # (warp instructions: each thread's count, times the warps)
        weight_bytes = 1 if name.startswith("fp8") else 0.5 if name.startswith("mxfp4") else 2
        print(f"{name}: {len(loop)} instructions a thread a step ({weights} weights), {per_weight:.3f} warp "
              f"instructions a weight -> {4 / per_weight:.1f} weights/clk/SM issued; the copy rate brings "
              f"{BYTES_PER_CLOCK / weight_bytes:.1f}; {occupancy(compiled, warps)}")
        print("    " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
        if name == args.show:
            print("\n".join(loop))


if __name__ == "__main__":
    main()
