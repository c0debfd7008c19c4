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


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _gemv_sum_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
):
    offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, x_rows = _program_tiles(
        x_ptr, w_ptr, M, N, stride_xm, stride_wn, ROWS, BLOCK_N, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if WEIGHT_FIRST:
        w = _load_w(w_rows, offs_k, n_ok, K, EVEN_N, EVEN_K)
        pdl_begin(PDL)
        acc = _sum_tile(w, _load_x(x_rows, offs_k, m_ok, K, EVEN_K), acc)
    else:
        pdl_begin(PDL)
    for k0 in tl.range(BLOCK_K if WEIGHT_FIRST else 0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _load_w(w_rows, k0 + offs_k, n_ok, K, EVEN_N, EVEN_K)
        acc = _sum_tile(w, _load_x(x_rows, k0 + offs_k, m_ok, K, EVEN_K), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int = 16,
                block_k: int = 256, num_warps: int = 4, num_stages: int = 4, kind: str = "dot",
                weight_first: bool | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K, M <= 16), weight [N, K] contiguous, bias [N] or None -> [M, N];
    kind "dot" or "sum" (module docstring); weight_first (WEIGHT_FIRST above) defaults to whether PDL is on."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= BLOCK_M and weight.shape[1] == K and weight.is_contiguous() and x.stride(1) == 1
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    launch = launch_options(x.device)
    launch["WEIGHT_FIRST"] = (launch["PDL"] and WEIGHT_FIRST_WITH_PDL) if weight_first is None else weight_first
    if kind == "sum":
        _gemv_sum_kernel[(triton.cdiv(N, block_n),)](
            x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
            ROWS=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
            EVEN_N=N % block_n == 0, EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None, num_warps=num_warps,
            **launch,
        )
        return y
    assert kind == "dot", kind
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        EVEN_N=N % block_n == 0, EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, num_warps=num_warps, **launch,
    )
    return y
