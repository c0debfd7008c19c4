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

PREFETCH (the gemv_prefetch tuning knob): the program loads its first W tile before it waits for
the kernel before it (programmatic dependent launch), so that a decode layer's next weights stream in while the
last kernel's tail runs; no kernel of a step writes weights. The sums are the same, in the same order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels import settings
from atlas.kernels.fused_ops_triton import _LIBDEVICE_MATH, gated_act
from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin
from atlas.kernels.peer_all_reduce_triton import push_slots, push_tile

BLOCK_M = 16  # rows padded to the smallest tl.dot tile
_NO_PUSH = {"pointers": None, "constexprs": dict(PUSH=False, RANK=0, WORLD=1, EMPTY=0, ROW_SLOT=0, SOURCE_STRIDE=0,
                                                 PARITY_STRIDE=0)}


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
def gate_up_rows(pid, N, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
    """The W rows of program pid's BLOCK_N-row tile and their mask. ACT >= 0 (W is [gate | up], N = 2 I rows): row j
    of the tile is column pid * BLOCK_N / 2 + j // 2 of the gate (j even) or of the up half (j odd), so a program
    holds both halves of its BLOCK_N / 2 output columns for the activation epilogue."""
    j = tl.arange(0, BLOCK_N)
    if ACT >= 0:
        cols = pid * (BLOCK_N // 2) + j // 2
        w_ids = cols + (j % 2) * (N // 2)
        n_ok = cols < N // 2
    else:
        w_ids = pid * BLOCK_N + j
        n_ok = w_ids < N
    return w_ids, n_ok


@triton.jit
def expert_pair(ids_ptr, rw_ptr, w_ptr, s_ptr, x_ptr, y_ptr, stride_we, stride_se, stride_xm, stride_ym,
                TOPK: tl.constexpr):
    """A routed-expert GEMV's program over (token, choice) pair p = program_id(1): W and its scales offset to expert
    ids[p]'s slice, x to token p // TOPK's row, y to row p, and whether the pair counts (routing weight not 0)."""
    pair = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    live = tl.load(rw_ptr + pair) != 0
    return (w_ptr + expert * stride_we, s_ptr + expert * stride_se, x_ptr + (pair // TOPK).to(tl.int64) * stride_xm,
            y_ptr + pair.to(tl.int64) * stride_ym, expert, live)


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


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, x_rows = _program_tiles(
        x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T tile: W rows x padded x rows
    if PREFETCH:  # (the first W tile while the kernel before still runs: module docstring)
        w_first = _load_w(w_rows, offs_k, n_ok, K, EVEN_N, EVEN_K)
    pdl_begin(PDL)
    if PREFETCH:
        acc = _dot_tile(w_first, _load_x(x_rows, offs_k, m_ok, K, EVEN_K), acc, IEEE)
    for k0 in tl.range(BLOCK_K if PREFETCH else 0, K, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _load_tiles(x_rows, w_rows, k0 + offs_k, m_ok, n_ok, K, EVEN_N, EVEN_K)
        acc = _dot_tile(w, x, acc, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _gemv_sum_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    buffer_ptrs, own_ptr, counter_ptr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr,
    PUSH: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, EMPTY: tl.constexpr, ROW_SLOT: tl.constexpr,
    SOURCE_STRIDE: tl.constexpr, PARITY_STRIDE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """The CUDA-core GEMV. ACT >= 0 (fused_ops_triton's ACT_* codes): W is [gate | up] (N = 2 I rows) and
    y = act(x gate^T) * (x up^T) [M, I], the gated MLP's activation as the epilogue: a program takes BLOCK_N / 2
    columns of each half, interleaved, and rounds like this GEMV followed by the activation kernel. PUSH (no
    ACT): y also goes to the tensor-parallel peers for the all-reduce that takes it next
    (peer_all_reduce_triton.push_tile; buffer_ptrs, own_ptr, counter_ptr and the constexprs after PUSH are
    that all-reduce's)."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    w_ids, n_ok = gate_up_rows(pid, N, BLOCK_N, ACT)
    offs_m = tl.arange(0, ROWS)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + w_ids.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if PREFETCH:  # (the first W tile while the kernel before still runs: module docstring)
        w_first = _load_w(w_rows, offs_k, n_ok, K, EVEN_N, EVEN_K)
    pdl_begin(PDL)
    if PUSH:  # (the addresses early, so the epilogue's stores wait for no load)
        peers, slots = push_slots(offs_m, m_ok, buffer_ptrs, counter_ptr, RANK, WORLD, ROW_SLOT, SOURCE_STRIDE,
                                  PARITY_STRIDE)
    if PREFETCH:
        acc = _sum_tile(w_first, _load_x(x_rows, offs_k, m_ok, K, EVEN_K), acc)
    for k0 in tl.range(BLOCK_K if PREFETCH else 0, K, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _load_tiles(x_rows, w_rows, k0 + offs_k, m_ok, n_ok, K, EVEN_N, EVEN_K)
        acc = _sum_tile(w, x, acc)
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
        if PUSH:
            push_tile(acc.to(DT), peers, slots, m_ok, w_ids, n_ok, own_ptr, RANK, WORLD, EMPTY)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int = 16,
                block_k: int = 256, num_warps: int = 4, num_stages: int = 4, kind: str = "dot",
                act: int | None = None, push=None, prefetch: bool | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K, M <= 16), weight [N, K] contiguous, bias [N] or None -> y [M, N] in W's dtype
    (x's but for a bf16/fp16 x against a float32 W, which the "sum" kind alone takes); kind "dot" or "sum" (module
    docstring). act (a "sum" kernel's epilogue; an ACT_* code of fused_ops_triton): weight
    is [gate | up] and the result act(x gate^T) * (x up^T) [M, N / 2]. push (a "sum" kernel without act): the
    PeerAllReduce that all-reduces y next; where it takes y, the kernel also sends y to the peers and that
    all-reduce skips the step (PeerAllReduce.push_args). prefetch (None: the gemv_prefetch knob): the first W tile
    before the PDL wait (module docstring)."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= BLOCK_M and weight.shape[1] == K and weight.is_contiguous() and x.stride(1) == 1
    # (a narrower x against a float32 W, the "sum" kernel only: it widens x as it loads it, y is float32)
    widening = x.dtype != weight.dtype
    assert not widening or (kind == "sum" and weight.dtype == torch.float32 and act is None and push is None
                            and bias is None), (x.dtype, weight.dtype, kind)
    launch = launch_options(x.device)
    if kind == "sum":
        assert act is None or (N % 2 == 0 and block_n % 2 == 0)
        assert push is None or act is None
        y = torch.empty(M, N // 2 if act is not None else N, dtype=weight.dtype, device=x.device)
        out_cols = block_n // 2 if act is not None else block_n
        peer = push.push_args(y) if push is not None and push.takes(y) else _NO_PUSH
        _gemv_sum_kernel[(triton.cdiv(y.shape[1], out_cols),)](
            x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
            *(peer["pointers"] or (weight, weight, weight)),
            ROWS=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
            EVEN_N=y.shape[1] % out_cols == 0, EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None,
            ACT=-1 if act is None else act, LIBDEVICE=_LIBDEVICE_MATH, **peer["constexprs"], num_warps=num_warps,
            PREFETCH=settings.tuning.gemv_prefetch if prefetch is None else prefetch, **launch,
        )
        return y
    assert kind == "dot" and act is None, kind
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        EVEN_N=N % block_n == 0, EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, PREFETCH=settings.tuning.gemv_prefetch if prefetch is None else prefetch,
        num_warps=num_warps, **launch,
    )
    return y
