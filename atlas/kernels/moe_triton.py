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
  does nothing. Each chunk re-reads the program's W slice (a second chunk is rare at decode sizes).
Sizes come from tensor shapes and rows from device values (no host sync): both run inside CUDA graphs.
The reference is kernels/moe.py (moe_matmul_ref); layers/moe.py dispatches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels.gemv_triton import BLOCK_M, _load_tiles, _program_tiles

# Pairs: the CUDA-core GEMV config that was fastest at one row on an H200 (kernels/gemv.py's first
# candidate): 4 outputs x 2048 of K a program, 4 warps, 3 stages. One tile covers a whole row of
# V2-Lite's gate|up (K = 2048); down's K = 1408 is one masked tile.
PAIRS_BLOCK_N = 4
PAIRS_BLOCK_K = 2048
PAIRS_NUM_WARPS = 4
PAIRS_NUM_STAGES = 3
# Grouped: 128 divides both of V2-Lite's K (2048 and 1408 = 11 * 128), so no tile is masked; 64 columns
# a program keep the x chunk's re-reads (from L2, once per program) under a tenth of the W slice's bytes
# and still give 44 x 64 programs for gate|up (32 x 64 for down) when every expert has rows. Chosen on
# paper, not yet timed on a GPU.
GROUPED_BLOCK_N = 64
GROUPED_BLOCK_K = 128
GROUPED_NUM_WARPS = 4
GROUPED_NUM_STAGES = 3


# ("matmul" in the kernels' names: the kernel profile, atlas/bench/kernel_profile.py, counts them as matmuls.)
@triton.jit
def _moe_matmul_pairs_kernel(
    x_ptr, w_ptr, ids_ptr, y_ptr, N, K, stride_xm, stride_we, stride_wn, stride_ym,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    pair = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row = (pair // TOPK).to(tl.int64)
    # One x row: the GEMV's tiles with ROWS = 1, based at this pair's row and expert.
    offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, x_rows = _program_tiles(
        x_ptr + row * stride_xm, w_ptr + expert * stride_we, 1, N, stride_xm, stride_wn, 1, BLOCK_N, BLOCK_K)
    acc = tl.zeros([1, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _load_tiles(x_rows, w_rows, k0 + offs_k, m_ok, n_ok, K, EVEN_N, EVEN_K)
        acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
    y = y_ptr + pair.to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _moe_matmul_grouped_kernel(
    x_ptr, w_ptr, offsets_ptr, y_ptr, N, K, stride_xm, stride_we, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):
    expert = tl.program_id(1)
    start = tl.load(offsets_ptr + expert).to(tl.int32)
    end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    for m0 in range(start, end, BLOCK_M):  # no iteration for an expert without rows
        x_chunk = x_ptr + tl.cast(m0, tl.int64) * stride_xm  # (m0: a plain int in the interpreter)
        offs_n, offs_m, offs_k, n_ok, m_ok, w_rows, x_rows = _program_tiles(
            x_chunk, w_expert, end - m0, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T tile: W rows x padded x rows
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            x, w = _load_tiles(x_rows, w_rows, k0 + offs_k, m_ok, n_ok, K, EVEN_N, EVEN_K)
            if IEEE:
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        y = y_ptr + tl.cast(m0, tl.int64) * stride_ym + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    assert x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[2], (x.shape, w.shape)
    assert x.dtype == w.dtype and x.stride(1) == 1 and w.stride(2) == 1, (
        x.dtype, w.dtype, x.stride(), w.stride())


def moe_pairs_matmul(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, topk: int,
                     block_n: int = PAIRS_BLOCK_N, block_k: int = PAIRS_BLOCK_K,
                     num_warps: int = PAIRS_NUM_WARPS, num_stages: int = PAIRS_NUM_STAGES) -> torch.Tensor:
    """x [R, K], w [E, N, K], expert ids [T, k] (P = T * k pairs, R = P / topk) -> y [P, N] with
    y[p] = w[ids.flatten()[p]] @ x[p // topk]."""
    _check(x, w)
    flat = ids.reshape(-1).contiguous()
    pairs, (_, n, k) = flat.shape[0], w.shape
    assert pairs == x.shape[0] * topk, (pairs, x.shape, topk)
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return y
    block_k = min(block_k, triton.next_power_of_2(k))  # (small K: no tile wider than the row)
    _moe_matmul_pairs_kernel[(triton.cdiv(n, block_n), pairs)](
        x, w, flat, y, n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        TOPK=topk, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, EVEN_N=n % block_n == 0,
        EVEN_K=k % block_k == 0, num_warps=num_warps,
    )
    return y


def moe_grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                       block_n: int = GROUPED_BLOCK_N, block_k: int = GROUPED_BLOCK_K,
                       num_warps: int = GROUPED_NUM_WARPS,
                       num_stages: int = GROUPED_NUM_STAGES) -> torch.Tensor:
    """x [M, K] rows sorted by expert, w [E, N, K], offsets [E + 1] (int32 or int64, offsets[0] = 0,
    offsets[E] = M) -> y [M, N] with y[m] = w[e] @ x[m] for offsets[e] <= m < offsets[e + 1]."""
    _check(x, w)
    e, n, k = w.shape
    assert block_n >= 16, block_n  # (a tl.dot operand's dimensions)
    assert offsets.shape == (e + 1,) and offsets.dtype in (torch.int32, torch.int64), (
        offsets.shape, offsets.dtype)
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))  # (tl.dot wants K tiles of 16 or more)
    _moe_matmul_grouped_kernel[(triton.cdiv(n, block_n), e)](
        x, w, offsets.contiguous(), y, n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, EVEN_N=n % block_n == 0,
        EVEN_K=k % block_k == 0, IEEE=x.dtype == torch.float32, num_warps=num_warps,
    )
    return y
