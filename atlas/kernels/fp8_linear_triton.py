"""Triton kernels for linear layers whose weights are FP8 (float8_e4m3fn) with float32 scales (kernels/fp8_linear.py
dispatches and holds the references).

The scale of weight element (n, k) is at s_ptr + (n // GROUP_N) * stride_sn + (k // GROUP_K) * stride_sk: the block
layout is GROUP_N x GROUP_K = bn x bk with stride_sk = 1; the channel layout is GROUP_N = 1 with stride_sk = 0 (one
scale per row, GROUP_K then only sizes the tiles).

- `_fp8_gemv_kernel`, one to 8 rows (decode, memory-bound): a program takes BLOCK_N rows of W and streams them
  in [BLOCK_N, KB, GROUP_K] tiles (KB scale groups along K per step), products with the rows in float32 on the
  CUDA cores, each scale group's partial sums scaled once by its scale: W is read once, at one byte per weight.
  It takes a gated activation as its epilogue (gate|up), like the bf16 GEMV (kernels/gemv_triton.py).
- `_fp8_gemv_row_tiles_kernel`, one to 4 rows: the same products, each of the program's BLOCK_N (1, 2 or 4) W
  rows a [RUNS, 16] tile of its own in the layout of the x tiles, so that a thread converts each x value to
  float32 once for all its W rows, each weight once for all the x rows, and sums each run of 16 columns (inside
  one scale group) itself: no lane shuffles in the loop, one scale multiply a run. (In the 3-D tiles above the W
  rows sit on different lanes: on sm_90 that costs ~7 instructions a weight at one row, x converted again for
  each, against ~4 here: a GEMV is issue-bound at 1 byte a weight, where bf16's is not; tools/sass_loop_mix.py.)
  Also FP8 routed experts' gate|up at a few tokens (PAIRS, kernels/moe_triton.py).
- `_fp8_w8a16_kernel`, a few rows (up to fp8_linear.SMALL_M): each [BLOCK_N, BLOCK_K] tile of W (inside one
  scale group) scaled and rounded to the activations' dtype in registers, then tl.dot with the rows (padded to
  BLOCK_M), float32 accumulation: the reference's dequantized weight, on the tensor cores.
- `_fp8_block_gemm_kernel`, many rows (prefill) of a block-scaled weight: W8A8. The activations come quantized per
  1 x GROUP_K tile (fp8_linear.quantize_rows), each BLOCK_K = GROUP_K step is one FP8 tl.dot whose float32
  result is scaled by the rows' activation scales and the columns' weight scales and accumulated.
- `_quantize_groups_kernel` / `_quantize_rows_kernel`: the W8A8 paths' activation quantization in one kernel each
  (per 1 x group tile, its scales row-major or M-major for cuBLASLt; per row, dynamic, capped or static), the same
  values and scales as fp8_linear.quantize_rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels import settings
from atlas.kernels.fused_ops_triton import (
    _LIBDEVICE_MATH,
    divide_by_scale,
    gated_act,
    gated_pair,
    quantized_rows_buffers,
)
from atlas.kernels.gemv_triton import expert_pair, gate_up_rows
from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin

# Default tiles (kernels/fp8_linear.py's TUNED table picks among configs; these are what a call without one gets).
# GEMV: BLOCK_N rows of W x `cols` columns (KB scale groups of GROUP_K) per step: 8 KiB of W at 4 x 2048.
GEMV_BLOCK_N, GEMV_COLS, GEMV_WARPS, GEMV_STAGES = 4, 2048, 4, 3
ROW_TILES_RUN = 16  # (the row-tiles GEMV's columns a thread sums: one 16-byte load of W)
ROW_TILES_MAX_ROWS = 4  # (activation rows it takes: 4 already issue 4 FMAs a weight, ~the sm_90 issue rate's limit)
W8A16_BLOCK_N, W8A16_BLOCK_K, W8A16_WARPS, W8A16_STAGES = 16, 128, 4, 4
GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_WARPS, GEMM_STAGES, GEMM_GROUP_M = 64, 128, 4, 3, 8
GEMV_MAX_ROWS = 8  # rows the CUDA-core GEMV takes (padded to a power of two: a compiled variant each)


def _scale_geometry(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                    group_k: int) -> tuple[int, int, int, int]:
    """(GROUP_N, GROUP_K, stride_sn, stride_sk) of the scales (module docstring)."""
    if block is None:
        assert scale.numel() == weight.shape[0] and scale.dtype == torch.float32
        return 1, group_k, 1, 0
    assert scale.dim() == 2 and scale.dtype == torch.float32 and scale.stride(1) == 1
    return block[0], block[1], scale.stride(0), 1


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                     stride_ym, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, KB: tl.constexpr, NUM_STAGES: tl.constexpr, CHANNEL: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """The CUDA-core GEMV. Each step multiplies a [BLOCK_N, KB, GROUP_K] tile of W (in float32) with the ROWS rows
    of x and sums along the groups: a [ROWS, BLOCK_N, KB] partial per scale group, scaled by the KB scales of each
    W row (loaded once a group, not a weight) and accumulated. CHANNEL (one scale per W row): the partials are
    summed unscaled and the row's scale is applied once at the end. ACT >= 0 (fused_ops_triton's ACT_* codes): W
    is [gate | up] (N = 2 I rows) and y = act(x gate^T) * (x up^T) [M, I], the program's BLOCK_N rows being
    BLOCK_N / 2 columns of each half, interleaved, rounded as this GEMV followed by the activation kernel (the
    bf16 GEMV's epilogue, kernels/gemv_triton.py)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    w_ids, n_ok = gate_up_rows(pid, N, BLOCK_N, ACT)
    offs_m = tl.arange(0, ROWS)
    m_ok = offs_m < M
    kb = tl.arange(0, KB)
    g = tl.arange(0, GROUP_K)
    w_rows = w_ptr + w_ids.to(tl.int64)[:, None, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None, None] * stride_xm
    s_rows = s_ptr + (w_ids // GROUP_N).to(tl.int64)[:, None] * stride_sn
    groups = tl.cdiv(K, GROUP_K)
    pdl_begin(PDL)
    if ROWS == 1:
        # One row in 3-D tiles: the 4-D form below with a row axis of 1 compiles (sm_90) to 452 warp shuffles and
        # W staged through shared memory byte by byte against 28 shuffles here, and ran batch-1 decode ~3x slower.
        acc1 = tl.zeros([BLOCK_N], tl.float32)
        for k0 in tl.range(0, K, KB * GROUP_K, num_stages=NUM_STAGES):
            cols = k0 + kb[:, None] * GROUP_K + g[None, :]  # [KB, GROUP_K]
            k_ok = cols < K
            w = tl.load(w_rows + cols[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
            part = tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)  # [BLOCK_N, KB]
            if CHANNEL:
                acc1 += tl.sum(part, axis=1)
            else:
                gi = k0 // GROUP_K + kb
                s = tl.load(s_rows + gi[None, :] * stride_sk, mask=n_ok[:, None] & (gi < groups)[None, :], other=0.0)
                acc1 += tl.sum(part * s, axis=1)
        acc = acc1[None, :]
    else:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for k0 in tl.range(0, K, KB * GROUP_K, num_stages=NUM_STAGES):
            cols = k0 + kb[:, None] * GROUP_K + g[None, :]  # [KB, GROUP_K]
            k_ok = cols < K
            w = tl.load(w_rows + cols[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0)
            x = tl.load(x_rows + cols[None, :, :], mask=m_ok[:, None, None] & k_ok[None, :, :], other=0.0)
            part = tl.sum(w.to(tl.float32)[None, :, :, :] * x.to(tl.float32)[:, None, :, :], axis=3)  # [ROWS, BN, KB]
            if CHANNEL:
                acc += tl.sum(part, axis=2)
            else:
                gi = k0 // GROUP_K + kb
                s = tl.load(s_rows + gi[None, :] * stride_sk, mask=n_ok[:, None] & (gi < groups)[None, :], other=0.0)
                acc += tl.sum(part * s[None, :, :], axis=2)
    if CHANNEL:
        acc *= tl.load(s_ptr + w_ids, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_ids, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT >= 0:
        gate, up = tl.split(tl.reshape(acc.to(DT).to(tl.float32), [ROWS, BLOCK_N // 2, 2]))
        out = gated_act(gate, ACT, LIBDEVICE).to(DT).to(tl.float32) * up
        cols_out = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols_out[None, :]
        tl.store(y, out.to(DT), mask=m_ok[:, None] & (cols_out < N // 2)[None, :])
    else:
        y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + w_ids[None, :]
        tl.store(y, acc.to(DT), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _fp8_gemv_xs_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                        stride_ym, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, CHANNEL: tl.constexpr,
                        HAS_BIAS: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, LIBDEVICE: tl.constexpr,
                        PDL: tl.constexpr):
    """The CUDA-core GEMV with the scale on the activations ("xs"): a program's BLOCK_N W rows lie in one scale block
    and each [BLOCK_N, BLOCK_K] step inside one scale group (BLOCK_K divides GROUP_K), so the step's scale is one
    number per W half, multiplied into the ROWS x BLOCK_K activations instead of into every weight; products are
    accumulated elementwise in a [ROWS, BLOCK_N, BLOCK_K] float32 tile and reduced once at the end (the "sum"
    kernel's per-group reductions, one warp-shuffle tree per row, scale group and output, were most of its time).
    CHANNEL: the row's scale applied once at the end. ACT >= 0: W is [gate | up] (N = 2 I rows); the program's
    BLOCK_N columns of each half are two tiles with their own scales and act(x gate^T) * (x up^T) is the
    epilogue, rounded as this GEMV followed by the activation kernel."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_out = N // 2 if ACT >= 0 else N
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < n_out
    offs_m = tl.arange(0, ROWS)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_a = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    w_b = w_ptr + (cols + n_out).to(tl.int64)[:, None] * stride_wn
    s_a = s_ptr + ((pid * BLOCK_N) // GROUP_N).to(tl.int64) * stride_sn
    s_b = s_ptr + ((pid * BLOCK_N + n_out) // GROUP_N).to(tl.int64) * stride_sn
    acc_a = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    acc_b = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    pdl_begin(PDL)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            wa = tl.load(w_a + k[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        else:
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            wa = tl.load(w_a + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if CHANNEL:
            xa = x
        else:
            xa = x * tl.load(s_a + (k0 // GROUP_K) * stride_sk)
        acc_a += wa[None, :, :] * xa[:, None, :]
        if ACT >= 0:
            if EVEN_K:
                wb = tl.load(w_b + k[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            else:
                wb = tl.load(w_b + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            if CHANNEL:
                xb = x
            else:
                xb = x * tl.load(s_b + (k0 // GROUP_K) * stride_sk)
            acc_b += wb[None, :, :] * xb[:, None, :]
    ya = tl.sum(acc_a, axis=2)
    if CHANNEL:
        ya *= tl.load(s_ptr + cols, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        ya += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    if ACT >= 0:
        yb = tl.sum(acc_b, axis=2)
        if CHANNEL:
            yb *= tl.load(s_ptr + n_out + cols, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            yb += tl.load(b_ptr + n_out + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = gated_act(ya.to(DT).to(tl.float32), ACT, LIBDEVICE).to(DT).to(tl.float32) * yb.to(DT).to(tl.float32)
        tl.store(y, out.to(DT), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(y, ya.to(DT), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemv_xs_fits(weight: torch.Tensor, block: tuple[int, int] | None, block_n: int, block_k: int,
                     act: int | None = None) -> bool:
    """Whether the "xs" GEMV takes this weight with this tile: per-row scales, or 128 x 128-style blocks whose rows
    hold whole programs (block_n divides the block's rows; gate|up's halves start on a block) and whose groups hold
    whole steps (block_k divides the block's columns)."""
    n = weight.shape[0]
    if act is not None and n % 2:
        return False
    if block is None:
        return True
    half = n // 2 if act is not None else n
    return block[0] % block_n == 0 and block[1] % block_k == 0 and (act is None or half % block[0] == 0)


def fp8_gemv_xs_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                       bias: torch.Tensor | None = None, block_n: int = 16, block_k: int = 128, num_warps: int = 4,
                       num_stages: int = 3, act: int | None = None) -> torch.Tensor:
    """x [M, K] (unit stride, M <= GEMV_MAX_ROWS) @ W8 [N, K]^T with its scales (+ bias) -> [M, N] in x's dtype, by
    the "xs" kernel (fp8_gemv_xs_fits must hold). act (an ACT_* code): W is [gate | up] and the result
    act(x gate^T) * (x up^T) [M, N / 2]."""
    M, K = x.shape
    N = weight.shape[0]
    assert 1 <= M <= GEMV_MAX_ROWS and weight.shape[1] == K and weight.is_contiguous() and x.stride(1) == 1
    assert fp8_gemv_xs_fits(weight, block, block_n, block_k, act), (tuple(weight.shape), block, block_n, block_k)
    group_n, group_k, stride_sn, stride_sk = _scale_geometry(weight, scale, block, block_k)
    n_out = N // 2 if act is not None else N
    y = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    _fp8_gemv_xs_kernel[(triton.cdiv(n_out, block_n),)](
        x, weight, scale, bias if bias is not None else scale, y, M, N, K, x.stride(0), weight.stride(0), stride_sn,
        stride_sk, y.stride(0), GROUP_N=group_n, GROUP_K=group_k, ROWS=triton.next_power_of_2(M), BLOCK_N=block_n,
        BLOCK_K=block_k, NUM_STAGES=num_stages, CHANNEL=block is None, HAS_BIAS=bias is not None,
        ACT=-1 if act is None else act, EVEN_K=K % block_k == 0, LIBDEVICE=_LIBDEVICE_MATH, num_warps=num_warps,
        **launch_options(x.device))
    return y


def fp8_gemv_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                    bias: torch.Tensor | None = None, block_n: int = GEMV_BLOCK_N, cols: int = GEMV_COLS,
                    num_warps: int = GEMV_WARPS, num_stages: int = GEMV_STAGES, act: int | None = None) -> torch.Tensor:
    """x [M, K] (unit stride, M <= GEMV_MAX_ROWS) @ W8 [N, K]^T with its scales (+ bias) -> [M, N] in x's dtype.
    act (an ACT_* code of fused_ops_triton): W is [gate | up] and the result act(x gate^T) * (x up^T) [M, N / 2]."""
    M, K = x.shape
    N = weight.shape[0]
    assert 1 <= M <= GEMV_MAX_ROWS and weight.shape[1] == K and weight.is_contiguous() and x.stride(1) == 1
    assert act is None or (N % 2 == 0 and block_n % 2 == 0), "a gate|up GEMV takes an even N and BLOCK_N"
    group_n, group_k, stride_sn, stride_sk = _scale_geometry(weight, scale, block, 128)
    kb = max(1, cols // group_k)
    assert triton.next_power_of_2(group_k) == group_k and triton.next_power_of_2(kb) == kb, (group_k, kb)
    y = torch.empty(M, N // 2 if act is not None else N, dtype=x.dtype, device=x.device)
    out_cols = block_n // 2 if act is not None else block_n
    _fp8_gemv_kernel[(triton.cdiv(y.shape[1], out_cols),)](
        x, weight, scale, bias if bias is not None else scale, y, M, N, K, x.stride(0), weight.stride(0), stride_sn,
        stride_sk, y.stride(0), GROUP_N=group_n, GROUP_K=group_k, ROWS=triton.next_power_of_2(M), BLOCK_N=block_n,
        KB=kb, NUM_STAGES=num_stages, CHANNEL=block is None, HAS_BIAS=bias is not None,
        ACT=-1 if act is None else act, LIBDEVICE=_LIBDEVICE_MATH, num_warps=num_warps, **launch_options(x.device))
    return y


@triton.jit
def _row_tile_load(w_ptr, s_ptr, row, cols, k_ok, run_ok, run_group, stride_wn, stride_sn, stride_sk,
                   GROUP_N: tl.constexpr, CHANNEL: tl.constexpr, EVEN_K: tl.constexpr):
    """One W row's [RUNS, RUN] tile at the columns `cols`, as stored (FP8), and its runs' [RUNS] scales (1.0 per
    channel: the row's scale comes at the end). `row` is a real row (a program's rows past N read row N - 1, and
    their outputs are not stored)."""
    w_row = w_ptr + row.to(tl.int64) * stride_wn + cols
    if EVEN_K:
        w = tl.load(w_row)
    else:
        w = tl.load(w_row, mask=k_ok, other=0.0)
    if CHANNEL:
        s = 1.0
    else:
        s_row = s_ptr + (row // GROUP_N).to(tl.int64) * stride_sn + run_group * stride_sk
        if EVEN_K:
            s = tl.load(s_row)
        else:
            s = tl.load(s_row, mask=run_ok, other=0.0)
    return w, s


@triton.jit
def _row_tile_sum(w, s, x0, x1, x2, x3, a0, a1, a2, a3, ROWS: tl.constexpr):
    """A W row tile's (from _row_tile_load) [RUNS] partial sums against the activation rows x0 .. x3 (float32, the
    same layout; ROWS of them), each run scaled by its scale, added to a0 .. a3. The weight is widened once for all
    the rows."""
    w = w.to(tl.float32)
    a0 += tl.sum(w * x0, axis=1) * s  # (a run's 16 products, inside one thread)
    if ROWS >= 2:
        a1 += tl.sum(w * x1, axis=1) * s
    if ROWS == 4:
        a2 += tl.sum(w * x2, axis=1) * s
        a3 += tl.sum(w * x3, axis=1) * s
    return a0, a1, a2, a3


@triton.jit
def _row_tile_part(w_ptr, s_ptr, row, cols, k_ok, run_ok, run_group, x0, x1, x2, x3, a0, a1, a2, a3, stride_wn,
                   stride_sn, stride_sk, GROUP_N: tl.constexpr, CHANNEL: tl.constexpr, EVEN_K: tl.constexpr,
                   ROWS: tl.constexpr):
    """One W row's [RUNS] partial sums over the columns `cols` [RUNS, RUN] against the activation rows x0 .. x3,
    added to a0 .. a3: _row_tile_load, then _row_tile_sum."""
    w, s = _row_tile_load(w_ptr, s_ptr, row, cols, k_ok, run_ok, run_group, stride_wn, stride_sn, stride_sk, GROUP_N,
                          CHANNEL, EVEN_K)
    return _row_tile_sum(w, s, x0, x1, x2, x3, a0, a1, a2, a3, ROWS)


@triton.jit
def _row_tile_x(x_row, cols, k_ok, EVEN_K: tl.constexpr):
    """An activation row's [RUNS, RUN] tile at `cols`, in float32."""
    if EVEN_K:
        return tl.load(x_row + cols).to(tl.float32)
    return tl.load(x_row + cols, mask=k_ok, other=0.0).to(tl.float32)


@triton.jit
def _row_tile_xs(x_ptr, x1_ptr, x2_ptr, x3_ptr, cols, k_ok, EVEN_K: tl.constexpr, ROWS: tl.constexpr):
    """The ROWS activation rows' tiles at `cols` (rows past ROWS: the first row's, unused)."""
    x0 = _row_tile_x(x_ptr, cols, k_ok, EVEN_K)
    x1 = x0
    x2 = x0
    x3 = x0
    if ROWS >= 2:
        x1 = _row_tile_x(x1_ptr, cols, k_ok, EVEN_K)
    if ROWS == 4:
        x2 = _row_tile_x(x2_ptr, cols, k_ok, EVEN_K)
        x3 = _row_tile_x(x3_ptr, cols, k_ok, EVEN_K)
    return x0, x1, x2, x3


@triton.jit
def _row_tile_out(acc, s_ptr, b_ptr, row, CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A W row's output (float32) from its [RUNS] partial sums (`row` real, as in _row_tile_part)."""
    y = tl.sum(acc, axis=0)
    if CHANNEL:
        y *= tl.load(s_ptr + row)
    if HAS_BIAS:
        y += tl.load(b_ptr + row).to(tl.float32)
    return y


@triton.jit
def _row_tile_store(y_ptr, stride_ym, col, col_ok, M, s_ptr, b_ptr, row, a0, a1, a2, a3, CHANNEL: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr):
    """Output column `col` of the activation rows 0 .. ROWS - 1 (those below M)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    tl.store(y_ptr + col, _row_tile_out(a0, s_ptr, b_ptr, row, CHANNEL, HAS_BIAS).to(DT), mask=col_ok)
    if ROWS >= 2:
        tl.store(y_ptr + stride_ym + col, _row_tile_out(a1, s_ptr, b_ptr, row, CHANNEL, HAS_BIAS).to(DT),
                 mask=col_ok & (M > 1))
    if ROWS == 4:
        tl.store(y_ptr + 2 * stride_ym + col, _row_tile_out(a2, s_ptr, b_ptr, row, CHANNEL, HAS_BIAS).to(DT),
                 mask=col_ok & (M > 2))
        tl.store(y_ptr + 3 * stride_ym + col, _row_tile_out(a3, s_ptr, b_ptr, row, CHANNEL, HAS_BIAS).to(DT),
                 mask=col_ok & (M > 3))


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _fp8_gemv_row_tiles_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, rw_ptr, M, N, K, stride_wn, stride_sn,
                               stride_sk, stride_xm, stride_ym, stride_we, stride_se, alpha, limit,
                               GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, ROWS: tl.constexpr,
                               BLOCK_N: tl.constexpr, RUNS: tl.constexpr, RUN: tl.constexpr,
                               NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, CHANNEL: tl.constexpr,
                               HAS_BIAS: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
                               PAIRS: tl.constexpr, TOPK: tl.constexpr, PREFETCH: tl.constexpr):
    """The GEMV in row tiles (module docstring) for M <= ROWS activation rows (1, 2 or 4): program pid takes W rows
    r0 .. r3 (BLOCK_N of them) and RUNS x RUN columns a step; each weight is widened once and multiplied with every
    activation row (explicit per-row accumulators: in one tensor with a row axis, Triton's layout gives each thread
    one activation row and widens the weight again for each). ACT >= 0 (one row): W is [gate | up] (N = 2 I rows);
    the program's rows are BLOCK_N / 2 columns of the gate and the same of the up half (r0, r1 = gate and up of
    column c0; r2, r3 of c0 + 1), and it writes act(gate) * up rounded as the GEMV then the activation kernel would
    (the other GEMVs' epilogue; fused_ops_triton.gated_pair, alpha and limit for its clamped forms).

    PAIRS (FP8 routed experts' gate|up at a few tokens, kernels/moe_triton.py; one row, ACT >= 0, no bias):
    program_id(1) is a (token, choice) pair p: W, its scales, x and y are expert ids[p]'s [E, ...] slices (strides
    stride_we, stride_se), x row p // TOPK (stride_xm), y row p (stride_ym); a pair of routing weight 0 reads no
    weight and writes zeros.

    PREFETCH (not with PAIRS, whose W is the router's choice): the first step's W tiles and scales load before the
    PDL wait, while the kernel before still runs (kernels/gemv_triton.py's PREFETCH); the same sums in the same
    order."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    tl.static_assert(not (PREFETCH and PAIRS), "a pair's weights are known only after the router's kernel")
    pid = tl.program_id(0)
    # (rows past the end read the last row: no mask on W's loads; their outputs are not stored)
    if ACT >= 0:
        half = N // 2
        c0 = pid * (BLOCK_N // 2)
        ok0 = c0 < half
        ok2 = c0 + 1 < half
        r0 = tl.minimum(c0, half - 1)
        r1 = r0 + half
        r2 = tl.minimum(c0 + 1, half - 1)
        r3 = r2 + half
    else:
        first = pid * BLOCK_N
        ok0 = first < N
        ok1 = first + 1 < N
        ok2 = first + 2 < N
        ok3 = first + 3 < N
        r0 = tl.minimum(first, N - 1)
        r1 = tl.minimum(first + 1, N - 1)
        r2 = tl.minimum(first + 2, N - 1)
        r3 = tl.minimum(first + 3, N - 1)
    run = tl.arange(0, RUNS)
    j = tl.arange(0, RUN)
    if PREFETCH:  # (the first step's tiles while the kernel before still runs: W is no kernel's output)
        cols_first = (run * RUN)[:, None] + j[None, :]
        k_ok_first = cols_first < K
        run_ok_first = run * RUN < K
        group_first = (run * RUN) // GROUP_K
        w0, s0 = _row_tile_load(w_ptr, s_ptr, r0, cols_first, k_ok_first, run_ok_first, group_first, stride_wn,
                                stride_sn, stride_sk, GROUP_N, CHANNEL, EVEN_K)
        if BLOCK_N >= 2:
            w1, s1 = _row_tile_load(w_ptr, s_ptr, r1, cols_first, k_ok_first, run_ok_first, group_first, stride_wn,
                                    stride_sn, stride_sk, GROUP_N, CHANNEL, EVEN_K)
        if BLOCK_N == 4:
            w2, s2 = _row_tile_load(w_ptr, s_ptr, r2, cols_first, k_ok_first, run_ok_first, group_first, stride_wn,
                                    stride_sn, stride_sk, GROUP_N, CHANNEL, EVEN_K)
            w3, s3 = _row_tile_load(w_ptr, s_ptr, r3, cols_first, k_ok_first, run_ok_first, group_first, stride_wn,
                                    stride_sn, stride_sk, GROUP_N, CHANNEL, EVEN_K)
    pdl_begin(PDL)  # (before the pair's expert id and routing weight: the router's kernel writes them)
    k_end = K
    if PAIRS:
        w_ptr, s_ptr, x_ptr, y_ptr, _, live = expert_pair(ids_ptr, rw_ptr, w_ptr, s_ptr, x_ptr, y_ptr, stride_we,
                                                          stride_se, stride_xm, stride_ym, TOPK)
        k_end = tl.where(live, K, 0)
    # (activation rows past M read row M - 1; their outputs are not stored)
    x1_ptr = x_ptr + tl.minimum(1, M - 1).to(tl.int64) * stride_xm
    x2_ptr = x_ptr + tl.minimum(2, M - 1).to(tl.int64) * stride_xm
    x3_ptr = x_ptr + tl.minimum(3, M - 1).to(tl.int64) * stride_xm
    a00 = tl.zeros([RUNS], tl.float32)
    a01 = tl.zeros([RUNS], tl.float32)
    a02 = tl.zeros([RUNS], tl.float32)
    a03 = tl.zeros([RUNS], tl.float32)
    a10 = tl.zeros([RUNS], tl.float32)
    a11 = tl.zeros([RUNS], tl.float32)
    a12 = tl.zeros([RUNS], tl.float32)
    a13 = tl.zeros([RUNS], tl.float32)
    a20 = tl.zeros([RUNS], tl.float32)
    a21 = tl.zeros([RUNS], tl.float32)
    a22 = tl.zeros([RUNS], tl.float32)
    a23 = tl.zeros([RUNS], tl.float32)
    a30 = tl.zeros([RUNS], tl.float32)
    a31 = tl.zeros([RUNS], tl.float32)
    a32 = tl.zeros([RUNS], tl.float32)
    a33 = tl.zeros([RUNS], tl.float32)
    if PREFETCH:  # (the first step, its W tiles loaded above)
        x0, x1, x2, x3 = _row_tile_xs(x_ptr, x1_ptr, x2_ptr, x3_ptr, cols_first, k_ok_first, EVEN_K, ROWS)
        a00, a01, a02, a03 = _row_tile_sum(w0, s0, x0, x1, x2, x3, a00, a01, a02, a03, ROWS)
        if BLOCK_N >= 2:
            a10, a11, a12, a13 = _row_tile_sum(w1, s1, x0, x1, x2, x3, a10, a11, a12, a13, ROWS)
        if BLOCK_N == 4:
            a20, a21, a22, a23 = _row_tile_sum(w2, s2, x0, x1, x2, x3, a20, a21, a22, a23, ROWS)
            a30, a31, a32, a33 = _row_tile_sum(w3, s3, x0, x1, x2, x3, a30, a31, a32, a33, ROWS)
    for k0 in tl.range(RUNS * RUN if PREFETCH else 0, k_end, RUNS * RUN, num_stages=NUM_STAGES):
        starts = k0 + run * RUN
        cols = starts[:, None] + j[None, :]  # [RUNS, RUN]
        k_ok = cols < K
        run_ok = starts < K
        group = starts // GROUP_K
        x0, x1, x2, x3 = _row_tile_xs(x_ptr, x1_ptr, x2_ptr, x3_ptr, cols, k_ok, EVEN_K, ROWS)
        a00, a01, a02, a03 = _row_tile_part(w_ptr, s_ptr, r0, cols, k_ok, run_ok, group, x0, x1, x2, x3, a00, a01,
                                            a02, a03, stride_wn, stride_sn, stride_sk, GROUP_N, CHANNEL, EVEN_K, ROWS)
        if BLOCK_N >= 2:
            a10, a11, a12, a13 = _row_tile_part(w_ptr, s_ptr, r1, cols, k_ok, run_ok, group, x0, x1, x2, x3, a10,
                                                a11, a12, a13, stride_wn, stride_sn, stride_sk, GROUP_N, CHANNEL,
                                                EVEN_K, ROWS)
        if BLOCK_N == 4:
            a20, a21, a22, a23 = _row_tile_part(w_ptr, s_ptr, r2, cols, k_ok, run_ok, group, x0, x1, x2, x3, a20,
                                                a21, a22, a23, stride_wn, stride_sn, stride_sk, GROUP_N, CHANNEL,
                                                EVEN_K, ROWS)
            a30, a31, a32, a33 = _row_tile_part(w_ptr, s_ptr, r3, cols, k_ok, run_ok, group, x0, x1, x2, x3, a30,
                                                a31, a32, a33, stride_wn, stride_sn, stride_sk, GROUP_N, CHANNEL,
                                                EVEN_K, ROWS)
    if ACT >= 0:
        gate = _row_tile_out(a00, s_ptr, b_ptr, r0, CHANNEL, HAS_BIAS).to(DT).to(tl.float32)
        up = _row_tile_out(a10, s_ptr, b_ptr, r1, CHANNEL, HAS_BIAS).to(DT).to(tl.float32)
        out = gated_pair(gate, up, ACT, LIBDEVICE, DT, alpha, limit)
        if PAIRS:
            out = tl.where(live, out, 0.0)
        tl.store(y_ptr + c0, out.to(DT), mask=ok0)
        if BLOCK_N == 4:
            gate = _row_tile_out(a20, s_ptr, b_ptr, r2, CHANNEL, HAS_BIAS).to(DT).to(tl.float32)
            up = _row_tile_out(a30, s_ptr, b_ptr, r3, CHANNEL, HAS_BIAS).to(DT).to(tl.float32)
            out = gated_pair(gate, up, ACT, LIBDEVICE, DT, alpha, limit)
            if PAIRS:
                out = tl.where(live, out, 0.0)
            tl.store(y_ptr + c0 + 1, out.to(DT), mask=ok2)
    else:
        _row_tile_store(y_ptr, stride_ym, first, ok0, M, s_ptr, b_ptr, r0, a00, a01, a02, a03, CHANNEL, HAS_BIAS,
                        ROWS)
        if BLOCK_N >= 2:
            _row_tile_store(y_ptr, stride_ym, first + 1, ok1, M, s_ptr, b_ptr, r1, a10, a11, a12, a13, CHANNEL,
                            HAS_BIAS, ROWS)
        if BLOCK_N == 4:
            _row_tile_store(y_ptr, stride_ym, first + 2, ok2, M, s_ptr, b_ptr, r2, a20, a21, a22, a23, CHANNEL,
                            HAS_BIAS, ROWS)
            _row_tile_store(y_ptr, stride_ym, first + 3, ok3, M, s_ptr, b_ptr, r3, a30, a31, a32, a33, CHANNEL,
                            HAS_BIAS, ROWS)


def fp8_gemv_row_tiles_fits(block: tuple[int, int] | None, block_n: int, act: int | None = None) -> bool:
    """Whether the row-tiles GEMV takes this layout: each run of ROW_TILES_RUN columns inside one scale block,
    1, 2 or 4 rows a program (2 or 4 with a gated activation)."""
    return (block_n in ((2, 4) if act is not None else (1, 2, 4))
            and (block is None or block[1] % ROW_TILES_RUN == 0))


def fp8_prefetch() -> bool:
    """Whether the FP8 row tiles load their first weights before the PDL wait: the gemv_prefetch knob (every small-M
    GEMV) or fp8_gemv_prefetch (these alone)."""
    return settings.tuning.gemv_prefetch or settings.tuning.fp8_gemv_prefetch


def fp8_gemv_row_tiles_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                              block: tuple[int, int] | None, bias: torch.Tensor | None = None, block_n: int = 4,
                              cols: int = 2048, num_warps: int = 4, num_stages: int = 1,
                              act: int | None = None, prefetch: bool | None = None) -> torch.Tensor:
    """x [M, K] (unit stride, M <= ROW_TILES_MAX_ROWS) @ W8 [N, K]^T with its scales (+ bias) -> [M, N] in x's dtype,
    `cols` columns a step (a power of two, at least ROW_TILES_RUN). act (one row): as fp8_gemv_triton's. prefetch
    (None: the gemv_prefetch or fp8_gemv_prefetch knob): the first step's weights before the PDL wait (the kernel's
    PREFETCH)."""
    M, K = x.shape
    N = weight.shape[0]
    assert 1 <= M <= ROW_TILES_MAX_ROWS and weight.shape[1] == K and weight.is_contiguous() and x.stride(1) == 1
    assert act is None or M == 1, "the gated activation is the one-row kernel's epilogue"
    assert fp8_gemv_row_tiles_fits(block, block_n, act), (block, block_n, act)
    assert act is None or N % 2 == 0, "a gate|up GEMV takes an even N"
    assert cols >= ROW_TILES_RUN and triton.next_power_of_2(cols) == cols, cols
    group_n, group_k, stride_sn, stride_sk = _scale_geometry(weight, scale, block, ROW_TILES_RUN)
    y = torch.empty(M, N // 2 if act is not None else N, dtype=x.dtype, device=x.device)
    out_cols = block_n // 2 if act is not None else block_n
    _fp8_gemv_row_tiles_kernel[(triton.cdiv(y.shape[1], out_cols),)](
        x, weight, scale, bias if bias is not None else scale, y, y, y, M, N, K, weight.stride(0), stride_sn,
        stride_sk, x.stride(0), y.stride(0), 0, 0, 1.0, 0.0, GROUP_N=group_n, GROUP_K=group_k,
        ROWS=triton.next_power_of_2(M), BLOCK_N=block_n, RUNS=cols // ROW_TILES_RUN,
        RUN=ROW_TILES_RUN, NUM_STAGES=num_stages, EVEN_K=K % cols == 0, CHANNEL=block is None,
        HAS_BIAS=bias is not None, ACT=-1 if act is None else act, LIBDEVICE=_LIBDEVICE_MATH, PAIRS=False, TOPK=1,
        PREFETCH=prefetch if prefetch is not None else fp8_prefetch(), num_warps=num_warps,
        **launch_options(x.device))
    return y


def fp8_experts_gate_up_row_tiles(x: torch.Tensor, w13: torch.Tensor, scale: torch.Tensor,
                                  block: tuple[int, int] | None, ids: torch.Tensor, weights: torch.Tensor, act: int,
                                  alpha: float = 1.0, limit: float | None = None, block_n: int = 4,
                                  cols: int = 2048, num_warps: int = 4, num_stages: int = 1) -> torch.Tensor:
    """FP8 routed experts' gate|up with the activation at a few tokens, through the row-tiles GEMV (PAIRS): x [T, K]
    (unit stride), w13 [E, 2I, K] float8_e4m3fn with scales [E, ceil(2I / bn), ceil(K / bk)] (block) or [E, 2I]
    (block None), expert ids and routing weights [T, k] -> h [T * k, I] in (token, choice) order, as
    moe_triton.moe_pairs_gate_up_act computes it (no bias); rows of pairs with weight 0 are zeros."""
    t, k = ids.shape
    e, n, kk = w13.shape
    assert x.dim() == 2 and x.shape == (t, kk) and x.stride(1) == 1 and w13.stride(2) == 1 and n % 2 == 0
    assert fp8_gemv_row_tiles_fits(block, block_n, act) and weights.shape == ids.shape, (block, block_n, act)
    assert cols >= ROW_TILES_RUN and triton.next_power_of_2(cols) == cols, cols
    if block is None:
        assert tuple(scale.shape) == (e, n) and scale.stride(1) == 1, scale.shape
        group_n, group_k, stride_sn, stride_sk = 1, ROW_TILES_RUN, 1, 0
    else:
        assert tuple(scale.shape) == (e, -(-n // block[0]), -(-kk // block[1])), (scale.shape, block)
        group_n, group_k, stride_sn, stride_sk = block[0], block[1], scale.stride(1), scale.stride(2)
    y = torch.empty(t * k, n // 2, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    _fp8_gemv_row_tiles_kernel[(triton.cdiv(n // 2, block_n // 2), t * k)](
        x, w13, scale, scale, y, ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous(), 1, n, kk,
        w13.stride(1), stride_sn, stride_sk, x.stride(0), y.stride(0), w13.stride(0), scale.stride(0), float(alpha),
        float(limit or 0.0), GROUP_N=group_n, GROUP_K=group_k, ROWS=1, BLOCK_N=block_n, RUNS=cols // ROW_TILES_RUN,
        RUN=ROW_TILES_RUN, NUM_STAGES=num_stages, EVEN_K=kk % cols == 0, CHANNEL=block is None, HAS_BIAS=False,
        ACT=act, LIBDEVICE=_LIBDEVICE_MATH, PAIRS=True, TOPK=k, PREFETCH=False, num_warps=num_warps,
        **launch_options(x.device, moe=True))
    return y


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _fp8_w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                      stride_ym, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KB: tl.constexpr, NUM_STAGES: tl.constexpr,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr, PDL: tl.constexpr):
    """KB tiles of BLOCK_K columns (each inside one scale group) a step: KB > 1 keeps more of W in flight for a
    program, where few programs cover N (a 4,096-row weight is 128 programs of 32 rows)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    s_rows = s_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T tile
    pdl_begin(PDL)
    for k0 in tl.range(0, K, BLOCK_K * KB, num_stages=NUM_STAGES):
        for g in tl.static_range(KB):
            k = k0 + g * BLOCK_K + offs_k
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            # (a tile is inside one group)
            s = tl.load(s_rows + ((k0 + g * BLOCK_K) // GROUP_K) * stride_sk, mask=n_ok, other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if F16:  # W8 exact in float16 (one conversion a pair), x in float16, the group's scale after the dot
                xh = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
                acc += tl.dot(w.to(tl.float16), tl.trans(xh)) * s[:, None]
            elif IEEE:
                acc = tl.dot((w.to(tl.float32) * s[:, None]).to(DT), tl.trans(x), acc, input_precision="ieee")
            else:  # (the reference's dequantized weight)
                acc = tl.dot((w.to(tl.float32) * s[:, None]).to(DT), tl.trans(x), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(DT), mask=m_ok[None, :] & n_ok[:, None])


def fp8_w8a16_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                     bias: torch.Tensor | None = None, block_n: int = W8A16_BLOCK_N, block_k: int = W8A16_BLOCK_K,
                     num_warps: int = W8A16_WARPS, num_stages: int = W8A16_STAGES, f16: bool = False) -> torch.Tensor:
    """x [M, K] (unit stride) @ W8 [N, K]^T with its scales (+ bias) -> [M, N] in x's dtype, W dequantized to x's
    dtype tile by tile. (Rows beyond 64 are taken 64 at a time.) block_k: the columns a step, several scale blocks'
    worth of tiles (one dot each) where it is a multiple of the blocks' width. f16 (bf16/fp16 x): instead each
    tile's FP8 values (exact in float16) times x rounded to float16 (|x| beyond 65504 clamped there; bf16 x keeps
    its 8 bits of mantissa) on the tensor cores, the product scaled by the tile's scale group: one conversion a
    weight pair instead of a scaling and two roundings, the reference's rounding of W to bf16 skipped (as the GEMV
    does)."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and weight.is_contiguous() and x.stride(1) == 1
    kb = 1
    if block is not None:
        if block_k > block[1] and block_k % block[1] == 0:  # (a step of several groups: a tile a group)
            kb, block_k = block_k // block[1], block[1]
        block_k = min(block_k, block[1])
        while block[1] % block_k:
            block_k //= 2
    assert block_k >= 16, "a scale block narrower than 16 columns"
    group_n, group_k, stride_sn, stride_sk = _scale_geometry(weight, scale, block, block_k)
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _fp8_w8a16_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
        x, weight, scale, bias if bias is not None else scale, y, M, N, K, x.stride(0), weight.stride(0), stride_sn,
        stride_sk, y.stride(0), GROUP_N=group_n, GROUP_K=group_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        KB=kb, NUM_STAGES=num_stages, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        F16=f16 and x.dtype != torch.float32, num_warps=num_warps, **launch_options(x.device))
    return y


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_asm, stride_ask,
                           stride_wn, stride_wsn, stride_cm, GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr):
    # (programs ordered in groups of GROUP_M row tiles, so that the W tiles they share stay in L2)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    as_rows = as_ptr + offs_m.to(tl.int64) * stride_asm
    ws_rows = ws_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        k = kb * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_rows + kb * stride_ask, mask=m_ok, other=0.0)
        w_s = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_gemm_triton(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype,
                          block_m: int = GEMM_BLOCK_M, block_n: int = GEMM_BLOCK_N, num_warps: int = GEMM_WARPS,
                          num_stages: int = GEMM_STAGES, group_m: int = GEMM_GROUP_M) -> torch.Tensor:
    """a [M, K] FP8 with a_scale [M, ceil(K / bk)] (activations per 1 x bk group, any strides) @ (W8 [N, K] with
    block scales [ceil(N / bn), ceil(K / bk)])^T (+ bias) -> [M, N] in out_dtype."""
    M, K = a.shape
    N = weight.shape[0]
    bn, bk = block
    assert weight.shape[1] == K and weight.is_contiguous() and a.stride(1) == 1
    assert a_scale.shape == (M, triton.cdiv(K, bk)) and scale.shape == (triton.cdiv(N, bn), triton.cdiv(K, bk))
    assert bk >= 16 and triton.next_power_of_2(bk) == bk, f"scale blocks {bk} columns wide"
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _fp8_block_gemm_kernel[grid](
        a, a_scale, weight, scale, bias if bias is not None else scale, c, M, N, K, a.stride(0), a_scale.stride(0),
        a_scale.stride(1), weight.stride(0), scale.stride(0), c.stride(0), GROUP_N=bn, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=bk, GROUP_M=group_m, NUM_STAGES=num_stages, HAS_BIAS=bias is not None, num_warps=num_warps)
    return c


# --------------------------------------------------------------------------------------------------
# Activation quantization for the W8A8 paths (the reference: fp8_linear.quantize_rows)
# --------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "M_PAD", "stride_xm", "stride_qm", "stride_sm", "stride_sg"])
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, M_PAD, K, stride_xm, stride_qm, stride_sm, stride_sg,
                            GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_MAX: tl.constexpr, FMA: tl.constexpr):
    """Row program_id(0) of x, groups program_id(1) * GROUPS ...: each 1 x GROUP group's amax / FP8_MAX (at least
    1e-12 / FP8_MAX) is its scale, its values divided by it (IEEE division, as PyTorch divides; FMA: the same FP8
    values by fused_ops_triton.divide_by_scale's reciprocal form), clamped and rounded to FP8. Rows M .. M_PAD - 1
    (padding for the scales' alignment) get zeros and the smallest scale."""
    row = tl.program_id(0)
    gi = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    k_ok = cols < K
    rows = row + tl.zeros([GROUPS], tl.int32)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=k_ok & (rows < M)[:, None],
                other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), FP8_MAX)  # (IEEE division, as torch's)
    r = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)  # (used with FMA only)
    q = tl.clamp(divide_by_scale(x, scale[:, None], r[:, None], FMA), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + cols, q.to(q_ptr.dtype.element_ty),
             mask=k_ok & (rows < M_PAD)[:, None])
    groups = tl.cdiv(K, GROUP)
    tl.store(s_ptr + row.to(tl.int64) * stride_sm + gi * stride_sg, scale, mask=(gi < groups) & (rows < M_PAD))


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_qm"])
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, M, K, stride_xm, stride_qm, scale_ub,
                          BLOCK: tl.constexpr, STATIC: tl.constexpr, HAS_UB: tl.constexpr, FP8_MAX: tl.constexpr):
    """One row a program: its amax over K (capped at scale_ub with HAS_UB) / FP8_MAX as its scale, or STATIC the
    one scale at in_scale_ptr; the row divided by it, clamped and rounded to FP8."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    if STATIC:
        scale = tl.load(in_scale_ptr)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
        top = tl.max(amax, axis=0)
        if HAS_UB:
            top = tl.minimum(top, scale_ub)
        scale = tl.math.div_rn(tl.maximum(top, 1e-12), FP8_MAX)  # (IEEE division, as torch's)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row.to(tl.int64) * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_groups_triton(x: torch.Tensor, group: int, pad_rows_to: int = 1,
                           m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride) -> (FP8 [M', K], float32 scales [M', ceil(K / group)]) per 1 x group tile, M' = M
    rounded up to pad_rows_to (the padded rows zeros, scale 1e-12 / 448). m_major: the scales stored M-major (strides
    (1, M'): the layout cuBLASLt's 1 x 128 block scaling takes), else row-major. One kernel."""
    from atlas.kernels.fp8_linear import FP8_MAX

    M, K = x.shape
    assert x.stride(1) == 1 and triton.next_power_of_2(group) == group, group
    q, s = quantized_rows_buffers(M, K, group, pad_rows_to, x.device, m_major)
    m_pad, groups = q.shape[0], s.shape[1]
    per_program = max(1, min(triton.next_power_of_2(groups), 4096 // group))  # (~4K elements a program)
    fma = settings.tuning.fp8_quant_fma and x.dtype in (torch.bfloat16, torch.float16)  # (the inputs it is proved for)
    _quantize_groups_kernel[(m_pad, triton.cdiv(groups, per_program))](
        x, q, s, M, m_pad, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1), GROUP=group, GROUPS=per_program,
        FP8_MAX=FP8_MAX, FMA=fma, num_warps=4, enable_fp_fusion=not fma)
    return q, s


def quantize_rows_triton(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                         scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride) -> (FP8 [M, K], float32 scales [M, 1]): per row (amax capped at scale_ub), or the one
    static_scale for every row. One kernel."""
    from atlas.kernels.fp8_linear import FP8, FP8_MAX

    M, K = x.shape
    assert x.stride(1) == 1
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    in_scale = static_scale.to(torch.float32).reshape(1) if static_scale is not None else s
    _quantize_rows_kernel[(M,)](
        x, q, s, in_scale, M, K, x.stride(0), q.stride(0), float(scale_ub) if scale_ub is not None else 0.0,
        BLOCK=min(4096, triton.next_power_of_2(K)), STATIC=static_scale is not None, HAS_UB=scale_ub is not None,
        FP8_MAX=FP8_MAX, num_warps=4)
    return q, s
