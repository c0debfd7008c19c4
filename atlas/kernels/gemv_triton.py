"""Triton GEMV for small batches: y = x @ W^T (+ b) with x [M, K], M <= 16, W [N, K] contiguous.

Decode-time projections read each weight once for one to a few rows, so they are bound by memory
bandwidth. cuBLAS splits K over many thread blocks there and adds a reduction kernel; these kernels
instead give each program BLOCK_N output columns for all M rows and stream its [BLOCK_N, K] slice of W
in BLOCK_K tiles, so there is one kernel per matmul. Two ways to multiply a tile:
- "dot": the rows padded to 16 so the tile product goes through tl.dot (tensor cores, float32
  accumulation), which also lets Triton pipeline the W loads; M is not specialised on;
- "sum": products and a reduction along K in float32 on the CUDA cores (no padding; the rows padded to
  the next power of two, a compiled variant each), the usual GEMV shape of narrow, long tiles.
The reference is F.linear (kernels/gemv.py dispatches, times the variants against cuBLAS, and tests
compare).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from atlas.kernels.fused_ops_triton import _LIBDEVICE_MATH, gated_act
from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin

BLOCK_M = 16  # rows padded to the smallest tl.dot tile


@triton.jit
def _program_tiles(x_ptr, w_ptr, M, N, stride_xm, stride_wn, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """This program's BLOCK_N output columns: offsets, masks and the row pointers of W and of x (ROWS rows)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    return offs_n, offs_m, offs_k, offs_n < N, offs_m < M, w_rows, x_rows


