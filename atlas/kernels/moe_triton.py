"""Triton matmuls for the routed experts at small token counts: y[m] = W[e(m)] @ x[row(m)] for rows
routed to experts, with W [E, N, K] the stacked expert weights (gate|up or down), accumulated in float32
and returned in x's dtype.

Why: at decode, a DeepSeek-V2-Lite MoE layer (64 experts, w13 [64, 2816, 2048], w2 [64, 2048, 1408],
bf16, top-6) is bound by reading the weights of the experts its tokens use. Through F.grouped_mm
(cutlass) its 26 layers took ~2.5 ms a step at one token, where reading the 6 experts' bytes takes
~0.63 ms, and ~10 ms at 64 tokens, where reading every expert takes ~6.7 ms. Here each program owns
BLOCK_N output columns of one expert and streams that slice of W once, one launch per projection:
- "pairs" (one to a few tokens): one output row per (token, choice) pair p = t * k + j, in that order
  (no sort, no scatter back): expert ids.flatten()[p], x row p // TOPK (TOPK = k for gate|up, whose x
  is [T, D]; 1 for down, whose input is already one row per pair). Grid (cdiv(N, BLOCK_N), P); each
  program multiplies on the CUDA cores and reduces along K in float32: the "sum" GEMV of
  kernels/gemv_triton.py at one row, whose tile helpers it shares. An expert chosen by two pairs is
  read twice (~20 % more bytes at 4 tokens x 6 of 64 experts).
- "grouped" (more tokens): rows sorted by expert, offsets [E + 1] (cumulative counts). Grid
  (cdiv(N, BLOCK_N), E); program (n, e) walks rows offsets[e] .. offsets[e + 1] in chunks of 16 (the
  smallest tl.dot tile, rows padded as in the "dot" GEMV) on the tensor cores; an expert without rows
  does nothing. Each chunk re-reads the program's W slice (a second chunk is rare at decode sizes). With `bias=`
  each row's expert bias is added onto the rounded product in the epilogue (the product then an add, bit for bit).
Sizes come from tensor shapes and rows from device values (no host sync): both run inside CUDA graphs.
The reference is kernels/moe.py (moe_matmul_ref); layers/moe.py dispatches.

The pairs mode also comes fused with what surrounds it at one to a few tokens, where a step is hundreds of
short kernels and each one saved is a few microseconds (at one token a Qwen3-30B-A3B MoE layer was about 17):
- gate|up with the activation as its epilogue (`moe_pairs_gate_up_act`): a program takes BLOCK_N / 2 columns of
  the gate and of the up half, interleaved as the dense GEMV's epilogue does (gemv_triton.gate_up_rows), and
  rounds like the matmul followed by the activation kernel;
- down with the routing weights' sum (`moe_pairs_down_combine`): out[t] = sum_j weights[t, j] * (W2[e_tj] @
  h[t k + j] + b2[e_tj]), program (n, t) walking token t's k choices; the products stay in float32 until the
  one store (the unfused path rounds each choice's product to the dtype first). Or (the moe_down_rows knob, on but for MXFP4
  weights) with the k choices' weight rows in one tile, so that their loads issue together
  (_moe_down_combine_rows_kernel): the same sums. At one token of Qwen3-30B-A3B's shape on an H200 its down took 11
  us against 24 (BENCHMARKS.md 7.1).
Both skip a pair whose routing weight is 0 (no weight read): a zero-computation expert (LongCat-Flash), another
rank's expert under expert parallelism. Its h row is stored as zeros.

FP8 weights (float8_e4m3fn W with float32 block scales [E, ceil(N / bn), ceil(K / bk)]: `scale=`, `block=(bn, bk)`;
or row scales [E, N], block None; layers/moe.py's FP8 experts): every kernel multiplies each loaded W tile by the
scale of each element's block (row // bn, column // bk; row scales: GROUP_K = 0) in float32, then multiplies as for
plain weights: W is read at one byte a weight. The scales load once per row and block of the tile (a vector, or a
small tile broadcast over the block's columns), not per element. The rows kernel (down at decode) multiplies on the
CUDA cores with that float32 weight (the dequantizing reference's weight before its rounding to the activations'
dtype, as fp8_linear_triton's GEMV takes dense layers: on sm_90 the rounding is a conversion instruction a weight,
tools/sass_loop_mix.py); the other kernels round it to the activations' dtype, the reference's weight (the pairs
gate|up kernel's sm_90 loop issued more instructions without it), the pairs ones multiplying on the CUDA cores and
the grouped one feeding it to tl.dot (the tensor cores in bf16; Triton's interpreter
cannot take an FP8 operand to tl.dot, nor does this), and serves FP8 experts at every token count (no grouped GEMM
for them). Its row chunks grow with the rows per expert (grouped_block_m), so that at prefill sizes each expert's
weights are read a few times, not rows / 16 times: FP8 prefill went from 2.3x bf16's time to 1.16x on the H200.

MXFP4 weights (gpt-oss's experts: W uint8 [E, N, K / 2], the checkpoint's [E, N, K / 32, 16] blocks viewed whole,
two FP4 E2M1 codes a byte, the low nibble the element before the high one; `scale=` its uint8 E8M0 scales
[E, N, K / 32], 2^(s - 127) for each run of 32 columns; `block` None; K % 32 == 0 and BLOCK_K % 32 == 0): the same
`scale=` convention, the weights' dtype (uint8) choosing the format. Every kernel reads a tile's K / 2 bytes, splits
the nibbles, decodes E2M1 from float32 bits (_e2m1), multiplies each by its run's power of two in float32 (exact)
(for the grouped kernel's tl.dot rounded to the activations' dtype, which holds them exactly), the weight
kernels/mxfp4.dequantize_mxfp4 gives, then multiplies as for plain weights (half a byte a weight read): the CUDA-core
kernels each half of the nibbles by x's even or odd columns, the
grouped one the halves interleaved for tl.dot. The scales are loaded once per run of 32 (a [BLOCK_N, BLOCK_K / 32]
tile) and broadcast. layers/moe.py's FusedExperts reads gpt-oss's experts through them (its MXFP4 form). At a few
tokens gate|up and down take the row tiles by default (the moe_mxfp4_row_tiles knob: each thread sums runs of 32
columns against the bf16 row, half the instructions a weight of the pairs kernels): still issue-bound, at about a
third of the copy rate on an H100 (BENCHMARKS.md 7.3). The moe_mxfp4_decode knob chooses how they decode: from each
byte's bits, from int32 words' bits, through E4M3 bytes and sm_89+'s E4M3 conversion (inline PTX, a third fewer
instructions a weight, yet a slower step on an H100), a byte's two codes by two multiplies (pairs, the default), or
in the two kernels that run by default, pairs or int32 words with fused multiply-add chains (DECODES above the
kernels); moe_mxfp4_row_steps sets each kernel's step, stages, form and warps apart.
"""

from __future__ import annotations

import functools
import re

import torch
import triton
import triton.language as tl

from atlas.errors import ConfigError
from atlas.kernels import settings
from atlas.kernels.fp8_linear import e4m3_capable
from atlas.kernels.fused_ops_triton import _LIBDEVICE_MATH, gated_pair
from atlas.kernels.gemv_triton import (
    BLOCK_M,
    _dot_tile,
    _load_tiles,
    _load_w,
    _load_x,
    _program_tiles,
    _sum_tile,
    expert_pair,
    gate_up_rows,
)
from atlas.kernels.l2_prefetch_triton import l2_prefetch_args, l2_prefetch_part
from atlas.kernels.moe_routing_triton import MAX_RANKED_EXPERTS, Routing, route_pair
from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin

# Pairs: the CUDA-core GEMV config that was fastest at one row on an H200 (kernels/gemv.py's first
# candidate): 4 outputs x 2048 of K a program, 4 warps, 3 stages. One tile covers a whole row of
# V2-Lite's gate|up (K = 2048); down's K = 1408 is one masked tile.
PAIRS_BLOCK_N = 4
PAIRS_BLOCK_K = 2048
PAIRS_NUM_WARPS = 4
PAIRS_NUM_STAGES = 3