@triton.jit
def _load_w(w_rows, k, n_ok, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """The W rows' tile at columns k (masked where the shape does not divide)."""
    if EVEN_K:
        if EVEN_N:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
    else:
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    return w


@triton.jit
def _load_x(x_rows, k, m_ok, K, EVEN_K: tl.constexpr):
    """The x rows' tile at columns k."""
    if EVEN_K:
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
    else:
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
    return x


@triton.jit
def _load_tiles(x_rows, w_rows, k, m_ok, n_ok, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """The x rows' and W rows' tiles at columns k."""
    return _load_x(x_rows, k, m_ok, K, EVEN_K), _load_w(w_rows, k, n_ok, K, EVEN_N, EVEN_K)


@triton.jit
def _dot_tile(w, x, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _sum_tile(w, x, acc):
    return acc + tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)


# WEIGHT_FIRST: the first weight tile is loaded before `pdl_begin` waits for the previous kernel (kernels/pdl.py):
# the weights do not depend on it, so with PDL that read overlaps the previous kernel's tail. The first tile's
# product then starts the accumulator (exactly what adding it to zeros gives), and the loop takes the rest. It
# is on wherever PDL is (ATLAS_GEMV_WEIGHT_FIRST=0 waits first instead, for measuring: inside the engine the
# shipped configs timed slower this way, BENCHMARKS.md); the interpreter tests run it without PDL.
WEIGHT_FIRST_WITH_PDL = os.environ.get("ATLAS_GEMV_WEIGHT_FIRST", "1") != "0"


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
):
    offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, x_rows = _program_tiles(
        x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T tile: W rows x padded x rows
    if WEIGHT_FIRST:
        w = _load_w(w_rows, offs_k, n_ok, K, EVEN_N, EVEN_K)
        pdl_begin(PDL)
        acc = _dot_tile(w, _load_x(x_rows, offs_k, m_ok, K, EVEN_K), acc, IEEE)
    else:
        pdl_begin(PDL)
    for k0 in tl.range(BLOCK_K if WEIGHT_FIRST else 0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _load_w(w_rows, k0 + offs_k, n_ok, K, EVEN_N, EVEN_K)
        acc = _dot_tile(w, _load_x(x_rows, k0 + offs_k, m_ok, K, EVEN_K), acc, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym", "stride_rm", "stride_om"])
def _gemv_sum_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, res_out_ptr, norm_w_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    stride_rm, stride_om, eps, inv_k,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
):
    """The CUDA-core GEMV, with two fusions for a decode layer (module docstring):
    NORM 1: x is rms_norm(x) (norm_w_ptr, eps); NORM 2: rms_norm(x + res), and program 0 writes the sum (the new
    residual stream, rounded to the activation dtype) to res_out. The norm's 1/rms is applied to the sums at
    the end (it is one number a row), so the row is read once.
    ACT >= 0: W is [gate | up] (N = 2 I rows) and y = act(x gate^T) * (x up^T) [M, I]: a program takes BLOCK_N / 2
    columns of each half, interleaved, and rounds like the GEMV followed by the activation kernel.
    The next W tile is loaded while the current one is summed (registers double-buffered, one loop body); the
    first is loaded before waiting for the previous kernel when WEIGHT_FIRST (the weights do not depend on it)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    if ACT >= 0:  # W row j of this program: column pid * BLOCK_N / 2 + j // 2 of the gate (j even) or up half
        cols = pid * (BLOCK_N // 2) + j // 2
        w_ids = cols + (j % 2) * (N // 2)
        n_ok = cols < N // 2
    else:
        w_ids = pid * BLOCK_N + j
        n_ok = w_ids < N
    offs_m = tl.arange(0, ROWS)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + w_ids.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    if not WEIGHT_FIRST:
        pdl_begin(PDL)
    w = _load_w(w_rows, offs_k, n_ok, K, EVEN_N, EVEN_K)
    if WEIGHT_FIRST:
        pdl_begin(PDL)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    sum_sq = tl.zeros([ROWS], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=1):
        k = k0 + offs_k
        k_next = k + BLOCK_K
        w_next = tl.load(w_rows + k_next[None, :], mask=n_ok[:, None] & (k_next < K)[None, :], other=0.0)
        x = _load_x(x_rows, k, m_ok, K, EVEN_K).to(tl.float32)
        if NORM == 2:
            tile_ok = m_ok[:, None] & (k < K)[None, :]
            r = tl.load(res_ptr + offs_m[:, None] * stride_rm + k[None, :], mask=tile_ok, other=0.0)
            s = (x + r.to(tl.float32)).to(DT)  # the residual stream, rounded like PyTorch's `x + residual`
            if pid == 0:
                tl.store(res_out_ptr + offs_m[:, None] * stride_om + k[None, :], s, mask=tile_ok)
            x = s.to(tl.float32)
        if NORM > 0:
            sum_sq += tl.sum(x * x, axis=1)
            x = x * tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
        acc = _sum_tile(w, x, acc)
        w = w_next
    if NORM > 0:
        acc = acc * tl.rsqrt(sum_sq * inv_k + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_ids, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT >= 0:
        gate, up = tl.split(tl.reshape(acc.to(DT).to(tl.float32), [ROWS, BLOCK_N // 2, 2]))
        out = gated_act(gate, ACT, LIBDEVICE).to(DT).to(tl.float32) * up
        out_cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y = y_ptr + offs_m[:, None] * stride_ym + out_cols[None, :]
        tl.store(y, out.to(DT), mask=m_ok[:, None] & (out_cols < N // 2)[None, :])
    else:
        y = y_ptr + offs_m[:, None] * stride_ym + w_ids[None, :]
        tl.store(y, acc.to(DT), mask=m_ok[:, None] & n_ok[None, :])


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int = 16,
                block_k: int = 256, num_warps: int = 4, num_stages: int = 4, kind: str = "dot",
                weight_first: bool | None = None, norm: tuple[torch.Tensor, float] | None = None,
                residual: torch.Tensor | None = None, act: int | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K, M <= 16), weight [N, K] contiguous, bias [N] or None -> y [M, N]; kind
    "dot" or "sum" (module docstring); weight_first (WEIGHT_FIRST above) defaults to whether PDL is on.

    The "sum" kernel also fuses a decode layer's neighbours: norm=(norm weight [K], eps) reads rms_norm(x) in
    place of x, and with `residual` [M, K] rms_norm(x + residual), returning (y, x + residual); act (an
    ACT_* code of fused_ops_triton) takes weight as [gate | up] and returns act(x gate^T) * (x up^T) [M, N / 2]."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= BLOCK_M and weight.shape[1] == K and weight.is_contiguous() and x.stride(1) == 1
    launch = launch_options(x.device)
    launch["WEIGHT_FIRST"] = (bool(launch["PDL"]) and WEIGHT_FIRST_WITH_PDL) if weight_first is None else weight_first
    if kind == "sum":
        assert residual is None or (norm is not None and residual.shape == x.shape and residual.stride(1) == 1)
        assert act is None or (N % 2 == 0 and block_n % 2 == 0)
        y = torch.empty(M, N // 2 if act is not None else N, dtype=x.dtype, device=x.device)
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
        norm_w, eps = norm if norm is not None else (weight, 0.0)
        out_cols = block_n // 2 if act is not None else block_n
        _gemv_sum_kernel[(triton.cdiv(y.shape[1], out_cols),)](
            x, weight, bias if bias is not None else weight, y, residual if residual is not None else x,
            res_out if res_out is not None else y, norm_w, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
            residual.stride(0) if residual is not None else 0, res_out.stride(0) if res_out is not None else 0,
            eps, 1.0 / max(K, 1),
            ROWS=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_N=y.shape[1] % out_cols == 0, EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None,
            NORM=0 if norm is None else (2 if residual is not None else 1), ACT=-1 if act is None else act,
            LIBDEVICE=_LIBDEVICE_MATH, num_warps=num_warps, **launch,
        )
        return (y, res_out) if residual is not None else y
    assert kind == "dot" and norm is None and act is None, kind
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        EVEN_N=N % block_n == 0, EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, num_warps=num_warps, **launch,
    )
    return y