@functools.lru_cache(maxsize=8)
def parse_pairs_tiles(text: str) -> dict[str, dict[str, int]]:
    """The `moe_pairs_tiles` tuning knob ("gate_up:n8k2048w4s3;down:n4k256w4s3", either part) as the pairs
    wrappers' keyword arguments by kernel: block_n (gate_up: gate and up columns together, so even), block_k,
    num_warps, num_stages; a ConfigError naming the part that is not KERNEL:nNkKwWsS."""
    tiles: dict[str, dict[str, int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kernel, _, config = part.partition(":")
        found = re.fullmatch(r"n(\d+)k(\d+)w(\d+)s(\d+)", config.strip())
        if kernel.strip() not in ("gate_up", "down") or found is None:
            raise ConfigError(f"tuning moe_pairs_tiles: {part!r} is not gate_up:nNkKwWsS or down:nNkKwWsS (e.g. "
                              f"down:n4k256w4s3)")
        n, k, w, st = (int(v) for v in found.groups())
        pow2 = all(v >= 1 and v & (v - 1) == 0 for v in (n, k, w))
        if not (pow2 and k >= 32 and w <= 16 and st >= 1 and (kernel.strip() == "down" or n >= 2)):
            raise ConfigError(f"tuning moe_pairs_tiles: {part!r}: n, k and w must be powers of two (k from 32, w up "
                              f"to 16, gate_up's n from 2: its gate and up columns) and s at least 1")
        tiles[kernel.strip()] = dict(block_n=n, block_k=k, num_warps=w, num_stages=st)
    return tiles


# Quantized experts' gate|up in row tiles (the moe_row_tiles knob for FP8, moe_mxfp4_row_tiles for MXFP4): 4 W rows
# (2 output columns) a program; FP8: the dense GEMV's default 2,048 columns a step, MXFP4: 64 runs of 32. Chosen from
# sm_90 instruction counts (tools/sass_loop_mix.py); MXFP4's made gpt-oss-20b's batch-1 step 1.23x faster on an H100
# (session 78), FP8's were 1.4 % slower on Qwen3-30B-A3B's (BENCHMARKS.md 7.2, 7.3).
ROW_TILES_BLOCK_N = 4
# MXFP4 weights: 1,024 columns a tile (512 bytes a row). At gpt-oss-20b's expert shapes and one token on an H200,
# 2,048 took 115 us for gate|up and 64 for down, 1,024 took 82 and 52 (tools/moe_decode_kernel_bench.py,
# benchmarks/s50/call5), with the decode before _e2m1's float32-bits form.
MXFP4_PAIRS_BLOCK_K = 1024
# Grouped: 128 divides both of V2-Lite's K (2048 and 1408 = 11 * 128), so no tile is masked; 64 columns
# a program keep the x chunk's re-reads (from L2, once per program) under a tenth of the W slice's bytes
# and still give 44 x 64 programs for gate|up (32 x 64 for down) when every expert has rows. Chosen on
# paper, not yet timed on a GPU.
GROUPED_BLOCK_N = 64
GROUPED_BLOCK_K = 128
GROUPED_NUM_WARPS = 4
GROUPED_NUM_STAGES = 3


@triton.jit
def _dequant_w(w, s_ptr, rows, k0, n_ok, K, stride_sn, stride_sk, DT: tl.constexpr, FP8: tl.constexpr,
               GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """FP8: the W tile [BLOCK_N, BLOCK_K] (rows `rows`, columns k0 .. k0 + BLOCK_K) times the scale of each element's
    block (row // GROUP_N, column // GROUP_K; GROUP_K 0: a scale per row) in float32, then in DT (the activations'
    dtype, as the dequantizing reference rounds the weight, for tl.dot; float32 for the CUDA-core sums); else the
    tile as it is. The scales load as a vector per row
    (a tile inside one block's columns) or a [BLOCK_N, BLOCK_K / GROUP_K] tile broadcast over each block's columns:
    an element-wise gather would issue four bytes of scale loads for each byte of weight."""
    if FP8:
        if GROUP_K == 0:
            s = tl.load(s_ptr + rows.to(tl.int64) * stride_sn, mask=n_ok, other=0.0)
            w = w.to(tl.float32) * s[:, None]
        elif GROUP_K % BLOCK_K == 0:  # (k0 is a multiple of BLOCK_K: the tile lies in one block's columns)
            s = tl.load(s_ptr + (rows // GROUP_N).to(tl.int64) * stride_sn + (k0 // GROUP_K) * stride_sk, mask=n_ok,
                        other=0.0)
            w = w.to(tl.float32) * s[:, None]
        elif BLOCK_K % GROUP_K == 0:
            GROUPS: tl.constexpr = BLOCK_K // GROUP_K
            g = k0 // GROUP_K + tl.arange(0, GROUPS)
            s = tl.load(s_ptr + (rows // GROUP_N).to(tl.int64)[:, None] * stride_sn + g[None, :] * stride_sk,
                        mask=n_ok[:, None] & (g < tl.cdiv(K, GROUP_K))[None, :], other=0.0)
            w = tl.reshape(tl.reshape(w.to(tl.float32), [BLOCK_N, GROUPS, GROUP_K]) * s[:, :, None],
                           [BLOCK_N, BLOCK_K])
        else:  # (block widths that neither divide nor are divided by the tile's: a scale per element)
            k = k0 + tl.arange(0, BLOCK_K)
            s = tl.load(s_ptr + (rows // GROUP_N).to(tl.int64)[:, None] * stride_sn + (k // GROUP_K)[None, :] * stride_sk,
                        mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            w = w.to(tl.float32) * s
        w = w.to(DT)  # (one return: Triton types every return of a function alike)
    return w


@triton.jit
def _e2m1(c):
    """FP4 E2M1 codes (int32, 0..15) -> their values in float32: bit 3 the sign, bits 2-1 the exponent e, bit 0 the
    mantissa m; e = 0: 0.5 m, else (1 + 0.5 m) 2^(e - 1). The sign bit moved to a float32's sign and bits 2-0 to the
    exponent field's two lowest bits and the mantissa's highest make exactly the value times 2^-126 (e = 0, m = 1: the
    subnormal 2^-127, which the kernels keep: they are compiled without flushing subnormals), so one multiply by
    2^126 gives the value: five integer operations and a multiply a code, where decoding e and m apart took about
    fifteen (the one-token MXFP4 expert kernels were bound by them)."""
    bits = ((c & 8) << 28) | ((c & 7) << 22)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # (2^126)


@triton.jit
def _e8m0(s):
    """E8M0 scales s (int32) -> 2^(s - 127) in float32 from its bits: exponent field s (s = 0: the subnormal
    2^-127)."""
    return tl.where(s == 0, 0x400000, s << 23).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_run_scales(s_rows, k0, n_ok, K, stride_sk, BLOCK_K: tl.constexpr):
    """The E8M0 scales of the runs of columns k0 .. k0 + BLOCK_K (int32 [BLOCK_N, BLOCK_K / 32]; 127 past K)."""
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)[None, :]
    return tl.load(s_rows + g * stride_sk, mask=n_ok[:, None] & (g < K // 32), other=127).to(tl.int32)


@triton.jit
def _mxfp4_halves(w_rows, s_ptr, rows, k0, n_ok, K, stride_sn, stride_sk, DT: tl.constexpr, EVEN_N: tl.constexpr,
                  EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """MXFP4: the W tile [BLOCK_N, BLOCK_K] at columns k0 .. k0 + BLOCK_K of the rows `rows` (row pointers w_rows into
    the packed bytes [N, K / 2]: byte j holds element 2 j in its low nibble, 2 j + 1 in its high one) as its even and
    its odd columns, each [BLOCK_N, BLOCK_K / 2]: each value times 2^(s - 127) of its run of 32 columns (E8M0 scales
    [N, K / 32]) in float32 (exact), rounded to DT, as kernels/mxfp4.dequantize_mxfp4 followed by a cast does. (The
    CUDA-core kernels multiply the halves by x's even and odd columns: interleaving them back into one tile moves
    every element through shared memory; tl.dot takes them interleaved.) Masked columns and rows are zeros.
    BLOCK_K % 32 == 0."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # (byte columns; K / 2 % (BLOCK_K / 2) == 0 where K % BLOCK_K == 0)
    packed = _load_w(w_rows, kb, n_ok, K // 2, EVEN_N, EVEN_K).to(tl.int32)  # (masked: code 0, the value 0)
    s = _mxfp4_run_scales(s_ptr + rows.to(tl.int64)[:, None] * stride_sn, k0, n_ok, K, stride_sk, BLOCK_K)
    scale = _e8m0(s)[:, :, None]
    even = tl.reshape(tl.reshape(_e2m1(packed & 15), [BLOCK_N, GROUPS, 16]) * scale, [BLOCK_N, BLOCK_K // 2])
    odd = tl.reshape(tl.reshape(_e2m1(packed >> 4), [BLOCK_N, GROUPS, 16]) * scale, [BLOCK_N, BLOCK_K // 2])
    return even.to(DT), odd.to(DT)


@triton.jit
def _x_halves(x_rows, k0, m_ok, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The x rows' even and odd columns of k0 .. k0 + BLOCK_K, for _mxfp4_halves' W halves."""
    even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
    return _load_x(x_rows, even, m_ok, K, EVEN_K), _load_x(x_rows, even + 1, m_ok, K, EVEN_K)


@triton.jit
def _accumulate(acc, x_rows, w_rows, s_ptr, rows, k0, offs_k, m_ok, n_ok, K, stride_sn, stride_sk, DT: tl.constexpr,
                EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr, MXFP4: tl.constexpr,
                GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc plus the product of the W rows' tile (FP8 and MXFP4 W in DT) and the x rows' tile at columns k0 + offs_k:
    with DOT, acc [BLOCK_N, rows of x] += W x^T by tl.dot; else acc [rows of x, BLOCK_N] by CUDA-core sums."""
    if MXFP4:
        if DOT:  # (one tile for one tl.dot: two of half the depth took 53 ms for gpt-oss-20b's 128-token TTFT, 37 ms)
            w_even, w_odd = _mxfp4_halves(w_rows, s_ptr, rows, k0, n_ok, K, stride_sn, stride_sk, DT, EVEN_N, EVEN_K,
                                          BLOCK_N, BLOCK_K)
            x = _load_x(x_rows, k0 + offs_k, m_ok, K, EVEN_K)
            acc = _dot_tile(tl.interleave(w_even, w_odd), x, acc, IEEE)
        else:  # (float32 weights: the same values, which DT holds exactly, without a conversion a weight)
            w_even, w_odd = _mxfp4_halves(w_rows, s_ptr, rows, k0, n_ok, K, stride_sn, stride_sk, tl.float32,
                                          EVEN_N, EVEN_K, BLOCK_N, BLOCK_K)
            x_even, x_odd = _x_halves(x_rows, k0, m_ok, K, EVEN_K, BLOCK_K)
            acc = _sum_tile(w_odd, x_odd, _sum_tile(w_even, x_even, acc))
    else:
        x, w = _load_tiles(x_rows, w_rows, k0 + offs_k, m_ok, n_ok, K, EVEN_N, EVEN_K)
        w = _dequant_w(w, s_ptr, rows, k0, n_ok, K, stride_sn, stride_sk, DT, FP8, GROUP_N, GROUP_K, BLOCK_N, BLOCK_K)
        if DOT:
            acc = _dot_tile(w, x, acc, IEEE)
        else:
            acc = _sum_tile(w, x, acc)
    return acc


# ("matmul" in the kernels' names: the kernel profile, atlas/bench/kernel_profile.py, counts them as matmuls.)
@triton.jit
def _moe_matmul_pairs_kernel(
    x_ptr, w_ptr, ids_ptr, y_ptr, s_ptr, N, K, stride_xm, stride_we, stride_wn, stride_ym, stride_se, stride_sn,
    stride_sk, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    MXFP4: tl.constexpr,
):
    pair = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row = (pair // TOPK).to(tl.int64)
    # One x row: the GEMV's tiles with ROWS = 1, based at this pair's row and expert.
    offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, x_rows = _program_tiles(
        x_ptr + row * stride_xm, w_ptr + expert * stride_we, 1, N, stride_xm, stride_wn, 1, BLOCK_N, BLOCK_K)
    s_expert = s_ptr + expert * stride_se
    acc = tl.zeros([1, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        acc = _accumulate(acc, x_rows, w_rows, s_expert, offs_n, k0, offs_k, m_ok, n_ok, K, stride_sn, stride_sk,
                          y_ptr.dtype.element_ty, EVEN_N, EVEN_K, FP8, MXFP4, GROUP_N, GROUP_K, BLOCK_N, BLOCK_K,
                          False, False)
    y = y_ptr + pair.to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[None, :])


# The grouped kernel's MXFP4 decode (its PAIRS constexpr, the moe_mxfp4_dot_pairs knob): 0 each code through float32
# (_mxfp4_halves); 1 a byte's two codes to a bf16 pair by integer operations, then bf16 products (_mxfp4_bf16_pairs);
# 2 the same bits and values through float32 where the interpreter runs the kernel (it computes bf16 wrongly: the
# grouped kernel's bf16 cases run on CUDA only).
PAIRS_OFF, PAIRS_ON, PAIRS_INTERPRETED = 0, 1, 2
# E8M0 scale codes up to this let the pairs decode fold 2^126 into a run's bf16 scale, 2^(s - 1) (_mxfp4_bf16_pairs)
MXFP4_FOLD_MAX_SCALE = 128


@triton.jit
def _mxfp4_pair_bits(b):
    """MXFP4 bytes b (int32) -> each byte's two codes as one int32 of two bf16 bits, the even element's in the low
    half: each value times 2^-126 (_e2m1's float32 bits, their top halves). One multiply places the byte's two
    magnitudes (bits 0-2 and 4-6) at 6-8 and 22-24 and another its two signs at 15 and 31."""
    return ((b * 0x40040) & 0x01C001C0) | ((b * 0x1001000) & -2147450880)  # (-2147450880: 0x80008000)


@triton.jit
def _mxfp4_pair_halves(b):
    """_mxfp4_pair_bits as float32: (the even elements, the odd ones), each value times 2^-126."""
    r = _mxfp4_pair_bits(b)
    return (r << 16).to(tl.float32, bitcast=True), (r & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_bf16_pairs(b, s, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      FOLD: tl.constexpr = False):
    """MXFP4 bytes b (int32 [BLOCK_N, BLOCK_K / 2], the low nibble the even element) with their runs' E8M0 scales s
    (int32 [BLOCK_N, BLOCK_K / 32]) -> the bf16 tile [BLOCK_N, BLOCK_K], each value code x 2^(s - 127): the weight
    _mxfp4_halves gives in bf16 (INTERPRETED: those values in float32, Triton's interpreter multiplying bf16
    wrongly). Two codes' bf16 bits in one int32 (_mxfp4_pair_bits) by four instructions a byte, where _e2m1 takes
    three a code and a conversion a pair. Then times 2^126 and
    the scale in bf16, both exact (powers of two; bf16 has float32's exponents, the one subnormal code 2^-127
    included). FOLD (every scale code s <= MXFP4_FOLD_MAX_SCALE, which the caller knows from the loaded scales):
    one multiply by 2^126 2^(s - 127) = 2^(s - 1), a normal bf16 from s's bits alone where s <= 128 (above, the
    bits would be inf), the same exact products; on the GPU a bf16x2 fused multiply-add (with -0) of each pair's
    bits by the scale's bits twice over, as the pair sits in its register: written as bf16 tensors, the compiled
    loop moved the pairs apart and back (sm_90: 420 instructions a step against 357 so and 415 unfolded)."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    if INTERPRETED:  # (the same values in float32: a bf16 pair's bits are the top halves of float32 ones)
        lo, hi = _mxfp4_pair_halves(b)
        w = tl.interleave(lo, hi)
        if FOLD:
            w = tl.reshape(w, [BLOCK_N, GROUPS, 32]) * ((s + 126) << 23).to(tl.float32, bitcast=True)[:, :, None]
            return tl.reshape(w, [BLOCK_N, BLOCK_K])
        f = _e8m0(s)
    else:
        r = _mxfp4_pair_bits(b)
        if FOLD:  # (2^(s - 1)'s bf16 bits in both halves, each byte's pair of its run)
            f = (s + 126) << 7
            f2 = tl.reshape(tl.broadcast_to((f | (f << 16))[:, :, None], [BLOCK_N, GROUPS, 16]),
                            [BLOCK_N, BLOCK_K // 2])
            r = tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r",
                                          [r, f2, tl.full(r.shape, -2147450880, tl.int32)],  # (-0 pair: 0x80008000)
                                          dtype=tl.int32, is_pure=True, pack=1)
        w = tl.interleave(r.to(tl.int16).to(tl.bfloat16, bitcast=True),
                          (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))
        if FOLD:
            return tl.reshape(w, [BLOCK_N, BLOCK_K])
        f = tl.where(s == 0, 0x40, s << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s - 127) in bf16
    w = tl.reshape(w * 8.507059173023462e37, [BLOCK_N, GROUPS, 32]) * f[:, :, None]  # (2^126)
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _moe_matmul_grouped_kernel(
    x_ptr, w_ptr, offsets_ptr, y_ptr, s_ptr, N, K, stride_xm, stride_we, stride_wn, stride_ym, stride_se,
    stride_sn, stride_sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, MXFP4: tl.constexpr, PAIRS: tl.constexpr = 0,
    HAS_BIAS: tl.constexpr = False, b_ptr=None, stride_be=0, GATHER: tl.constexpr = False, rows_ptr=None,
    SCATTER: tl.constexpr = False, out_rows_ptr=None, ACT: tl.constexpr = -1, LIBDEVICE: tl.constexpr = False,
    alpha=1.0, limit=0.0, FOLD: tl.constexpr = False,
):
    """y rows offsets[e] .. offsets[e + 1] through expert e (moe_grouped_matmul). GATHER: sorted row m is x's row
    rows_ptr[m]; SCATTER: it is stored as y's row out_rows_ptr[m] (the moe_grouped_gather knob: no copies of the rows
    into expert order and back). ACT >= 0 (an ACT_* code; W is [gate | up], N = 2 I): a program's W rows are gate
    and up interleaved (gemv_triton.gate_up_rows) and y [M, I] is the gated activation of the rounded (and biased)
    products, gated_pair's rounding after each operation, as fused_ops' activation kernel after this one computes it
    (the moe_grouped_act knob). FOLD (PAIRS): every E8M0 scale code is at most MXFP4_FOLD_MAX_SCALE
    (_mxfp4_bf16_pairs)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    expert = tl.program_id(1)
    start = tl.load(offsets_ptr + expert).to(tl.int32)
    end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    s_expert = s_ptr + expert.to(tl.int64) * stride_se
    for m0 in range(start, end, BLOCK_M):  # no iteration for an expert without rows
        x_chunk = x_ptr + tl.cast(m0, tl.int64) * stride_xm  # (m0: a plain int in the interpreter)
        offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, x_rows = _program_tiles(
            x_chunk, w_expert, end - m0, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
        if ACT >= 0:  # (gate and up rows side by side: the epilogue holds both halves of its columns)
            offs_n, n_ok = gate_up_rows(tl.program_id(0), N, BLOCK_N, ACT)
            w_rows = w_expert + offs_n.to(tl.int64)[:, None] * stride_wn
        if GATHER:
            src = tl.load(rows_ptr + m0 + offs_m, mask=m_ok, other=0).to(tl.int64)
            x_rows = x_ptr + src[:, None] * stride_xm
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T tile: W rows x padded x rows
        if PAIRS:  # (MXFP4, bf16 x: PAIRS_ON / PAIRS_INTERPRETED)
            # each step's scales load a step ahead: loaded in the step, they were a global load's wait each step
            # (Triton's pipeline stages take W and x only)
            s_rows = s_expert + offs_n.to(tl.int64)[:, None] * stride_sn
            s_next = _mxfp4_run_scales(s_rows, 0, n_ok, K, stride_sk, BLOCK_K)
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                s_step = s_next
                s_next = _mxfp4_run_scales(s_rows, k0 + BLOCK_K, n_ok, K, stride_sk, BLOCK_K)
                b = _load_w(w_rows, k0 // 2 + tl.arange(0, BLOCK_K // 2), n_ok, K // 2, EVEN_N, EVEN_K).to(tl.int32)
                w = _mxfp4_bf16_pairs(b, s_step, PAIRS == 2, BLOCK_N, BLOCK_K, FOLD)
                x = _load_x(x_rows, k0 + offs_k, m_ok, K, EVEN_K)
                if PAIRS == 2:  # (float32 products of the same values where the interpreter runs it)
                    acc = _dot_tile(w, x.to(tl.float32), acc, True)
                else:
                    acc = _dot_tile(w, x, acc, False)
        else:
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                acc = _accumulate(acc, x_rows, w_rows, s_expert, offs_n, k0, offs_k, m_ok, n_ok, K, stride_sn,
                                  stride_sk, y_ptr.dtype.element_ty, EVEN_N, EVEN_K, FP8, MXFP4, GROUP_N, GROUP_K,
                                  BLOCK_N, BLOCK_K, True, IEEE)
        out = acc.to(DT)
        if HAS_BIAS:  # (the expert's bias row onto the rounded product, rounded again: the product then an add)
            b = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0)
            out = (out.to(tl.float32) + b.to(tl.float32)[:, None]).to(DT)
        if SCATTER:
            dst = tl.load(out_rows_ptr + m0 + offs_m, mask=m_ok, other=0).to(tl.int64)
        else:
            dst = tl.cast(m0, tl.int64) + offs_m
        if ACT >= 0:
            gate, up = tl.split(tl.reshape(tl.trans(out.to(tl.float32)), [BLOCK_M, BLOCK_N // 2, 2]))
            cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(y_ptr + dst[:, None] * stride_ym + cols[None, :],
                     gated_pair(gate, up, ACT, LIBDEVICE, DT, alpha, limit).to(DT),
                     mask=m_ok[:, None] & (cols < N // 2)[None, :])
        else:
            tl.store(y_ptr + dst[None, :] * stride_ym + offs_n[:, None], out, mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def _moe_gate_up_act_kernel(
    x_ptr, w_ptr, ids_ptr, rw_ptr, y_ptr, s_ptr, b_ptr, N, K, stride_xm, stride_we, stride_wn, stride_ym, stride_se,
    stride_sn, stride_sk, stride_be, alpha, limit, lg_ptr, rb_ptr, E, stride_lt, r_scale, r_floor, r_eps,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE: tl.constexpr,
    ROUTE_E: tl.constexpr, SCORING: tl.constexpr, ROUTE_BIAS: tl.constexpr, NORM: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Pair p's gate|up product with the activation: y[p, c] = act(W[e, c] . x + b[e, c]) * (W[e, I + c] . x +
    b[e, I + c]), N = 2 I (the bias where HAS_BIAS; each sum rounded to the dtype as the unfused path rounds it).
    ROUTE: the pair's expert and routing weight are chosen here from the router's logits (lg_ptr, rb_ptr ... r_eps
    and ROUTE_E ... ROUND: moe_routing_triton.route_pair's arguments), and the first program of each pair stores
    them at ids_ptr and rw_ptr for the down kernel; else they are loaded from there."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pair = tl.program_id(1)
    w_ids, n_ok = gate_up_rows(pid, N, BLOCK_N, ACT)
    out_cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    y = y_ptr + pair.to(tl.int64) * stride_ym + out_cols[None, :]
    out_ok = (out_cols < N // 2)[None, :]
    pdl_begin(PDL)
    if ROUTE:
        weight, expert = route_pair(lg_ptr, rb_ptr, pair // TOPK, pair % TOPK, E, stride_lt, r_scale, r_floor, r_eps,
                                    TOPK, ROUTE_E, SCORING, ROUTE_BIAS, NORM, ROUND)
        if pid == 0:
            tl.store(rw_ptr + pair, weight)
            tl.store(ids_ptr + pair, expert)
    else:
        weight = tl.load(rw_ptr + pair)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    if weight == 0:  # (a pair that adds nothing: module docstring)
        tl.store(y, tl.zeros([1, BLOCK_N // 2], DT), mask=out_ok)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        offs_m = tl.arange(0, 1)
        w_rows = w_ptr + expert * stride_we + w_ids.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + (pair // TOPK).to(tl.int64) * stride_xm + offs_m[:, None] * stride_xm
        m_ok = offs_m < 1
        acc = tl.zeros([1, BLOCK_N], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            acc = _accumulate(acc, x_rows, w_rows, s_ptr + expert * stride_se, w_ids, k0, offs_k, m_ok, n_ok, K,
                              stride_sn, stride_sk, DT, EVEN_N, EVEN_K, FP8, MXFP4, GROUP_N, GROUP_K, BLOCK_N,
                              BLOCK_K, False, False)
        h = acc.to(DT).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + expert * stride_be + w_ids, mask=n_ok, other=0.0).to(tl.float32)
            h = (h + b[None, :]).to(DT).to(tl.float32)
        gate, up = tl.split(tl.reshape(h, [1, BLOCK_N // 2, 2]))
        tl.store(y, gated_pair(gate, up, ACT, LIBDEVICE, DT, alpha, limit).to(DT), mask=out_ok)


@triton.jit
def _moe_down_combine_kernel(
    h_ptr, w_ptr, ids_ptr, rw_ptr, b_ptr, y_ptr, s_ptr, N, K, stride_hm, stride_we, stride_wn, stride_be, stride_ym,
    stride_se, stride_sn, stride_sk, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, MXFP4: tl.constexpr,
):
    """Token t's output columns: sum over its TOPK pairs p of rw[p] * (W[e_p] . h[p] + b[e_p])."""
    t = tl.program_id(1)
    total = tl.zeros([1, BLOCK_N], tl.float32)
    pdl_begin(PDL)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        weight = tl.load(rw_ptr + pair).to(tl.float32)
        if weight != 0:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, h_rows = _program_tiles(
                h_ptr + pair.to(tl.int64) * stride_hm, w_ptr + expert * stride_we, 1, N, stride_hm, stride_wn, 1,
                BLOCK_N, BLOCK_K)
            acc = tl.zeros([1, BLOCK_N], tl.float32)
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                acc = _accumulate(acc, h_rows, w_rows, s_ptr + expert * stride_se, offs_n, k0, offs_k, m_ok, n_ok,
                                  K, stride_sn, stride_sk, y_ptr.dtype.element_ty, EVEN_N, EVEN_K, FP8, MXFP4,
                                  GROUP_N, GROUP_K, BLOCK_N, BLOCK_K, False, False)
            if HAS_BIAS:
                acc += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            total += weight * acc
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = y_ptr + t.to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, total.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])


@triton.jit
def _accumulate_rows(acc, h_rows, w_rows, s_ptr, rows, k0, offs_k, row_ok, K, stride_sn, stride_sk, DT: tl.constexpr,
                     EVEN_K: tl.constexpr, FP8: tl.constexpr, MXFP4: tl.constexpr, GROUP_N: tl.constexpr,
                     GROUP_K: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [R] plus each row's product of its W row and its own h row (row pointers h_rows, w_rows [R, 1]) at
    columns k0 + offs_k; FP8 and MXFP4 W in float32 as _accumulate's CUDA-core sums take them. Rows outside row_ok
    are not read."""
    if MXFP4:
        w_even, w_odd = _mxfp4_halves(w_rows, s_ptr, rows, k0, row_ok, K, stride_sn, stride_sk, tl.float32, False,
                                      EVEN_K, R, BLOCK_K)
        h_even, h_odd = _x_halves(h_rows, k0, row_ok, K, EVEN_K, BLOCK_K)
        acc += tl.sum(w_even.to(tl.float32) * h_even.to(tl.float32) + w_odd.to(tl.float32) * h_odd.to(tl.float32),
                      axis=1)
    else:
        h = _load_x(h_rows, k0 + offs_k, row_ok, K, EVEN_K)
        w = _load_w(w_rows, k0 + offs_k, row_ok, K, False, EVEN_K)
        w = _dequant_w(w, s_ptr, rows, k0, row_ok, K, stride_sn, stride_sk, tl.float32, FP8, GROUP_N, GROUP_K, R,
                       BLOCK_K)
        acc += tl.sum(w.to(tl.float32) * h.to(tl.float32), axis=1)
    return acc


@triton.jit
def _moe_down_combine_rows_kernel(
    h_ptr, w_ptr, ids_ptr, rw_ptr, b_ptr, y_ptr, s_ptr, N, K, stride_hm, stride_we, stride_wn, stride_be, stride_ym,
    scale_rows, stride_sn, stride_sk, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, MXFP4: tl.constexpr,
):
    """_moe_down_combine_kernel's sum with token t's TOPK choices in one tile: row r of the program's
    [TOPK_P2 * BLOCK_N, BLOCK_K] weight tile is output column n(r) of choice j(r)'s expert, so the choices' weight
    rows load together, where the other kernel walks them one expert after another. Rows of a pair with weight 0
    are masked (not read). The scales' row of (expert e, column n) is e * scale_rows * GROUP_N + n: the scales as
    if the experts' rows were stacked (stride_se = scale_rows * stride_sn, the wrapper checks)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    R: tl.constexpr = TOPK_P2 * BLOCK_N
    t = tl.program_id(1)
    r = tl.arange(0, R)
    j = r // BLOCK_N
    n = tl.program_id(0) * BLOCK_N + r % BLOCK_N
    pair = t.to(tl.int64) * TOPK + j
    j_ok = j < TOPK
    pdl_begin(PDL)
    weight = tl.load(rw_ptr + pair, mask=j_ok, other=0.0).to(tl.float32)
    expert = tl.load(ids_ptr + pair, mask=j_ok, other=0).to(tl.int64)
    row_ok = j_ok & (weight != 0) & (n < N)
    w_rows = w_ptr + (expert * stride_we + n.to(tl.int64) * stride_wn)[:, None]
    h_rows = h_ptr + (pair * stride_hm)[:, None]
    s_rows = expert * scale_rows * GROUP_N + n
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([R], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        acc = _accumulate_rows(acc, h_rows, w_rows, s_ptr, s_rows, k0, offs_k, row_ok, K, stride_sn, stride_sk, DT,
                               EVEN_K, FP8, MXFP4, GROUP_N, GROUP_K, R, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + n, mask=row_ok, other=0.0).to(tl.float32)
    total = tl.sum(tl.reshape(tl.where(row_ok, weight * acc, 0.0), [TOPK_P2, BLOCK_N]), axis=0)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + offs_n, total.to(DT), mask=offs_n < N)


@triton.jit
def _moe_combine_kernel(y_ptr, rw_ptr, out_ptr, D, stride_ym, stride_om, TOPK: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr):
    """out[t] = sum over j of rw[t, j] * y[t * TOPK + j]: each product rounded to float32, added in j's order from
    the first (no FMA contraction: the launch turns it off), the sum rounded to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    pdl_begin(PDL)
    acc = tl.load(y_ptr + t * TOPK * stride_ym + d, mask=ok, other=0.0).to(tl.float32) * tl.load(rw_ptr + t * TOPK)
    for j in tl.static_range(1, TOPK):
        y = tl.load(y_ptr + (t * TOPK + j) * stride_ym + d, mask=ok, other=0.0).to(tl.float32)
        acc += y * tl.load(rw_ptr + t * TOPK + j)
    tl.store(out_ptr + t * stride_om + d, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [T * k, D] in (token, choice) order, weights [T, k] float32 -> [T, D] in dtype: each token's rows times their
    routing weights, summed in one kernel (moe_combine_ref's numbers: FusedExperts._combine's products, added in the
    choices' order, where PyTorch's sum may pair them otherwise), without _combine's float32 copies of the rows."""
    t, k = weights.shape
    d = y.shape[1]
    assert y.shape[0] == t * k and y.stride(1) == 1 and weights.dtype == torch.float32, (y.shape, weights.dtype)
    out = torch.empty(t, d, dtype=dtype, device=y.device)
    if t == 0:
        return out
    block_d = min(1024, triton.next_power_of_2(d))
    _moe_combine_kernel[(t, triton.cdiv(d, block_d))](
        y, weights.contiguous(), out, d, y.stride(0), out.stride(0), TOPK=k, BLOCK_D=block_d,
        num_warps=4, enable_fp_fusion=False, **launch_options(y.device, moe=True))
    return out


@triton.jit
def _expert_sort_kernel(ids_ptr, order_ptr, rows_ptr, offsets_ptr, M, E, TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program: the M (token, choice) pairs' expert ids -> offsets [E + 1] of each expert's rows, order [M] (the
    pairs by expert, stable: pair i's place is its expert's offset plus the pairs of that expert before it) and
    rows [M] = order // TOPK (the token each sorted row reads). Two passes over the ids in BLOCK-pair chunks: the
    count per expert, then each pair's place from a one-hot [BLOCK, BLOCK_E] cumulative sum."""
    pdl_begin(PDL)
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < E
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, M, BLOCK):
        i = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + i, mask=i < M, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    ends = tl.cumsum(counts, axis=0)
    tl.store(offsets_ptr + 1 + experts, ends.to(tl.int64), mask=e_ok)
    tl.store(offsets_ptr + experts, tl.zeros([BLOCK_E], tl.int64), mask=experts == 0)
    seen = ends - counts  # (each expert's next place)
    for start in range(0, M, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < M
        e = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        place = tl.sum(hot * (seen[None, :] + tl.cumsum(hot, axis=0) - 1), axis=1)
        tl.store(order_ptr + place, i.to(tl.int64), mask=ok)
        tl.store(rows_ptr + place, (i // TOPK).to(tl.int64), mask=ok)
        seen += tl.sum(hot, axis=0)


# (the experts and pairs the one-program sort takes: a BLOCK x BLOCK_E one-hot chunk sits in its registers, and
# it walks the pairs twice, so beyond a decode step's pairs the radix sort's many programs are faster)
EXPERT_SORT_MAX_EXPERTS = 256
EXPERT_SORT_MAX_PAIRS = 4096


def expert_sort(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] (each in 0 .. num_experts - 1) -> (order [T * k]: the (token, choice) pairs sorted by expert, stably,
    as torch.argsort(ids.reshape(-1), stable=True) orders them; rows [T * k] = order // k; offsets [num_experts + 1]
    of each expert's rows), int64, in one launch (the moe_expert_sort knob: in place of the argsort, the count, its
    cumulative sum and the division's kernels)."""
    t, k = ids.shape
    assert 1 <= num_experts <= EXPERT_SORT_MAX_EXPERTS and t * k <= EXPERT_SORT_MAX_PAIRS, (num_experts, ids.shape)
    m = t * k
    order = torch.empty(m, dtype=torch.int64, device=ids.device)
    rows = torch.empty(m, dtype=torch.int64, device=ids.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=ids.device)
    block_e = triton.next_power_of_2(num_experts)
    _expert_sort_kernel[(1,)](ids.contiguous(), order, rows, offsets, m, num_experts, TOPK=k, BLOCK_E=block_e,
                              BLOCK=max(16, 16384 // block_e), num_warps=8, **launch_options(ids.device, moe=True))
    return order, rows, offsets


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
           block: tuple[int, int] | None = None) -> tuple:
    """-> the launch arguments of the weights' scales: (scale pointer, stride_se, stride_sn, stride_sk),
    dict(FP8=, GROUP_N=, GROUP_K=, MXFP4=) and K, the weights' logical columns. FP8 weights (float8_e4m3fn) come with
    float32 scales [E, ceil(N / bn), ceil(K / bk)] per block = (bn, bk), or [E, N] per row (block None); MXFP4 weights
    (uint8 [E, N, K / 2], two codes a byte) with uint8 E8M0 scales [E, N, K / 32] (block None)."""
    assert x.dim() == 2 and w.dim() == 3, (x.shape, w.shape)
    assert x.stride(1) == 1 and w.stride(2) == 1, (x.stride(), w.stride())
    if w.dtype == torch.uint8:  # MXFP4
        e, n, half = w.shape
        k = 2 * half
        assert x.shape[1] == k and k % 32 == 0 and block is None, (x.shape, w.shape, block)
        assert scale is not None and scale.dtype == torch.uint8 and tuple(scale.shape) == (e, n, k // 32), (
            None if scale is None else (scale.dtype, scale.shape), w.shape)
        return ((scale, scale.stride(0), scale.stride(1), scale.stride(2)),
                dict(FP8=False, GROUP_N=1, GROUP_K=32, MXFP4=True), k)
    assert x.shape[1] == w.shape[2], (x.shape, w.shape)
    if w.dtype != torch.float8_e4m3fn:
        assert scale is None and x.dtype == w.dtype, (x.dtype, w.dtype)
        return (w, 0, 0, 0), dict(FP8=False, GROUP_N=1, GROUP_K=1, MXFP4=False), w.shape[2]
    e, n, k = w.shape
    assert scale is not None and scale.dtype == torch.float32, scale
    if block is None:  # (a scale per row: GROUP_K 0)
        assert tuple(scale.shape) == (e, n), (scale.shape, w.shape)
        return (scale, scale.stride(0), scale.stride(1), 0), dict(FP8=True, GROUP_N=1, GROUP_K=0, MXFP4=False), k
    bn, bk = block
    assert tuple(scale.shape) == (e, -(-n // bn), -(-k // bk)), (scale.shape, w.shape, block)
    return ((scale, scale.stride(0), scale.stride(1), scale.stride(2)),
            dict(FP8=True, GROUP_N=bn, GROUP_K=bk, MXFP4=False), k)


def _block_k(block_k: int, fmt: dict) -> int:
    """block_k as the wrapper chose it; MXFP4 tiles cover whole runs of 32 columns (one scale each)."""
    assert not fmt["MXFP4"] or block_k % 32 == 0, block_k
    return block_k


def _pairs_block_k(block_k: int | None, fmt: dict) -> int:
    """The pairs kernels' K tile: the caller's, or the measured default of the weights' format."""
    if block_k is not None:
        return block_k
    return MXFP4_PAIRS_BLOCK_K if fmt["MXFP4"] else PAIRS_BLOCK_K


def moe_pairs_matmul(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, topk: int,
                     block_n: int = PAIRS_BLOCK_N, block_k: int | None = None,
                     num_warps: int = PAIRS_NUM_WARPS, num_stages: int = PAIRS_NUM_STAGES,
                     scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [R, K], w [E, N, K], expert ids [T, k] (P = T * k pairs, R = P / topk) -> y [P, N] with
    y[p] = w[ids.flatten()[p]] @ x[p // topk]. FP8 w: its scales [E, ceil(N / bn), ceil(K / bk)] per `block`. MXFP4
    w (uint8 [E, N, K / 2]): its uint8 E8M0 scales [E, N, K / 32] (module docstring)."""
    (s, sse, ssn, ssk), fp8, k = _check(x, w, scale, block)
    flat = ids.reshape(-1).contiguous()
    pairs, n = flat.shape[0], w.shape[1]
    assert pairs == x.shape[0] * topk, (pairs, x.shape, topk)
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return y
    block_k = _block_k(min(_pairs_block_k(block_k, fp8), triton.next_power_of_2(k)), fp8)  # (no tile wider than a row)
    _moe_matmul_pairs_kernel[(triton.cdiv(n, block_n), pairs)](
        x, w, flat, y, s, n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0), sse, ssn, ssk,
        TOPK=topk, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, EVEN_N=n % block_n == 0,
        EVEN_K=k % block_k == 0, num_warps=num_warps, **fp8,
    )
    return y


def grouped_block_m(rows: int, experts: int, mxfp4: bool = False) -> int:
    """The grouped kernel's BLOCK_M: the moe_grouped_block_m knob, or (0, the default) the mean rows per expert
    rounded up to a power of two within 16..128. A program walks its expert's rows in chunks of BLOCK_M and reads the
    expert's weight slice once per chunk: at decode sizes (a few rows an expert) 16, the smallest tl.dot tile; at
    prefill sizes the weights are read a few times instead of rows / 16 times, with wider tensor-core tiles. MXFP4
    weights take 8x the mean rows: each chunk decodes its weights again (a few instructions a weight, the kernel's
    bound), and an expert with twice the mean or more took a second chunk; the padded tensor-core rows cost little
    beside. gpt-oss-20b's step on an H100 at 64 requests: 5.97 ms with 64 rows against 9.18 with 16; at 256: 11.12
    with 128 against 16.88 with 32 (BENCHMARKS.md 7.3). (A function of the shapes only, so a captured CUDA graph's
    choice holds for its replays.)"""
    knob = settings.tuning.moe_grouped_block_m
    if knob:
        return knob
    mean = -(-rows // max(1, experts))
    if mxfp4:  # (a chunk decodes its weights again: 8x the mean rows, so that few experts take two)
        return min(128, max(BLOCK_M, triton.next_power_of_2(8 * mean)))
    return min(128, max(BLOCK_M, triton.next_power_of_2(mean)))


def moe_grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                       block_n: int = GROUPED_BLOCK_N, block_k: int = GROUPED_BLOCK_K,
                       num_warps: int = GROUPED_NUM_WARPS,
                       num_stages: int = GROUPED_NUM_STAGES, scale: torch.Tensor | None = None,
                       block: tuple[int, int] | None = None, block_m: int | None = None,
                       bias: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                       out_rows: torch.Tensor | None = None, act: int | None = None, alpha: float = 1.0,
                       limit: float | None = None, fold: bool = False) -> torch.Tensor:
    """x [M, K] rows sorted by expert, w [E, N, K], offsets [E + 1] (int32 or int64, offsets[0] = 0,
    offsets[E] = M) -> y [M, N] with y[m] = w[e] @ x[m] for offsets[e] <= m < offsets[e + 1]. FP8 w: its scales
    [E, ceil(N / bn), ceil(K / bk)] per `block`; MXFP4 w (uint8 [E, N, K / 2]): its E8M0 scales [E, N, K / 32].
    block_m: rows of an expert a program multiplies at once (None: grouped_block_m). bias [E, N] in x's dtype:
    y[m] = w[e] @ x[m] rounded, plus bias[e], rounded (as the product and then an add of the gathered bias rows, bit
    for bit, without the gather's [M, N] rows and the add's launch). rows [M] (integer): the sorted rows are
    x[rows] (x any number of rows), read in place; out_rows [M] (a permutation of 0 .. M - 1): sorted row m is
    returned as y[out_rows[m]]. The same numbers as the index_select before and the index_copy_ after, bit for bit.
    act (an ACT_* code of fused_ops_triton, with alpha and limit as moe_pairs_gate_up_act takes them): w is
    [gate | up] and y [M, N / 2] the gated activation of each row's products (the kernel's docstring). fold (MXFP4
    w): the caller knows every scale code of w is at most MXFP4_FOLD_MAX_SCALE (FusedExperts.mxfp4_fold), and the
    bf16 pairs decode scales each pair by one multiply, the same numbers."""
    (s, sse, ssn, ssk), fp8, k = _check(x, w, scale, block)
    e, n = w.shape[:2]
    m = x.shape[0] if rows is None else rows.numel()
    assert rows is None or (rows.dim() == 1 and not rows.is_floating_point() and rows.is_contiguous()), rows
    assert out_rows is None or (out_rows.shape == (m,) and not out_rows.is_floating_point()
                                and out_rows.is_contiguous()), out_rows
    assert block_n >= 16, block_n  # (a tl.dot operand's dimensions)
    assert offsets.shape == (e + 1,) and offsets.dtype in (torch.int32, torch.int64), (
        offsets.shape, offsets.dtype)
    assert bias is None or (bias.shape == (e, n) and bias.dtype == x.dtype and bias.stride(1) == 1), (
        None if bias is None else (bias.shape, bias.dtype, bias.stride()))
    assert act is None or (n % 2 == 0 and block_n % 2 == 0), (act, n, block_n)
    y = torch.empty(m, n if act is None else n // 2, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_k = _block_k(min(block_k, max(16, triton.next_power_of_2(k))), fp8)  # (tl.dot wants K tiles of 16 or more)
    pairs = _grouped_pairs(x, fp8)
    _moe_matmul_grouped_kernel[(triton.cdiv(n, block_n), e)](
        x, w, offsets.contiguous(), y, s, n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0), sse, ssn, ssk,
        BLOCK_M=block_m or grouped_block_m(m, e, fp8["MXFP4"]), BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_STAGES=num_stages, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0, IEEE=x.dtype == torch.float32,
        num_warps=num_warps,
        PAIRS=pairs, HAS_BIAS=bias is not None, b_ptr=bias if bias is not None else y,
        stride_be=0 if bias is None else bias.stride(0), GATHER=rows is not None,
        rows_ptr=rows if rows is not None else offsets, SCATTER=out_rows is not None,
        out_rows_ptr=out_rows if out_rows is not None else offsets, **fp8,
        ACT=-1 if act is None else act, LIBDEVICE=_LIBDEVICE_MATH, alpha=float(alpha), limit=float(limit or 0.0),
        FOLD=bool(fold) and pairs != PAIRS_OFF,  # (the bf16 pairs' alone: no other form compiles a variant for it)
    )
    return y


def _grouped_pairs(x: torch.Tensor, fmt: dict) -> int:
    """The grouped kernel's PAIRS: the bf16 pairs decode for MXFP4 weights and bf16 activations under the
    moe_mxfp4_dot_pairs knob (its bf16 products are the weights' exact values in bf16 alone), interpreted off CUDA."""
    if not (fmt["MXFP4"] and x.dtype == torch.bfloat16 and settings.tuning.moe_mxfp4_dot_pairs):
        return PAIRS_OFF
    return PAIRS_ON if x.is_cuda else PAIRS_INTERPRETED


@triton.jit
def _mxfp4_run_part(w_ptr, s_ptr, row, bcols, b_ok, run_ok, group, x_lo, x_hi, stride_wn, stride_sn, stride_sk,
                    EVEN_K: tl.constexpr, DECODE: tl.constexpr = 0):
    """One W row's [RUNS] partial sums, MXFP4: each run is 16 bytes (32 codes, one E8M0 scale) of the row at the byte
    columns `bcols` [RUNS, 16] against the activations' even and odd columns x_lo, x_hi (float32, the same layout),
    in the bits decode (_mxfp4_bits_part) or the pairs decode (DECODE 4: _mxfp4_pairs_part), times the run's
    2^(s - 127)."""
    w_row = w_ptr + row.to(tl.int64) * stride_wn + bcols
    if EVEN_K:
        b = tl.load(w_row).to(tl.int32)
    else:
        b = tl.load(w_row, mask=b_ok, other=0).to(tl.int32)
    part = _mxfp4_pairs_part(b, x_lo, x_hi) if DECODE == 4 else _mxfp4_bits_part(b, x_lo, x_hi)
    return _times_run_scales(part, s_ptr, row, group, run_ok, stride_sn, stride_sk, EVEN_K)


@triton.jit
def _mxfp4_bits_part(b, x_lo, x_hi):
    """The bits decode's run sums: bytes b (int32 [..., 16], a byte's low nibble the even element) against x's even
    and odd columns (float32) -> the sums over the last axis. Each code's sign and magnitude bits go to a float32's
    sign and exponent / mantissa bits (_e2m1), times 2^126."""
    lo = (((b & 8) << 28) | ((b & 7) << 22)).to(tl.float32, bitcast=True) * 8.507059173023462e37
    hi = (((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True) * 8.507059173023462e37
    return tl.sum(lo * x_lo + hi * x_hi, axis=-1)


@triton.jit
def _times_run_scales(part, s_ptr, row, group, run_ok, stride_sn, stride_sk, EVEN_K: tl.constexpr):
    """A W row's [RUNS] partial sums times their runs' E8M0 scales (_e8m0)."""
    s_row = s_ptr + row.to(tl.int64) * stride_sn + group * stride_sk
    if EVEN_K:
        s = tl.load(s_row).to(tl.int32)
    else:
        s = tl.load(s_row, mask=run_ok, other=127).to(tl.int32)
    return part * _e8m0(s)


@triton.jit
def _mxfp4_step(x_row, k0, K, RUNS: tl.constexpr, EVEN_K: tl.constexpr):
    """The row tiles' step at column k0: RUNS runs of 32 columns -> their byte columns [RUNS, 16] (W's bytes, and
    the activation row's int32 pairs), the masks of those and of the runs, each run's scale group, and the row's
    even and odd columns in float32 (x_row: a bf16 row viewed as int32, the even element in the low half)."""
    starts = k0 + tl.arange(0, RUNS) * 32
    bcols = (starts // 2)[:, None] + tl.arange(0, 16)[None, :]
    b_ok = bcols < K // 2
    if EVEN_K:
        v = tl.load(x_row + bcols)
    else:
        v = tl.load(x_row + bcols, mask=b_ok, other=0)
    return (bcols, b_ok, starts < K, starts // 32, (v << 16).to(tl.float32, bitcast=True),
            (v & -65536).to(tl.float32, bitcast=True))


# 2^63: x is multiplied by it once a step in the "words" decode, and each run's sum by it again (_mxfp4_word_part)
_TWO63 = tl.constexpr(9.223372036854775808e18)

# The "e4m3" decode (the moe_mxfp4_decode knob), per int32 word of 8 E2M1 codes (nibble k of the word: code k, the
# low nibble of a byte first): each code's bits become an E4M3 byte whose value is the code's times 2^-6 exactly
# (sign to bit 7, e1 e0 m to bits 4 3 2: exponent e against E4M3's bias 7, and 0 / 0.5 as E4M3 subnormals), four
# bytes to a register by a few whole-word operations; sm_89+'s cvt.rn.f16x2.e4m3x2 turns two at a time into halves
# (exact), then each to float32. Outputs: the 8 codes' values times 2^-6 in nibble order.
_E2M1_AS_E4M3 = tl.constexpr("""{
.reg .b32 lo, hi, t;
.reg .b16 l0, l1, h0, h1;
.reg .b32 f0, f1, f2, f3;
.reg .f16 a0, a1, a2, a3, a4, a5, a6, a7;
and.b32 t, $8, 0x07070707;
shl.b32 lo, t, 2;
and.b32 t, $8, 0x08080808;
shl.b32 t, t, 4;
or.b32 lo, lo, t;
shr.b32 t, $8, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 hi, $8, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 f0, l0;
cvt.rn.f16x2.e4m3x2 f1, l1;
cvt.rn.f16x2.e4m3x2 f2, h0;
cvt.rn.f16x2.e4m3x2 f3, h1;
mov.b32 {a0, a2}, f0;
mov.b32 {a4, a6}, f1;
mov.b32 {a1, a3}, f2;
mov.b32 {a5, a7}, f3;
cvt.f32.f16 $0, a0;
cvt.f32.f16 $1, a1;
cvt.f32.f16 $2, a2;
cvt.f32.f16 $3, a3;
cvt.f32.f16 $4, a4;
cvt.f32.f16 $5, a5;
cvt.f32.f16 $6, a6;
cvt.f32.f16 $7, a7;
}""")
# The decode forms of the MXFP4 row tiles (the kernels' DECODE): codes from bytes times 2^126 (the default), from
# int32 words with x times 2^63, from int32 words through E4M3 on the GPU, and that one's values from the words' float32
# bits times 2^120 where the interpreter runs the kernels (no inline PTX there; the same values); a byte's two codes
# at once by two multiplies (the bf16 pairs' placement, _mxfp4_pairs_part) with x times 2^63; and two forms of the
# gate|up columns kernel and the down choices kernel only that sum each thread's products as chains of fused
# multiply-adds: pairs' decode (_mxfp4_chain_part) and int32 words' codes by a mask, a multiply and a mask each
# (_word_chain, _mxfp4_word_tile), the latter extracting no byte (on sm_90 with Triton 3.6, words-fma's gate|up loop issues 0.175 warp
# instructions a weight against pairs' 0.207, its down 0.171 on 4 warps against 0.214: tools/sass_loop_mix.py).
DECODES = {"bits": 0, "words": 1, "e4m3": 2, "pairs": 4, "pairs-fma": 5, "words-fma": 6}
DECODE_E4M3_INTERPRETED = 3
# (the forms the gate|up columns kernel and the down choices kernel take; the FMA ones no other)
TILE_DECODES = (DECODES["bits"], DECODES["pairs"], DECODES["pairs-fma"], DECODES["words-fma"])
FMA_DECODES = (DECODES["pairs-fma"], DECODES["words-fma"])


@triton.jit
def _mxfp4_word_step(x_row, k0, K, RUNS: tl.constexpr, EVEN_K: tl.constexpr, PRESCALE: tl.constexpr):
    """The row tiles' step at column k0 in the word decodes: RUNS runs of 32 columns -> W's int32 word columns
    [RUNS, 4] (8 codes a word) and their mask, the runs' mask and scale groups, and the x row's columns 8 j + i
    (i = 0..7) of each word j as 8 float32 tiles [RUNS, 4] (times 2^63 with PRESCALE: exact)."""
    starts = k0 + tl.arange(0, RUNS) * 32
    # (j * 4 // 4: the same offsets, but the compiler no longer sees 4 contiguous words a run and lays W's tile out as
    # the strided x tiles below; with W's words vectorized Triton 3.6 moved every product through shared memory (one
    # warp: shuffles), 16 barriers a step: benchmarks/s80/README.md)
    wcols = (starts // 8)[:, None] + (tl.arange(0, 4) * 4 // 4)[None, :]
    w_ok = wcols < K // 8
    pairs = (starts // 2)[:, None] + tl.arange(0, 4)[None, :] * 4  # (x's int32 pairs: word j's first pair)
    if EVEN_K:
        v0, v1, v2, v3 = (tl.load(x_row + pairs), tl.load(x_row + pairs + 1), tl.load(x_row + pairs + 2),
                          tl.load(x_row + pairs + 3))
    else:
        v0, v1, v2, v3 = (tl.load(x_row + pairs, mask=w_ok, other=0), tl.load(x_row + pairs + 1, mask=w_ok, other=0),
                          tl.load(x_row + pairs + 2, mask=w_ok, other=0),
                          tl.load(x_row + pairs + 3, mask=w_ok, other=0))
    f = _TWO63 if PRESCALE else 1.0
    return (wcols, w_ok, starts < K, starts // 32,
            (v0 << 16).to(tl.float32, bitcast=True) * f, (v0 & -65536).to(tl.float32, bitcast=True) * f,
            (v1 << 16).to(tl.float32, bitcast=True) * f, (v1 & -65536).to(tl.float32, bitcast=True) * f,
            (v2 << 16).to(tl.float32, bitcast=True) * f, (v2 & -65536).to(tl.float32, bitcast=True) * f,
            (v3 << 16).to(tl.float32, bitcast=True) * f, (v3 & -65536).to(tl.float32, bitcast=True) * f)


@triton.jit
def _word_code(w, SHIFT: tl.constexpr):
    """The float32 bits of the E2M1 code at bits SHIFT .. SHIFT + 3 of int32 words w: its sign to bit 31, its
    magnitude to bits 22-24 (as _mxfp4_run_part's, before the 2^126: the code's value times 2^-126)."""
    if SHIFT <= 28:
        sign = (w << (28 - SHIFT)) & -2147483648
    else:
        sign = (w >> (SHIFT - 28)) & -2147483648
    if SHIFT <= 22:
        mag = (w << (22 - SHIFT)) & 0x01C00000
    else:
        mag = (w >> (SHIFT - 22)) & 0x01C00000
    return (sign | mag).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_word_part(w_ptr, s_ptr, row, wcols, w_ok, run_ok, group, x0, x1, x2, x3, x4, x5, x6, x7, stride_wn,
                     stride_sn, stride_sk, EVEN_K: tl.constexpr, DECODE: tl.constexpr):
    """_mxfp4_run_part in a word decode (DECODE 1-3: DECODES): one W row's [RUNS] partial sums from its int32 words
    (w_ptr: W's bytes viewed as int32, stride_wn in bytes) against x0..x7 (_mxfp4_word_step's). "words": each code's
    float32 bits times x 2^63 is code x x x 2^-63, exactly (while |x| stays within 2^-60 .. 2^64), the run's sum
    times 2^63 again; "e4m3": each code's value times 2^-6 (exact) times x, the run's sum times 2^6. Either way the
    products are _mxfp4_run_part's scaled by a power of two; their float32 sum runs in another order (a word's 8
    codes, then the 4 words, against byte pairs), so it equals _mxfp4_run_part's where the sums are exact."""
    w_row = w_ptr + row.to(tl.int64) * (stride_wn // 4) + wcols
    if EVEN_K:
        w = tl.load(w_row)
    else:
        w = tl.load(w_row, mask=w_ok, other=0)
    if DECODE == 2:
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            _E2M1_AS_E4M3, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        post = 64.0
    else:
        f = 1.0 if DECODE == 1 else 1.329227995784916e36  # (3: times 2^120, the E4M3 form's values)
        c0, c1, c2, c3 = _word_code(w, 0) * f, _word_code(w, 4) * f, _word_code(w, 8) * f, _word_code(w, 12) * f
        c4, c5, c6, c7 = _word_code(w, 16) * f, _word_code(w, 20) * f, _word_code(w, 24) * f, _word_code(w, 28) * f
        post = _TWO63 if DECODE == 1 else 64.0
    acc = c0 * x0
    acc += c1 * x1
    acc += c2 * x2
    acc += c3 * x3
    acc += c4 * x4
    acc += c5 * x5
    acc += c6 * x6
    acc += c7 * x7
    part = tl.sum(acc, axis=1) * post
    return _times_run_scales(part, s_ptr, row, group, run_ok, stride_sn, stride_sk, EVEN_K)


@triton.jit
def _mxfp4_pairs_part(b, x_lo, x_hi):
    """The "pairs" decode's run sums: bytes b (int32 [..., 16]) against x's even and odd columns times 2^63 (x_lo,
    x_hi, float32) -> the sums over the last axis, as the bits decode's before the scales. Two multiplies place a
    byte's two codes in one int32 as bf16 bits (_mxfp4_pair_bits: each code's value times 2^-126), its halves are
    float32 by one shift and one mask, and the products with x times 2^63 are code x x x 2^-63, exact
    while |x| lies within 2^-62 .. 2^65 (no multiply by 2^126 a code, as bits takes); the sums times 2^63 are then
    the bits decode's bit for bit: the same products scaled by a power of two, summed in the same order. Less
    integer work a code than bits' (on sm_90 the integer pipe, at half the issue rate, binds the bits loop)."""
    lo, hi = _mxfp4_pair_halves(b)
    return tl.sum(lo * x_lo + hi * x_hi, axis=-1) * _TWO63


@triton.jit
def _eighths(t):
    """t [A, B, 16] -> 8 tensors [A, B, 2]: leaf i holds elements i and i + 8 (i = 0..7 in the order returned: 0, 4,
    2, 6, 1, 5, 3, 7), split from the last axis three times (a thread's contiguous elements stay in the thread)."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    ev, od = tl.split(tl.reshape(t, [A, B, 8, 2]))
    e0, e1 = tl.split(tl.reshape(ev, [A, B, 4, 2]))
    o0, o1 = tl.split(tl.reshape(od, [A, B, 4, 2]))
    a0, a1 = tl.split(tl.reshape(e0, [A, B, 2, 2]))
    a2, a3 = tl.split(tl.reshape(e1, [A, B, 2, 2]))
    a4, a5 = tl.split(tl.reshape(o0, [A, B, 2, 2]))
    a6, a7 = tl.split(tl.reshape(o1, [A, B, 2, 2]))
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _chain2(acc, b, x_lo, x_hi):
    """acc + the products of one leaf's bytes b (int32 [A, B, 2]) with x's even and odd columns, as two fused
    multiply-adds a byte."""
    lo, hi = _mxfp4_pair_halves(b)
    return tl.fma(hi, x_hi, tl.fma(lo, x_lo, acc))


@triton.jit
def _mxfp4_chain_part(b, x_lo, x_hi):
    """The "chain" decode's run sums: _mxfp4_pairs_part's decode and products (x times 2^63), each thread's products
    summed as a chain of fused multiply-adds (two a byte, where pairs takes a multiply, a fused multiply-add and an
    add) and the chain's two halves added last: the same products, summed in another order."""
    b0, b1, b2, b3, b4, b5, b6, b7 = _eighths(b)
    l0, l1, l2, l3, l4, l5, l6, l7 = _eighths(tl.broadcast_to(x_lo, b.shape))
    h0, h1, h2, h3, h4, h5, h6, h7 = _eighths(tl.broadcast_to(x_hi, b.shape))
    lo, hi = _mxfp4_pair_halves(b0)
    acc = tl.fma(hi, h0, lo * l0)
    acc = _chain2(acc, b1, l1, h1)
    acc = _chain2(acc, b2, l2, h2)
    acc = _chain2(acc, b3, l3, h3)
    acc = _chain2(acc, b4, l4, h4)
    acc = _chain2(acc, b5, l5, h5)
    acc = _chain2(acc, b6, l6, h6)
    acc = _chain2(acc, b7, l7, h7)
    return tl.sum(acc, axis=-1) * _TWO63


@triton.jit
def _quarters(t):
    """t [A, B, 16] -> 4 tensors [A, B, 4]: piece i holds elements 4 j + i (j = 0..3), in the order i = 0, 2, 1, 3."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    ev, od = tl.split(tl.reshape(t, [A, B, 4, 2, 2]))
    q0, q2 = tl.split(ev)
    q1, q3 = tl.split(od)
    return q0, q2, q1, q3


@triton.jit
def _code_bits(w, MASK: tl.constexpr, MUL: tl.constexpr):
    """The float32 bits (value times 2^-126) of the E2M1 code at MASK's nibble of int32 words w, moved by one
    multiply: MUL = 2^a + 2^b puts its magnitude bits at 22-24 and its sign at 31 without overlap."""
    return ((w & MASK) * MUL) & -2118123520  # (0x81C00000)


@triton.jit
def _word_chain(w, xl0, xh0, xl1, xh1, xl2, xh2, xl3, xh3):
    """Run sums from int32 words w [A, B, 4] (word j: bytes 4 j .. 4 j + 3 of the run) against x's columns: xl_i,
    xh_i the even and odd columns of each word's byte i (x's pair 4 j + i, times 2^63, float32): each code's float32
    bits by a mask, a multiply and a mask (the top byte's by shifts), two fused multiply-adds a byte; the products
    of the pairs decode, summed in another order."""
    acc = _code_bits(w, 0xF, 0x10400000).to(tl.float32, bitcast=True) * xl0
    acc = tl.fma(_code_bits(w, 0xF0, 0x01040000).to(tl.float32, bitcast=True), xh0, acc)
    acc = tl.fma(_code_bits(w, 0xF00, 0x00104000).to(tl.float32, bitcast=True), xl1, acc)
    acc = tl.fma(_code_bits(w, 0xF000, 0x00010400).to(tl.float32, bitcast=True), xh1, acc)
    acc = tl.fma(_code_bits(w, 0xF0000, 0x00001040).to(tl.float32, bitcast=True), xl2, acc)
    acc = tl.fma(_code_bits(w, 0xF00000, 0x00000104).to(tl.float32, bitcast=True), xh2, acc)
    lo3 = (((w << 4) >> 6) & -2118123520).to(tl.float32, bitcast=True)  # (arithmetic shift: the sign stays at 31)
    hi3 = ((w >> 6) & -2118123520).to(tl.float32, bitcast=True)
    acc = tl.fma(lo3, xl3, acc)
    acc = tl.fma(hi3, xh3, acc)
    return tl.sum(acc, axis=-1) * _TWO63


@triton.jit
def _x_pair_halves(v):
    """bf16 pairs v (int32) -> (the even elements, the odd ones) in float32 times 2^63."""
    return (v << 16).to(tl.float32, bitcast=True) * _TWO63, (v & -65536).to(tl.float32, bitcast=True) * _TWO63


@triton.jit
def _mxfp4_word_tile(w_rows, s_rows, wcols, w_ok, run_ok, s_cols, xl0, xh0, xl1, xh1, xl2, xh2, xl3, xh3,
                     MASKED: tl.constexpr):
    """_mxfp4_tile_part in the words chain with x's columns as per-byte tiles (_word_chain's)."""
    wr = w_rows.to(tl.pointer_type(tl.int32))
    if MASKED:
        w = tl.load(wr + wcols, mask=w_ok, other=0)
        s = tl.load(s_rows + s_cols, mask=run_ok, other=127).to(tl.int32)
    else:
        w = tl.load(wr + wcols)
        s = tl.load(s_rows + s_cols).to(tl.int32)
    return _word_chain(w, xl0, xh0, xl1, xh1, xl2, xh2, xl3, xh3) * _e8m0(s)


@triton.jit
def _mxfp4_row_step(x_row, k0, K, RUNS: tl.constexpr, EVEN_K: tl.constexpr, DECODE: tl.constexpr):
    """The row tiles' step at column k0 in the decode form DECODE (DECODES): _mxfp4_step's tuple, or
    _mxfp4_word_step's for the word forms; _mxfp4_row_part takes it."""
    if DECODE == 0:
        return _mxfp4_step(x_row, k0, K, RUNS, EVEN_K)
    elif DECODE == 6:
        bcols, b_ok, run_ok, group, x_lo, x_hi = _mxfp4_step(x_row, k0, K, RUNS, EVEN_K)
        starts = k0 + tl.arange(0, RUNS) * 32
        wcols = (starts // 8)[:, None] + tl.arange(0, 4)[None, :]
        return wcols, wcols < K // 8, run_ok, group, x_lo * _TWO63, x_hi * _TWO63
    elif DECODE >= 4:
        bcols, b_ok, run_ok, group, x_lo, x_hi = _mxfp4_step(x_row, k0, K, RUNS, EVEN_K)
        return bcols, b_ok, run_ok, group, x_lo * _TWO63, x_hi * _TWO63
    else:
        return _mxfp4_word_step(x_row, k0, K, RUNS, EVEN_K, DECODE == 1)


@triton.jit
def _mxfp4_row_part(w_ptr, s_ptr, row, step, stride_wn, stride_sn, stride_sk, EVEN_K: tl.constexpr,
                    DECODE: tl.constexpr):
    """One W row's [RUNS] partial sums of a step (_mxfp4_row_step's) in the decode form DECODE: _mxfp4_run_part, or
    _mxfp4_word_part on W viewed as int32 words (an expert's rows are K / 2 bytes, K a multiple of 32: whole words)."""
    if DECODE == 0 or DECODE == 4:
        bcols, b_ok, run_ok, group, x_lo, x_hi = step
        return _mxfp4_run_part(w_ptr, s_ptr, row, bcols, b_ok, run_ok, group, x_lo, x_hi, stride_wn, stride_sn,
                               stride_sk, EVEN_K, DECODE)
    else:
        wcols, w_ok, run_ok, group, x0, x1, x2, x3, x4, x5, x6, x7 = step
        return _mxfp4_word_part(w_ptr.to(tl.pointer_type(tl.int32)), s_ptr, row, wcols, w_ok, run_ok, group, x0, x1,
                                x2, x3, x4, x5, x6, x7, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)


@triton.jit
def _mxfp4_gate_up_row_tiles_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, rw_ptr, N, K, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
    stride_sk, stride_be, stride_ym, alpha, limit, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, RUNS: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
    HAS_BIAS: tl.constexpr, DECODE: tl.constexpr = 0,
):
    """MXFP4 experts' gate|up with the activation at a few tokens, in row tiles (fp8_linear_triton's row-tiles GEMV
    for these weights): program (pid, pair p) takes gate and up rows of BLOCK_N / 2 (1 or 2) output columns of
    expert ids[p] and RUNS runs of 32 columns a step, each run's 16 bytes and the x row's 32 values in one thread
    (x, bf16, as int32 pairs: x_ptr is x viewed as int32, the even element in the low half), no lane shuffles in the
    loop.
    The epilogue rounds as the pairs kernel's (each sum to the dtype, then + bias, rounded again); a pair of routing
    weight 0 reads no weight and writes zeros."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pdl_begin(PDL)  # (before the pair's expert id and routing weight: the router's kernel writes them)
    w_ptr, s_ptr, x_ptr, y_ptr, expert, live = expert_pair(ids_ptr, rw_ptr, w_ptr, s_ptr, x_ptr, y_ptr, stride_we,
                                                           stride_se, stride_xm, stride_ym, TOPK)
    half = N // 2
    c0 = pid * (BLOCK_N // 2)
    ok0 = c0 < half
    ok1 = c0 + 1 < half
    g0 = tl.minimum(c0, half - 1)  # (columns past the end read the last one; their outputs are not stored)
    g1 = tl.minimum(c0 + 1, half - 1)
    a_g0 = tl.zeros([RUNS], tl.float32)
    a_u0 = tl.zeros([RUNS], tl.float32)
    a_g1 = tl.zeros([RUNS], tl.float32)
    a_u1 = tl.zeros([RUNS], tl.float32)
    for k0 in tl.range(0, tl.where(live, K, 0), RUNS * 32, num_stages=NUM_STAGES):
        step = _mxfp4_row_step(x_ptr, k0, K, RUNS, EVEN_K, DECODE)
        a_g0 += _mxfp4_row_part(w_ptr, s_ptr, g0, step, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)
        a_u0 += _mxfp4_row_part(w_ptr, s_ptr, g0 + half, step, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)
        if BLOCK_N == 4:
            a_g1 += _mxfp4_row_part(w_ptr, s_ptr, g1, step, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)
            a_u1 += _mxfp4_row_part(w_ptr, s_ptr, g1 + half, step, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)
    b_row = b_ptr + expert * stride_be
    out = _gate_up_out(a_g0, a_u0, b_row, g0, half, live, alpha, limit, DT, ACT, LIBDEVICE, HAS_BIAS)
    tl.store(y_ptr + c0, out.to(DT), mask=ok0)
    if BLOCK_N == 4:
        out = _gate_up_out(a_g1, a_u1, b_row, g1, half, live, alpha, limit, DT, ACT, LIBDEVICE, HAS_BIAS)
        tl.store(y_ptr + c0 + 1, out.to(DT), mask=ok1)


@triton.jit
def _mxfp4_gate_up_cols_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, rw_ptr, N, K, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
    stride_sk, stride_be, stride_ym, alpha, limit, TOPK: tl.constexpr, COLS: tl.constexpr, RUNS: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
    HAS_BIAS: tl.constexpr, DECODE: tl.constexpr = 0,
):
    """_mxfp4_gate_up_row_tiles_kernel (the bits, pairs or FMA decodes: TILE_DECODES) with COLS output columns a
    program, their gate and up rows as tiles [COLS, RUNS, 16] (words-fma: [COLS, RUNS, 4] int32 words; x's step read
    once for 2 COLS rows): fewer, wider programs (gpt-oss-20b's one token: 1,440 x 4 programs of 2 columns fill an
    H100's SMs 1.75 times). The same products, run sums and rounding (the FMA forms: the products summed in another
    order)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pdl_begin(PDL)  # (before the pair's expert id and routing weight: the router's kernel writes them)
    w_ptr, s_ptr, x_ptr, y_ptr, expert, live = expert_pair(ids_ptr, rw_ptr, w_ptr, s_ptr, x_ptr, y_ptr, stride_we,
                                                           stride_se, stride_xm, stride_ym, TOPK)
    half = N // 2
    cols = pid * COLS + tl.arange(0, COLS)
    g = tl.minimum(cols, half - 1).to(tl.int64)  # (columns past the end read the last one; not stored)
    w_gate = (w_ptr + g * stride_wn)[:, None, None]
    w_up = (w_ptr + (g + half) * stride_wn)[:, None, None]
    s_gate = (s_ptr + g * stride_sn)[:, None]
    s_up = (s_ptr + (g + half) * stride_sn)[:, None]
    a_g = tl.zeros([COLS, RUNS], tl.float32)
    a_u = tl.zeros([COLS, RUNS], tl.float32)
    for k0 in tl.range(0, tl.where(live, K, 0), RUNS * 32, num_stages=NUM_STAGES):
        bcols, b_ok, run_ok, group, x_lo, x_hi = _mxfp4_row_step(x_ptr, k0, K, RUNS, EVEN_K, DECODE)
        a_g += _mxfp4_tile_part(w_gate, s_gate, bcols[None, :, :], b_ok[None, :, :], run_ok[None, :],
                                group[None, :] * stride_sk, x_lo[None, :, :], x_hi[None, :, :], not EVEN_K, DECODE)
        a_u += _mxfp4_tile_part(w_up, s_up, bcols[None, :, :], b_ok[None, :, :], run_ok[None, :],
                                group[None, :] * stride_sk, x_lo[None, :, :], x_hi[None, :, :], not EVEN_K, DECODE)
    gate = tl.sum(a_g, axis=1).to(DT).to(tl.float32)
    up = tl.sum(a_u, axis=1).to(DT).to(tl.float32)
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be
        gate = (gate + tl.load(b_row + g).to(tl.float32)).to(DT).to(tl.float32)
        up = (up + tl.load(b_row + g + half).to(tl.float32)).to(DT).to(tl.float32)
    out = tl.where(live, gated_pair(gate, up, ACT, LIBDEVICE, DT, alpha, limit), 0.0)
    tl.store(y_ptr + cols, out.to(DT), mask=cols < half)


@triton.jit
def _mxfp4_tile_part(w_rows, s_rows, bcols, b_ok, run_ok, s_cols, x_lo, x_hi, MASKED: tl.constexpr,
                     DECODE: tl.constexpr):
    """_mxfp4_run_part for a tile of W rows at once: w_rows, s_rows the rows' byte and scale pointers ([R, 1, 1],
    [R, 1]), the step's byte columns (words-fma: word columns [.., RUNS, 4]), masks and scale offsets broadcast
    against them -> [R, RUNS] partial sums times their runs' scales."""
    if DECODE == 6:  # (x's columns split into the words' bytes: _mxfp4_word_tile's)
        shape: tl.constexpr = [w_rows.shape[0], bcols.shape[1], 16]  # (x broadcast over the rows, as W's tile)
        xl0, xl2, xl1, xl3 = _quarters(tl.broadcast_to(x_lo, shape))
        xh0, xh2, xh1, xh3 = _quarters(tl.broadcast_to(x_hi, shape))
        result = _mxfp4_word_tile(w_rows, s_rows, bcols, b_ok, run_ok, s_cols, xl0, xh0, xl1, xh1, xl2, xh2, xl3,
                                  xh3, MASKED)
    else:
        if MASKED:
            b = tl.load(w_rows + bcols, mask=b_ok, other=0).to(tl.int32)
            s = tl.load(s_rows + s_cols, mask=run_ok, other=127).to(tl.int32)
        else:
            b = tl.load(w_rows + bcols).to(tl.int32)
            s = tl.load(s_rows + s_cols).to(tl.int32)
        if DECODE == 5:
            part = _mxfp4_chain_part(b, x_lo, x_hi)
        elif DECODE == 4:
            part = _mxfp4_pairs_part(b, x_lo, x_hi)
        else:
            part = _mxfp4_bits_part(b, x_lo, x_hi)
        result = part * _e8m0(s)
    return result


@triton.jit
def _gate_up_out(a_gate, a_up, b_row, col, half, live, alpha, limit, DT: tl.constexpr, ACT: tl.constexpr,
                 LIBDEVICE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """act(gate) * up of one output column from the two rows' [RUNS] partial sums, rounded as the pairs kernel
    rounds (each sum to DT, + its bias, to DT again); 0 for a pair of weight 0."""
    gate = tl.sum(a_gate, axis=0).to(DT).to(tl.float32)
    up = tl.sum(a_up, axis=0).to(DT).to(tl.float32)
    if HAS_BIAS:
        gate = (gate + tl.load(b_row + col).to(tl.float32)).to(DT).to(tl.float32)
        up = (up + tl.load(b_row + col + half).to(tl.float32)).to(DT).to(tl.float32)
    return tl.where(live, gated_pair(gate, up, ACT, LIBDEVICE, DT, alpha, limit), 0.0)


@triton.jit
def _mxfp4_down_row_tiles_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, rw_ptr, N, K, stride_hm, stride_we, stride_wn, stride_se, stride_sn,
    stride_sk, stride_be, stride_ym, TOPK: tl.constexpr, RUNS: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr, DECODE: tl.constexpr = 0,
):
    """MXFP4 experts' down with the routing weights' sum at a few tokens, in row tiles: program (pid, token t) takes
    output columns 4 pid .. 4 pid + 3 and walks t's TOPK choices, each choice's rows in runs of 32 columns (16 bytes,
    one scale) against its h row (bf16 viewed as int32 pairs), as _mxfp4_gate_up_row_tiles_kernel reads them;
    y[t, n] = sum_j rw[j] * (W_j[n] . h_j + b_j[n]) in float32, as the other down kernels sum it. A choice of weight
    0 reads no weight."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    t = tl.program_id(1)
    first = pid * 4
    rows = tl.minimum(first + tl.arange(0, 4), N - 1)  # (columns past the end read the last one; not stored)
    r0 = tl.minimum(first, N - 1)
    r1 = tl.minimum(first + 1, N - 1)
    r2 = tl.minimum(first + 2, N - 1)
    r3 = tl.minimum(first + 3, N - 1)
    total = tl.zeros([4], tl.float32)
    pdl_begin(PDL)
    for j in tl.static_range(TOPK):
        pair = t.to(tl.int64) * TOPK + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(rw_ptr + pair).to(tl.float32)
        w_e = w_ptr + expert * stride_we
        s_e = s_ptr + expert * stride_se
        h_row = h_ptr + pair * stride_hm
        a0 = tl.zeros([RUNS], tl.float32)
        a1 = tl.zeros([RUNS], tl.float32)
        a2 = tl.zeros([RUNS], tl.float32)
        a3 = tl.zeros([RUNS], tl.float32)
        for k0 in tl.range(0, tl.where(weight != 0, K, 0), RUNS * 32, num_stages=NUM_STAGES):
            step = _mxfp4_row_step(h_row, k0, K, RUNS, EVEN_K, DECODE)
            a0 += _mxfp4_row_part(w_e, s_e, r0, step, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)
            a1 += _mxfp4_row_part(w_e, s_e, r1, step, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)
            a2 += _mxfp4_row_part(w_e, s_e, r2, step, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)
            a3 += _mxfp4_row_part(w_e, s_e, r3, step, stride_wn, stride_sn, stride_sk, EVEN_K, DECODE)
        c = tl.arange(0, 4)
        acc = tl.where(c == 0, tl.sum(a0, axis=0), tl.where(c == 1, tl.sum(a1, axis=0), tl.where(
            c == 2, tl.sum(a2, axis=0), tl.sum(a3, axis=0))))
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert * stride_be + rows).to(tl.float32)
        total += weight * acc
    cols = first + tl.arange(0, 4)
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + cols, total.to(DT), mask=cols < N)


@triton.jit
def _mxfp4_down_choices_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, rw_ptr, N, K, stride_hm, stride_we, stride_wn, stride_se, stride_sn,
    stride_sk, stride_be, stride_ym, pf_ptr, pf_parts, pf_part, pf_last, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    RUNS: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr,
    DECODE: tl.constexpr = 0, PREFETCH: tl.constexpr = False,
):
    """_mxfp4_down_choices; with PREFETCH, each program of token 0 first asks the L2 for its part of the bytes at
    pf_ptr (l2_prefetch_triton: the next layer's first weight, while this kernel's instruction issue, not its bytes,
    bounds it)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    if PREFETCH:  # noqa: SIM102 (a compile-time branch: the kernel without it has no prefetch code)
        if t == 0:
            done = l2_prefetch_part(pf_ptr, pid, pf_parts, pf_part, pf_last)
            # (a store its result guards, which never happens (it is 0): the prefetch is kept, not thrown away)
            tl.store(y_ptr + tl.arange(0, 1), done.to(y_ptr.dtype.element_ty), mask=done != 0)
    _mxfp4_down_choices(h_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, rw_ptr, N, K, stride_hm, stride_we, stride_wn,
                        stride_se, stride_sn, stride_sk, stride_be, stride_ym, pid, t, TOPK, TOPK_P2, RUNS,
                        NUM_STAGES, EVEN_K, PDL, HAS_BIAS, DECODE)


@triton.jit
def _mxfp4_down_choices(
    h_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, rw_ptr, N, K, stride_hm, stride_we, stride_wn, stride_se, stride_sn,
    stride_sk, stride_be, stride_ym, pid, t, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, RUNS: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr, DECODE: tl.constexpr,
):
    """_mxfp4_down_row_tiles_kernel (the bits, pairs or FMA decodes: TILE_DECODES) for program pid of token t, with
    its TOPK choices side by side in each tile ([TOPK_P2, RUNS, 16] bytes a row a step) rather than one after
    another: every choice's loads of a step are in flight at once, and a program has TOPK_P2 times the warps (at one
    token the one-after-another kernel had 16 % achieved occupancy on an H100 and waited on memory: BENCHMARKS.md
    7.3). The same products and run sums (up to the order of the lanes' reduction); the choices' sums are then taken
    out and added in choice order, as that kernel adds them."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    first = pid * 4
    c = tl.arange(0, 4)
    rows = tl.minimum(first + c, N - 1)  # (columns past the end read the last one; not stored)
    r0 = tl.minimum(first, N - 1)
    r1 = tl.minimum(first + 1, N - 1)
    r2 = tl.minimum(first + 2, N - 1)
    r3 = tl.minimum(first + 3, N - 1)
    pdl_begin(PDL)
    j = tl.arange(0, TOPK_P2)
    j_ok = j < TOPK
    pair = t.to(tl.int64) * TOPK + j
    expert = tl.load(ids_ptr + pair, mask=j_ok, other=0).to(tl.int64)
    weight = tl.load(rw_ptr + pair, mask=j_ok, other=0).to(tl.float32)
    live = weight != 0  # (a choice of weight 0, or past TOPK, reads no weight)
    w_e = (w_ptr + expert * stride_we)[:, None, None]
    s_e = (s_ptr + expert * stride_se)[:, None]
    h_rows = (h_ptr + pair * stride_hm)[:, None, None]
    a0 = tl.zeros([TOPK_P2, RUNS], tl.float32)
    a1 = tl.zeros([TOPK_P2, RUNS], tl.float32)
    a2 = tl.zeros([TOPK_P2, RUNS], tl.float32)
    a3 = tl.zeros([TOPK_P2, RUNS], tl.float32)
    for k0 in tl.range(0, K, RUNS * 32, num_stages=NUM_STAGES):
        starts = k0 + tl.arange(0, RUNS) * 32
        run_ok = live[:, None] if EVEN_K else live[:, None] & (starts < K)[None, :]  # (tl.load broadcasts a mask)
        group = (starts // 32)[None, :]
        if DECODE == 6:  # (W as int32 words, x's pairs loaded as one tile per byte of a word)
            # (j * 4 // 4: Triton no longer sees a run's 4 words as contiguous and gives W's tile the layout of x's
            # strided tiles; vectorized, each x tile moved through shared memory to W's: 16 barriers a step on 4 warps)
            wcols = ((starts // 8)[:, None] + (tl.arange(0, 4) * 4 // 4)[None, :])[None, :, :]
            w_ok = live[:, None, None] if EVEN_K else live[:, None, None] & (wcols < K // 8)
            xp = h_rows + wcols * 4
            xl0, xh0 = _x_pair_halves(tl.load(xp, mask=w_ok, other=0))
            xl1, xh1 = _x_pair_halves(tl.load(xp + 1, mask=w_ok, other=0))
            xl2, xh2 = _x_pair_halves(tl.load(xp + 2, mask=w_ok, other=0))
            xl3, xh3 = _x_pair_halves(tl.load(xp + 3, mask=w_ok, other=0))
            a0 += _mxfp4_word_tile(w_e + r0.to(tl.int64) * stride_wn, s_e + r0.to(tl.int64) * stride_sn, wcols, w_ok,
                                   run_ok, group * stride_sk, xl0, xh0, xl1, xh1, xl2, xh2, xl3, xh3, True)
            a1 += _mxfp4_word_tile(w_e + r1.to(tl.int64) * stride_wn, s_e + r1.to(tl.int64) * stride_sn, wcols, w_ok,
                                   run_ok, group * stride_sk, xl0, xh0, xl1, xh1, xl2, xh2, xl3, xh3, True)
            a2 += _mxfp4_word_tile(w_e + r2.to(tl.int64) * stride_wn, s_e + r2.to(tl.int64) * stride_sn, wcols, w_ok,
                                   run_ok, group * stride_sk, xl0, xh0, xl1, xh1, xl2, xh2, xl3, xh3, True)
            a3 += _mxfp4_word_tile(w_e + r3.to(tl.int64) * stride_wn, s_e + r3.to(tl.int64) * stride_sn, wcols, w_ok,
                                   run_ok, group * stride_sk, xl0, xh0, xl1, xh1, xl2, xh2, xl3, xh3, True)
        else:
            bcols = ((starts // 2)[:, None] + tl.arange(0, 16)[None, :])[None, :, :]
            b_ok = live[:, None, None] if EVEN_K else live[:, None, None] & (bcols < K // 2)
            v = tl.load(h_rows + bcols, mask=b_ok, other=0)
            x_lo = (v << 16).to(tl.float32, bitcast=True)
            x_hi = (v & -65536).to(tl.float32, bitcast=True)
            if DECODE >= 4:
                x_lo *= _TWO63
                x_hi *= _TWO63
            a0 += _mxfp4_tile_part(w_e + r0.to(tl.int64) * stride_wn, s_e + r0.to(tl.int64) * stride_sn, bcols,
                                   b_ok, run_ok, group * stride_sk, x_lo, x_hi, True, DECODE)
            a1 += _mxfp4_tile_part(w_e + r1.to(tl.int64) * stride_wn, s_e + r1.to(tl.int64) * stride_sn, bcols,
                                   b_ok, run_ok, group * stride_sk, x_lo, x_hi, True, DECODE)
            a2 += _mxfp4_tile_part(w_e + r2.to(tl.int64) * stride_wn, s_e + r2.to(tl.int64) * stride_sn, bcols,
                                   b_ok, run_ok, group * stride_sk, x_lo, x_hi, True, DECODE)
            a3 += _mxfp4_tile_part(w_e + r3.to(tl.int64) * stride_wn, s_e + r3.to(tl.int64) * stride_sn, bcols,
                                   b_ok, run_ok, group * stride_sk, x_lo, x_hi, True, DECODE)
    cc = c[None, :]
    acc = tl.where(cc == 0, tl.sum(a0, axis=1)[:, None], tl.where(cc == 1, tl.sum(a1, axis=1)[:, None], tl.where(
        cc == 2, tl.sum(a2, axis=1)[:, None], tl.sum(a3, axis=1)[:, None])))  # [TOPK_P2, 4]
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert[:, None] * stride_be + rows[None, :], mask=j_ok[:, None], other=0).to(tl.float32)
    total = tl.zeros([4], tl.float32)
    for i in tl.static_range(TOPK):  # (in choice order; the sums over one nonzero element are exact)
        total += tl.sum(tl.where(j == i, weight, 0.0), axis=0) * tl.sum(tl.where(j[:, None] == i, acc, 0.0), axis=0)
    cols = first + c
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + cols, total.to(DT), mask=cols < N)


def mxfp4_row_runs(k: int, knob: int | None = None) -> tuple[int, int]:
    """(runs of 32 columns a step, warps) of the MXFP4 row tiles over k columns: the moe_mxfp4_row_runs knob
    (None: its setting), or for 0 the step of 16, 32 or 64 runs that pads the fewest runs (the larger on a tie).
    Warps = runs / 16, so that a thread takes 8 bytes of a row a step: the loop a thread issues is then the same
    at every step size, and what a step size changes is the padded runs it issues it for."""
    if knob is None:
        knob = settings.tuning.moe_mxfp4_row_runs
    if knob == 0:
        runs_total = -(-k // 32)
        knob = min((64, 32, 16), key=lambda r: (-(-runs_total // r) * r, -r))
    return knob, knob // 16


@functools.lru_cache(maxsize=8)
def parse_row_steps(text: str) -> dict[str, tuple[int, int, str, int]]:
    """The `moe_mxfp4_row_steps` tuning knob ("gate_up:16:1:e4m3;down:64:2:bits:4", either part) as (runs, stages,
    decode, warps: 0 for the kernel's own) by kernel; a ConfigError naming the part that is not
    KERNEL:RUNS:STAGES:DECODE[:WARPS]."""
    steps: dict[str, tuple[int, int, str, int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = [f.strip() for f in part.split(":")]
        if (len(fields) not in (4, 5) or fields[0] not in ("gate_up", "down")
                or fields[1] not in ("0", "16", "32", "64", "128") or fields[2] not in ("1", "2", "3")
                or fields[3] not in DECODES or (len(fields) == 5 and fields[4] not in ("1", "2", "4", "8", "16"))):
            raise ConfigError(f"tuning moe_mxfp4_row_steps: {part!r} is not KERNEL:RUNS:STAGES:DECODE[:WARPS] with "
                              f"KERNEL gate_up or down, RUNS 0 (the step that pads least), 16, 32, 64 or 128, STAGES "
                              f"1-3, DECODE {', '.join(DECODES)} and WARPS 1, 2, 4, 8 or 16 (a program's warps in the "
                              f"gate|up columns and down choices kernels; e.g. down:64:2:bits or down:0:1:words-fma:4)")
        steps[fields[0]] = (int(fields[1]), int(fields[2]), fields[3], int(fields[4]) if len(fields) == 5 else 0)
    return steps


def mxfp4_row_config(kernel: str, k: int) -> tuple[int, int, int, str]:
    """(runs of 32 columns a step, warps, stages, decode form) of the MXFP4 row tiles' `kernel` (gate_up or down)
    over k columns: the moe_mxfp4_row_steps knob's entry for it, else the moe_mxfp4_row_runs knob's step, one
    stage and the moe_mxfp4_decode knob's form. (Warps: a run row's; the columns and choices kernels multiply them
    by their columns / 2 and choices unless mxfp4_program_warps sets a program's.)"""
    entry = parse_row_steps(settings.tuning.moe_mxfp4_row_steps).get(kernel)
    if entry is None:
        return (*mxfp4_row_runs(k), 1, settings.tuning.moe_mxfp4_decode)
    runs, stages, decode, _ = entry
    return (*mxfp4_row_runs(k, runs), stages, decode)


def mxfp4_program_warps(kernel: str, default: int) -> int:
    """A program's warps in the gate|up columns or down choices kernel: moe_mxfp4_row_steps' WARPS for `kernel`, else
    `default`."""
    entry = parse_row_steps(settings.tuning.moe_mxfp4_row_steps).get(kernel)
    return entry[3] if entry is not None and entry[3] else default


def _mxfp4_decode(w: torch.Tensor, name: str) -> int:
    """The row tiles' DECODE for the decode form `name` (DECODES; the E4M3 form's interpreted one off CUDA). The word
    decodes read W's bytes as int32 words: its rows and experts must start on whole words."""
    decode = DECODES[name]
    assert decode in (DECODES["bits"], DECODES["pairs"], DECODES["pairs-fma"]) or (
        w.data_ptr() % 4 == 0 and w.stride(0) % 4 == 0 and w.stride(1) % 4 == 0), (w.data_ptr(), w.stride())
    if decode == DECODES["e4m3"] and not w.is_cuda:
        return DECODE_E4M3_INTERPRETED
    if decode == DECODES["e4m3"] and not e4m3_capable(w.device):
        raise ConfigError(f"the e4m3 MXFP4 decode (--tuning moe_mxfp4_decode or moe_mxfp4_row_steps) needs a GPU of "
                          f"compute capability 8.9 or newer (its E4M3 conversion); this one is "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability(w.device)))}: use bits or words")
    return decode


def _mxfp4_down_row_tiles(h, w2, ids, weights, bias, scale, num_stages: int | None = None,
                          prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """moe_pairs_down_combine for MXFP4 w2 (uint8 [E, N, K / 2], E8M0 scales [E, N, K / 32]) through
    _mxfp4_down_row_tiles_kernel: h [T * k, K] bf16 (viewed as int32 pairs); runs of 32 columns a step, warps,
    stages (unless given) and decode form by mxfp4_row_config. prefetch: a weight the choices kernel asks the L2 for
    (its first bytes, l2_prefetch_triton) on CUDA sm_90+."""
    t, k = ids.shape
    e, n, half_k = w2.shape
    kk = 2 * half_k
    runs, num_warps, stages, decode_name = mxfp4_row_config("down", kk)
    num_stages = num_stages or stages
    assert h.dtype == torch.bfloat16 and h.stride(1) == 1 and h.shape == (t * k, kk) and kk % 32 == 0
    assert scale.dtype == torch.uint8 and tuple(scale.shape) == (e, n, kk // 32)
    decode = _mxfp4_decode(w2, decode_name)
    h32 = (h if h.stride(0) % 2 == 0 and h.storage_offset() % 2 == 0 else h.contiguous()).view(torch.int32)
    y = torch.empty(t, n, dtype=h.dtype, device=h.device)
    if t == 0:
        return y
    if decode in FMA_DECODES and not settings.tuning.moe_mxfp4_down_choices:
        raise ConfigError(f"the {decode_name} MXFP4 decode runs in the down choices kernel: leave "
                          f"moe_mxfp4_down_choices on, or choose bits, words, e4m3 or pairs for down")
    if decode in TILE_DECODES and settings.tuning.moe_mxfp4_down_choices:
        topk_p2 = triton.next_power_of_2(k)
        pf = l2_prefetch_args(prefetch, triton.cdiv(n, 4), y)
        _mxfp4_down_choices_kernel[(triton.cdiv(n, 4), t)](
            h32, w2, scale, bias if bias is not None else y, y, ids.reshape(-1).contiguous(),
            weights.reshape(-1).contiguous(), n, kk, h32.stride(0), w2.stride(0), w2.stride(1), scale.stride(0),
            scale.stride(1), scale.stride(2), 0 if bias is None else bias.stride(0), y.stride(0), **pf, TOPK=k,
            TOPK_P2=topk_p2, RUNS=runs, NUM_STAGES=num_stages, EVEN_K=kk % (32 * runs) == 0,
            HAS_BIAS=bias is not None, DECODE=decode,
            num_warps=mxfp4_program_warps("down", min(16, num_warps * topk_p2)),
            **launch_options(h.device, moe=True),
        )
        return y
    _mxfp4_down_row_tiles_kernel[(triton.cdiv(n, 4), t)](
        h32, w2, scale, bias if bias is not None else y, y, ids.reshape(-1).contiguous(),
        weights.reshape(-1).contiguous(), n, kk, h32.stride(0), w2.stride(0), w2.stride(1), scale.stride(0),
        scale.stride(1), scale.stride(2), 0 if bias is None else bias.stride(0), y.stride(0), TOPK=k, RUNS=runs,
        NUM_STAGES=num_stages, EVEN_K=kk % (32 * runs) == 0, HAS_BIAS=bias is not None,
        DECODE=decode, num_warps=num_warps, **launch_options(h.device, moe=True),
    )
    return y


def _mxfp4_gate_up_row_tiles(x, w13, ids, weights, act, scale, bias, alpha, limit, block_n: int = 4,
                             num_stages: int | None = None) -> torch.Tensor:
    """moe_pairs_gate_up_act for MXFP4 w13 (uint8 [E, 2I, K / 2], E8M0 scales [E, 2I, K / 32]) through
    _mxfp4_gate_up_row_tiles_kernel: x [T, K] bf16 (viewed as int32 pairs: a bf16 is the top half of its float32);
    runs of 32 columns a step, warps, stages (unless given) and decode form by mxfp4_row_config."""
    t, k = ids.shape
    e, n, half_k = w13.shape
    kk = 2 * half_k
    runs, num_warps, stages, decode_name = mxfp4_row_config("gate_up", kk)
    num_stages = num_stages or stages
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.shape == (t, kk) and kk % 32 == 0
    assert scale.dtype == torch.uint8 and tuple(scale.shape) == (e, n, kk // 32) and block_n in (2, 4) and n % 2 == 0
    decode = _mxfp4_decode(w13, decode_name)
    x32 = (x if x.stride(0) % 2 == 0 and x.storage_offset() % 2 == 0 else x.contiguous()).view(torch.int32)
    y = torch.empty(t * k, n // 2, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    cols = settings.tuning.moe_mxfp4_gate_up_cols
    if decode in FMA_DECODES and not cols:
        raise ConfigError(f"the {decode_name} MXFP4 decode runs in the gate|up columns kernel: set "
                          f"moe_mxfp4_gate_up_cols to 2, 4 or 8, or choose bits, words, e4m3 or pairs for gate|up")
    if cols and decode in TILE_DECODES:
        _mxfp4_gate_up_cols_kernel[(triton.cdiv(n // 2, cols), t * k)](
            x32, w13, scale, bias if bias is not None else y, y, ids.reshape(-1).contiguous(),
            weights.reshape(-1).contiguous(), n, kk, x32.stride(0), w13.stride(0), w13.stride(1), scale.stride(0),
            scale.stride(1), scale.stride(2), 0 if bias is None else bias.stride(0), y.stride(0), float(alpha),
            float(limit or 0.0), TOPK=k, COLS=cols, RUNS=runs, NUM_STAGES=num_stages, EVEN_K=kk % (32 * runs) == 0,
            ACT=act, LIBDEVICE=_LIBDEVICE_MATH, HAS_BIAS=bias is not None, DECODE=decode,
            num_warps=mxfp4_program_warps("gate_up", min(16, num_warps * cols // 2)),
            **launch_options(x.device, moe=True),
        )
        return y
    _mxfp4_gate_up_row_tiles_kernel[(triton.cdiv(n // 2, block_n // 2), t * k)](
        x32, w13, scale, bias if bias is not None else y, y, ids.reshape(-1).contiguous(),
        weights.reshape(-1).contiguous(), n, kk, x32.stride(0), w13.stride(0), w13.stride(1), scale.stride(0),
        scale.stride(1), scale.stride(2), 0 if bias is None else bias.stride(0), y.stride(0), float(alpha),
        float(limit or 0.0), TOPK=k, BLOCK_N=block_n, RUNS=runs, NUM_STAGES=num_stages, EVEN_K=kk % (32 * runs) == 0,
        ACT=act, LIBDEVICE=_LIBDEVICE_MATH, HAS_BIAS=bias is not None, DECODE=decode,
        num_warps=num_warps, **launch_options(x.device, moe=True),
    )
    return y


def moe_pairs_gate_up_act(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: int,
                          block_n: int = 2 * PAIRS_BLOCK_N, block_k: int | None = None,
                          num_warps: int = PAIRS_NUM_WARPS, num_stages: int = PAIRS_NUM_STAGES,
                          scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                          bias: torch.Tensor | None = None, alpha: float = 1.0,
                          limit: float | None = None, row_tiles: bool | None = None) -> torch.Tensor:
    """x [T, K], w13 [E, 2I, K] ([gate | up] rows), expert ids and routing weights [T, k], act (an ACT_* code of
    fused_ops_triton) -> h [T * k, I] with h[p] = act(gate_e . x[p // k]) * (up_e . x[p // k]), e = ids.flatten()[p],
    in (token, choice) order; rows of pairs with weight 0 are zeros. bias [E, 2I]: added to gate|up first (gpt-oss);
    ACT_CLAMPED_SWIGLU takes alpha and limit, ACT_LIMITED_SILU limit. FP8 w13: its scales per `block`; MXFP4 w13
    (uint8 [E, 2I, K / 2]): its E8M0 scales [E, 2I, K / 32]. row_tiles (None: the moe_row_tiles knob for FP8 w13,
    moe_mxfp4_row_tiles for MXFP4): FP8 w13
    without bias through the row-tiles GEMV (fp8_linear_triton.fp8_experts_gate_up_row_tiles: float32 weights, runs
    of 16 columns summed in each thread) where its layout fits; MXFP4 w13 with bf16 activations through
    _mxfp4_gate_up_row_tiles_kernel (runs of 32 columns, one scale each)."""
    from atlas.kernels import fp8_linear_triton as kt
    from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU

    assert (limit is not None) == (act in (ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU)), (act, limit)
    if gate_up_takes_row_tiles(x, w13, block, act, bias, row_tiles):
        if w13.dtype == torch.uint8:
            return _mxfp4_gate_up_row_tiles(x, w13, ids, weights, act, scale, bias, alpha, limit, ROW_TILES_BLOCK_N)
        return kt.fp8_experts_gate_up_row_tiles(x, w13, scale, block, ids, weights, act, alpha, limit,
                                                ROW_TILES_BLOCK_N)
    return _gate_up_pairs(x, w13, ids, weights, None, act, block_n, block_k, num_warps, num_stages, scale, block, bias,
                          alpha, limit)


def gate_up_takes_row_tiles(x: torch.Tensor, w13: torch.Tensor, block: tuple[int, int] | None, act: int,
                            bias: torch.Tensor | None, row_tiles: bool | None = None) -> bool:
    """Whether moe_pairs_gate_up_act takes a row-tiles kernel for these operands (FP8 or MXFP4 w13, its knob) rather
    than _moe_gate_up_act_kernel."""
    from atlas.kernels import fp8_linear_triton as kt

    if row_tiles is None:
        row_tiles = settings.tuning.moe_mxfp4_row_tiles if w13.dtype == torch.uint8 else settings.tuning.moe_row_tiles
    if (row_tiles and w13.dtype == torch.float8_e4m3fn and bias is None and x.stride(1) == 1
            and kt.fp8_gemv_row_tiles_fits(block, ROW_TILES_BLOCK_N, act)):
        return True
    return bool(row_tiles and w13.dtype == torch.uint8 and x.dtype == torch.bfloat16 and x.stride(1) == 1
                and w13.stride(2) == 1)


def moe_pairs_routed_gate_up_act(x: torch.Tensor, w13: torch.Tensor, routing: Routing, act: int,
                                 block_n: int = 2 * PAIRS_BLOCK_N, block_k: int | None = None,
                                 num_warps: int = PAIRS_NUM_WARPS, num_stages: int = PAIRS_NUM_STAGES,
                                 scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                                 bias: torch.Tensor | None = None, alpha: float = 1.0, limit: float | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_pairs_gate_up_act's h with the router's choice made in the same kernel (routing: the logits and
    select_topk's arguments; each program chooses its pair's expert, one launch fewer than select_topk then this) ->
    (h [T * k, I], routing weights [T, k] float32, expert ids [T, k] int64): what select_topk gives, for
    moe_pairs_down_combine. _moe_gate_up_act_kernel only (not the row tiles: gate_up_takes_row_tiles says)."""
    t, k = routing.logits.shape[0], routing.top_k
    assert x.shape[0] == t and routing.logits.shape[1] <= MAX_RANKED_EXPERTS, (x.shape, routing.logits.shape)
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    h = _gate_up_pairs(x, w13, ids, weights, routing, act, block_n, block_k, num_warps, num_stages, scale, block,
                       bias, alpha, limit)
    return h, weights, ids


def _gate_up_pairs(x, w13, ids, weights, routing, act, block_n, block_k, num_warps, num_stages, scale, block, bias,
                   alpha, limit) -> torch.Tensor:
    """_moe_gate_up_act_kernel's launch; ids and weights [T, k] its input, or with routing its output."""
    (s, sse, ssn, ssk), fp8, kk = _check(x, w13, scale, block)
    t, k = ids.shape
    n = w13.shape[1]
    assert n % 2 == 0 and block_n % 2 == 0 and x.shape[0] == t and weights.shape == ids.shape, (
        n, block_n, x.shape, ids.shape, weights.shape)
    assert routing is None or (ids.is_contiguous() and weights.is_contiguous() and weights.dtype == torch.float32), (
        ids.stride(), weights.stride(), weights.dtype)  # (outputs: written in place)
    y = torch.empty(t * k, n // 2, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    block_k = _block_k(min(_pairs_block_k(block_k, fp8), triton.next_power_of_2(kk)), fp8)
    if bias is not None:
        assert bias.shape == (w13.shape[0], n) and bias.stride(1) == 1, (bias.shape, w13.shape)
    if routing is None:
        route_args, route = (x, x, 0, 0, 1.0, 0.0, 0.0), dict(
            ROUTE=False, ROUTE_E=1, SCORING=0, ROUTE_BIAS=False, NORM=False, ROUND=False)
    else:
        c = routing.constexprs()
        route_args, route = routing.args(), dict(
            ROUTE=True, ROUTE_E=c["BLOCK_E"], SCORING=c["SCORING"], ROUTE_BIAS=c["HAS_BIAS"],
            NORM=c["NORM"], ROUND=c["ROUND"])
    _moe_gate_up_act_kernel[(triton.cdiv(n // 2, block_n // 2), t * k)](
        x, w13, ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous(), y, s, y if bias is None else bias,
        n, kk, x.stride(0), w13.stride(0), w13.stride(1), y.stride(0), sse, ssn, ssk,
        0 if bias is None else bias.stride(0), float(alpha), float(limit or 0.0), *route_args,
        TOPK=k, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, EVEN_N=(n // 2) % (block_n // 2) == 0,
        EVEN_K=kk % block_k == 0, ACT=act, LIBDEVICE=_LIBDEVICE_MATH, num_warps=num_warps, **fp8,
        HAS_BIAS=bias is not None, **route, **launch_options(x.device, moe=True),
    )
    return y


def moe_pairs_down_combine(h: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           bias: torch.Tensor | None = None, block_n: int = PAIRS_BLOCK_N,
                           block_k: int | None = None, num_warps: int = PAIRS_NUM_WARPS,
                           num_stages: int = PAIRS_NUM_STAGES, scale: torch.Tensor | None = None,
                           block: tuple[int, int] | None = None, rows: bool | None = None,
                           row_tiles: bool | None = None, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """h [T * k, K] in (token, choice) order, w2 [E, N, K], expert ids and routing weights [T, k], bias [E, N] or
    None -> y [T, N] in h's dtype with y[t] = sum_j weights[t, j] * (w2[ids[t, j]] @ h[t k + j] + bias[ids[t, j]]),
    summed in float32; pairs with weight 0 are skipped. FP8 w2: its scales per `block`; MXFP4 w2 (uint8
    [E, N, K / 2]): its E8M0 scales [E, N, K / 32]. rows (None: the moe_down_rows knob): the kernel that loads a
    token's k choices in one tile (block_k then defaults to a tile of DOWN_ROWS_TILE elements); the knob leaves MXFP4
    weights one expert after another. row_tiles (None: the moe_mxfp4_row_tiles knob): MXFP4 w2 with bf16 h through
    _mxfp4_down_row_tiles_kernel. prefetch: a weight to ask the L2 for meanwhile (the MXFP4 choices kernel's; the
    others ignore it)."""
    if row_tiles is None:
        row_tiles = settings.tuning.moe_mxfp4_row_tiles
    if row_tiles and w2.dtype == torch.uint8 and h.dtype == torch.bfloat16 and h.stride(1) == 1 and w2.stride(2) == 1:
        return _mxfp4_down_row_tiles(h, w2, ids, weights, bias, scale, prefetch=prefetch)
    (s, sse, ssn, ssk), fp8, kk = _check(h, w2, scale, block)
    t, k = ids.shape
    n = w2.shape[1]
    assert h.shape[0] == t * k and weights.shape == ids.shape, (h.shape, ids.shape, weights.shape)
    assert bias is None or (bias.shape == w2.shape[:2] and bias.stride(1) == 1), None if bias is None else bias.shape
    y = torch.empty(t, n, dtype=h.dtype, device=h.device)
    if t == 0:
        return y
    if rows is None:  # (MXFP4's rows kernel timed at twice the one-expert-at-a-time kernel: BENCHMARKS.md 7.3)
        rows = settings.tuning.moe_down_rows and not fp8["MXFP4"]
    if rows:
        return _down_combine_rows(h, w2, ids, weights, bias, y, (s, sse, ssn, ssk), fp8, kk, block_n, block_k,
                                  num_warps, num_stages)
    block_k = _block_k(min(_pairs_block_k(block_k, fp8), triton.next_power_of_2(kk)), fp8)
    _moe_down_combine_kernel[(triton.cdiv(n, block_n), t)](
        h, w2, ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous(), bias if bias is not None else h, y, s,
        n, kk, h.stride(0), w2.stride(0), w2.stride(1), bias.stride(0) if bias is not None else 0, y.stride(0),
        sse, ssn, ssk, TOPK=k, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, EVEN_N=n % block_n == 0,
        EVEN_K=kk % block_k == 0, HAS_BIAS=bias is not None, num_warps=num_warps, **fp8,
        **launch_options(h.device, moe=True),
    )
    return y


# The rows kernel's tile: k_p2 * block_n rows x block_k columns of this many elements (4 warps: 64 a thread).
DOWN_ROWS_TILE = 8192


def _down_combine_rows(h, w2, ids, weights, bias, y, scales, fmt, kk, block_n, block_k, num_warps, num_stages):
    """moe_pairs_down_combine through _moe_down_combine_rows_kernel."""
    s, sse, ssn, ssk = scales
    t, k = ids.shape
    n = w2.shape[1]
    k_p2 = triton.next_power_of_2(k)
    scale_rows = 0
    if fmt["FP8"] or fmt["MXFP4"]:
        assert ssn > 0 and sse % ssn == 0, (sse, ssn)  # (the scales' experts stacked row on row)
        scale_rows = sse // ssn
    if block_k is None:
        block_k = max(32, DOWN_ROWS_TILE // (k_p2 * block_n))
    block_k = _block_k(min(block_k, max(32, triton.next_power_of_2(kk))), fmt)
    _moe_down_combine_rows_kernel[(triton.cdiv(n, block_n), t)](
        h, w2, ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous(), bias if bias is not None else h, y, s,
        n, kk, h.stride(0), w2.stride(0), w2.stride(1), bias.stride(0) if bias is not None else 0, y.stride(0),
        scale_rows, ssn, ssk, TOPK=k, TOPK_P2=k_p2, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        EVEN_K=kk % block_k == 0, HAS_BIAS=bias is not None, num_warps=num_warps, **fmt,
        **launch_options(h.device, moe=True),
    )
    return y

