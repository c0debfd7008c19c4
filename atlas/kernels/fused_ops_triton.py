"""Triton kernels of the fused elementwise ops of a decoder layer (imported lazily, only on CUDA and in
the tests): RMSNorm with an optional fused residual add, the attention prologue (per-head q/k RMSNorm,
RoPE, K/V cache write), MLA's prologue (latent RMSNorm, RoPE, latent cache write) and the gated
activations. The PyTorch references they are tested against are the `*_ref` functions in
kernels/fused_ops.py.

Numerics follow the Hugging Face modules exactly: every value is computed in float32 and rounded to
the activation dtype (`.to(DT).to(tl.float32)`) at each point where the PyTorch formula rounds. fp32
mul/add contraction into FMA is turned off (`enable_fp_fusion=False`) in the norm and rope kernels
because PyTorch runs those products and sums as separate kernels. Measured against PyTorch on an H200
(tests/fused_ops_cases.py): silu and tanh-gelu are bit-exact in fp32, bf16 and fp16; the norms and the
rope differ only where a float32 sum in another order lands next to a rounding boundary (a few bf16
elements per million, one ulp, rarely two); erf-gelu differs in the last fp32 bit (Triton's libdevice
erff is not PyTorch's), which its cancelling tail turns into bf16 differences there.

Every kernel reads and writes each byte once, takes no host sync and allocates nothing that depends on
device values, so it can be captured in a CUDA graph. Nothing that changes from step to step (the number
of tokens) is a specialised argument: the token count only sets the grid, or is in
`do_not_specialize`, so a live server does not recompile when the batch size changes (the prologue has
one decode and one prefill tile, see QK_LARGE_TILE_TOKENS).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from atlas.kernels import settings
from atlas.kernels.paged_attention_ref import cache_limit, v_transposed
from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    libdevice = None

ACT_SILU, ACT_GELU_TANH, ACT_GELU = 0, 1, 2
# Only in the fused expert epilogue (gated_pair): gpt-oss's clamped SwiGLU and DeepSeek-V4's clamped SiLU (with `limit`,
# and `alpha` for the first; kernels/moe.py's clamped_swiglu and limited_silu_and_mul are their references).
ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU = 3, 4
# ReLU: relu(gate) * up, which with gate = up (the same rows twice) is the squared ReLU of non-gated experts
ACT_RELU = 5
# On the GPU, exp, tanh and erf of the activations come from libdevice, the CUDA math library PyTorch's
# own kernels use (expf, tanhf, erff), so fp32 and fp16 match PyTorch in the last bit too and gelu's tail
# (where 1 + tanh(u) cancels) equals it; Triton's CPU interpreter has no libdevice and takes tl.exp
# formulas (checked against the references with a tolerance for that tail).
_LIBDEVICE_MATH = libdevice is not None and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _num_warps(elements: int, per_thread: int = 8, max_warps: int = 16) -> int:
    """Warps for a tile of `elements`, ~`per_thread` elements a thread (16-byte bf16/fp16 vectors)."""
    return max(1, min(max_warps, elements // (32 * per_thread)))


# --------------------------------------------------------------------------------------------------
# RMSNorm (+ residual add)
# --------------------------------------------------------------------------------------------------

@triton.jit
def _norm_rows(x_ptr, res_ptr, res_out_ptr, w_ptr, n_rows, stride_x, stride_res, stride_res_out, inv_n, eps,
               N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """This program's BLOCK_M rows of a norm's input: (row ids, column ids, their mask, the rows in float32 (with
    HAS_RESIDUAL x + residual, rounded to the activation dtype and stored as the new residual stream), their 1 / rms,
    the norm's weight in float32)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(DT)  # the new residual stream, rounded like PyTorch's `x + residual`
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    # mean(x^2) as sum * (1/N) (what PyTorch's CUDA mean does), then rsqrt, in float32.
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) * inv_n + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return rows, cols, mask, x, rstd, w


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, gate_ptr,
    n_rows, eps, inv_n,
    stride_x, stride_res, stride_out, stride_res_out, stride_gate,
    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
    SCALE_F32: tl.constexpr = False, W_OFFSET: tl.constexpr = 0.0, HAS_GATE: tl.constexpr = False,
    LIBDEVICE: tl.constexpr = False,
):
    """SCALE_F32: the normalised row times (w + W_OFFSET) in float32, rounded once (ZeroCenteredRMSNorm's order)
    instead of HF's round-then-scale; HAS_GATE: the result rounded, times silu(gate) in float32, rounded (the
    gated RMSNorm of a Gated DeltaNet layer: kernels/gated_delta_rule.rms_norm_gated_ref)."""
    pdl_begin(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    rows, cols, mask, x, rstd, w = _norm_rows(x_ptr, res_ptr, res_out_ptr, w_ptr, n_rows, stride_x, stride_res,
                                              stride_res_out, inv_n, eps, N, BLOCK_M, BLOCK_N, HAS_RESIDUAL)
    if SCALE_F32:
        y = (x * rstd[:, None]) * (w + W_OFFSET)[None, :]
    else:
        y = (x * rstd[:, None]).to(DT).to(tl.float32)  # x32 * rstd, rounded to the activation dtype
        y = w[None, :] * y
    if HAS_GATE:
        g = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y.to(DT).to(tl.float32) * gated_act(g, 0, LIBDEVICE)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def divide_by_scale(x, scale, r, FMA: tl.constexpr):
    """x / scale rounded as an IEEE division (PyTorch's), for the FP8 activation quantizers. FMA (the fp8_quant_fma
    knob; r = the IEEE reciprocal of scale, one a group): x * r corrected by two fused multiply-adds (Markstein's
    division), its zeros keeping x's sign: for every bf16 and fp16 x and every scale amax / 448 of a bf16 or fp16
    amax >= |x| it is the IEEE quotient wherever that is 2^-12 or more, and its FP8 value everywhere
    (tools/quant_division_check.py walks all 2 x 10^9 pairs), in three instructions where the division takes
    about ten and a branch."""
    if FMA:
        q0 = x * r
        q = tl.fma(tl.fma(-q0, scale, x), r, q0)
        return tl.where(q0 == 0.0, q0, q)
    return tl.math.div_rn(x, scale)


@triton.jit
def _quantize_group_rows(y, rows, row_ok, n_cols, q_ptr, s_ptr, stride_q, stride_sm, stride_sg, first_group,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
                         FMA: tl.constexpr):
    """Store y [BLOCK_M, BLOCK_N] (float32, values of the activation dtype; columns first_group * GROUP on, whole
    groups) in FP8 per 1 x GROUP group: each group's amax / FP8_MAX (at least 1e-12 / FP8_MAX) its scale, its values
    divided by it (IEEE division; divide_by_scale) and clamped, as fp8_linear_triton._quantize_groups_kernel computes
    them. Rows where row_ok is false, and groups from column n_cols (a multiple of GROUP) on, are not stored."""
    G: tl.constexpr = BLOCK_N // GROUP
    yg = tl.reshape(y, [BLOCK_M, G, GROUP])
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(yg), axis=2), 1e-12), FP8_MAX)  # (IEEE division, as torch's)
    r = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)  # (used with FMA only)
    q = tl.clamp(divide_by_scale(yg, scale[:, :, None], r[:, :, None], FMA), -FP8_MAX, FP8_MAX)
    g = first_group + tl.arange(0, G)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
    g_ok = g * GROUP < n_cols
    tl.store(q_ptr + rows[:, None, None] * stride_q + cols[None, :, :], q.to(q_ptr.dtype.element_ty),
             mask=row_ok[:, None, None] & g_ok[None, :, None])
    tl.store(s_ptr + rows[:, None] * stride_sm + g[None, :] * stride_sg, scale, mask=row_ok[:, None] & g_ok[None, :])


@triton.jit(do_not_specialize=["n_rows", "m_pad"])
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr,
    n_rows, m_pad, eps, inv_n,
    stride_x, stride_res, stride_q, stride_sm, stride_sg, stride_res_out,
    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr, FMA: tl.constexpr, PDL: tl.constexpr,
):
    """_rms_norm_kernel's RMSNorm (+ residual add) of rows of N (a multiple of GROUP) columns, its output (rounded to
    the activation dtype, as that kernel stores it) quantized per 1 x GROUP group into q and s (the fp8_fused_quant
    knob: fp8_linear.QuantizedRows) instead of stored; rows n_rows .. m_pad - 1 (padding) get zeros and the smallest
    scale."""
    pdl_begin(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    rows, _, _, x, rstd, w = _norm_rows(x_ptr, res_ptr, res_out_ptr, w_ptr, n_rows, stride_x, stride_res,
                                        stride_res_out, inv_n, eps, N, BLOCK_M, BLOCK_N, HAS_RESIDUAL)
    y = (x * rstd[:, None]).to(DT).to(tl.float32)
    y = (w[None, :] * y).to(DT).to(tl.float32)  # (the norm's output as _rms_norm_kernel stores it)
    _quantize_group_rows(y, rows, rows < m_pad, N, q_ptr, s_ptr, stride_q, stride_sm, stride_sg, 0, BLOCK_M, BLOCK_N,
                         GROUP, FP8_MAX, FMA)


def quantized_rows_buffers(n_rows: int, k: int, group: int, pad_rows_to: int, device, m_major: bool = True) -> tuple:
    """The FP8 activation quantizers' outputs for n_rows rows padded to pad_rows_to (M'): (q [M', K] FP8, scales
    [M', ceil(K / group)] float32, M-major (strides (1, M'): cuBLASLt's 1 x 128 block scaling) or row-major)."""
    from atlas.kernels.fp8_linear import FP8

    m_pad = -(-n_rows // pad_rows_to) * pad_rows_to
    groups = -(-k // group)
    q = torch.empty(m_pad, k, dtype=FP8, device=device)
    s = (torch.empty(groups, m_pad, dtype=torch.float32, device=device).t() if m_major
         else torch.empty(m_pad, groups, dtype=torch.float32, device=device))
    return q, s


def rms_norm_quant_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                          pad_rows_to: int = 4, group: int = 128):
    """rms_norm_triton's RMSNorm (+ residual add) of x [T, H] (H a multiple of group; weight in x's dtype), its output
    quantized per 1 x group group -> (q [T', H] FP8, scales [T', H / group] M-major[, the new
    residual]), T' = T padded to pad_rows_to: what quantize_groups_triton(rms_norm_triton(...), group, pad_rows_to,
    m_major=True) gives, in one kernel."""
    from atlas.kernels.fp8_linear import FP8_MAX

    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],) and weight.dtype == x.dtype
    n_rows, hidden = x.shape
    assert hidden % group == 0, hidden
    q, s = quantized_rows_buffers(n_rows, hidden, group, pad_rows_to, x.device)
    residual_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_m, block_n, num_warps = rms_norm_block(hidden)
    res = residual if residual is not None else x
    res_out = residual_out if residual is not None else x
    if q.shape[0]:
        _rms_norm_quant_kernel[(triton.cdiv(q.shape[0], block_m),)](
            x, res, weight.contiguous(), q, s, res_out, n_rows, q.shape[0], eps, 1.0 / hidden,
            x.stride(0), res.stride(0), q.stride(0), s.stride(0), s.stride(1), res_out.stride(0),
            N=hidden, BLOCK_M=block_m, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None, GROUP=group,
            FP8_MAX=FP8_MAX,
            FMA=settings.tuning.fp8_quant_fma, num_warps=num_warps, enable_fp_fusion=False,
            **launch_options(x.device))
    return (q, s) if residual is None else (q, s, residual_out)


def rms_norm_block(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N columns, num_warps) of one program for rows of `hidden` elements."""
    block_n = triton.next_power_of_2(hidden)
    block_m = max(1, min(16, 1024 // block_n))  # narrow rows: several per program
    return block_m, block_n, _num_warps(block_m * block_n)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                    weight_offset: float | None = None, gate: torch.Tensor | None = None):
    """x [T, H] (row stride free, unit column stride) -> out [T, H]; with `residual`, also the new
    residual x + residual [T, H]. out's dtype is promote(weight, x) like `weight * y.to(x.dtype)`.
    weight_offset (not None): the normalised row is scaled by (weight + weight_offset) in float32 and rounded once
    (ZeroCenteredRMSNorm: 1.0; Float32ScaledRMSNorm: 0.0), out in x's dtype. gate [T, H]: the result times
    silu(gate) (the gated RMSNorm of Gated DeltaNet)."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],) and weight.is_contiguous()
    n_rows, hidden = x.shape
    if out is None:
        dtype = (x.dtype if weight_offset is not None or gate is not None
                 else torch.promote_types(weight.dtype, x.dtype))
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if gate is not None:
        assert gate.shape == x.shape and gate.stride(1) == 1 and weight_offset is None
    if n_rows == 0:
        return out if residual is None else (out, residual_out)
    block_m, block_n, num_warps = rms_norm_block(hidden)
    res = residual if residual is not None else x
    res_out = residual_out if residual is not None else out
    gate_t = gate if gate is not None else x
    _rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
        x, res, weight, out, res_out, gate_t,
        n_rows, eps, 1.0 / hidden,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), gate_t.stride(0),
        N=hidden, BLOCK_M=block_m, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None,
        SCALE_F32=weight_offset is not None, W_OFFSET=float(weight_offset or 0.0), HAS_GATE=gate is not None,
        LIBDEVICE=_LIBDEVICE_MATH, num_warps=num_warps, enable_fp_fusion=False, **launch_options(x.device),
    )
    return out if residual is None else (out, residual_out)


# --------------------------------------------------------------------------------------------------
# Attention prologue: q/k RMSNorm over head_dim, RoPE, K/V cache write, in one launch
# --------------------------------------------------------------------------------------------------

@triton.jit
def _head_norm(x, rstd, q_w_ptr, k_w_ptr, idx, ok, is_q, is_qk, DT: tl.constexpr):
    """HF RMSNorm of the q and k heads (rows) of x at dims idx: w * round(x * rstd), rounded; v rows as is."""
    w = tl.where(is_q[:, None], tl.load(q_w_ptr + idx, mask=ok, other=0.0).to(tl.float32)[None, :],
                 tl.load(k_w_ptr + idx, mask=ok, other=0.0).to(tl.float32)[None, :])
    xn = (w * (x * rstd[:, None]).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    return tl.where(is_qk[:, None], xn, x)


@triton.jit
def _to_cache(x, KV_DT: tl.constexpr, KV_LIMIT: tl.constexpr):
    """x as the cache stores it: cast, saturating at +-KV_LIMIT for an 8-bit cache (KV_LIMIT > 0:
    paged_attention_ref.cache_limit; as its to_cache_dtype)."""
    if KV_LIMIT > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -KV_LIMIT), KV_LIMIT)
    return x.to(KV_DT)


@triton.jit
def _kv_ptrs(kv_row, kv_step, idx, V_T: tl.constexpr):
    """Cache addresses of dims idx of each head's row (kv_row: dim 0 of each head)."""
    if V_T:
        return kv_row[:, None] + idx[None, :] * kv_step[:, None]
    return kv_row[:, None] + idx[None, :]


@triton.jit
def _rope_pair(x1, x2, cos, sin, DT: tl.constexpr):
    """HF RoPE of one rotary pair's members (float32 values of the activation dtype): each product rounded, then
    the sum (the attention prologue's and fused_ops.apply_rope's order)."""
    o1 = ((x1 * cos).to(DT).to(tl.float32) - (x2 * sin).to(DT).to(tl.float32)).to(DT)
    o2 = ((x2 * cos).to(DT).to(tl.float32) + (x1 * sin).to(DT).to(tl.float32)).to(DT)
    return o1, o2


@triton.jit
def _rope_pair_dims(HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_R: tl.constexpr):
    """(pair ids i, i < HALF, the dims of each pair's first and second member): halves for neox (rotate_half),
    adjacent dims for interleaved pairs."""
    i = tl.arange(0, BLOCK_R)
    if IS_NEOX:
        return i, i < HALF, i, i + HALF
    return i, i < HALF, 2 * i, 2 * i + 1


@triton.jit
def _qk_norm_rope_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, q_out_ptr, kv_ptr, slot_ptr,
    eps, inv_d,
    stride_qkv, stride_cos, stride_sin, stride_q_out, stride_kv_plane, stride_kv_slot, stride_kv_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, KV_LIMIT: tl.constexpr, PAGE: tl.constexpr, V_T: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    # Program (t, b): heads b*BLOCK_H .. of token t, counted over the fused row q heads | k heads | v heads.
    # A head is read as three segments: the two members of each rotary pair (x1 at idx1, x2 at idx2:
    # halves for neox, even/odd dims for interleaved) and the pass-through dims ROT_DIM..HEAD_DIM, so
    # that every element is loaded once and no value needs shuffling between threads.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    QK: tl.constexpr = NUM_HEADS + NUM_KV_HEADS
    HALF: tl.constexpr = ROT_DIM // 2
    PASS: tl.constexpr = HEAD_DIM - ROT_DIM
    DT: tl.constexpr = qkv_ptr.dtype.element_ty
    KV_DT: tl.constexpr = kv_ptr.dtype.element_ty
    h_ok = h < QK + NUM_KV_HEADS
    is_q = h < NUM_HEADS
    is_qk = h < QK  # q and k heads are normed and roped; v heads are copied as they are
    row = qkv_ptr + t * stride_qkv + h * HEAD_DIM
    q_row = q_out_ptr + t * stride_q_out + h * HEAD_DIM
    # The token's cache slot, broadcast over the heads (the interpreter cannot `&` a scalar bool with a
    # vector); a slot < 0 is a padding row: nothing is written to the cache.
    slot = tl.zeros([BLOCK_H], dtype=tl.int64) + tl.load(slot_ptr + t).to(tl.int64)
    is_v = h >= QK
    kv_row = (kv_ptr + is_v.to(tl.int64) * stride_kv_plane + slot * stride_kv_slot
              + tl.where(is_v, h - QK, h - NUM_HEADS) * stride_kv_head)
    kv_step = slot  # (unused unless V_T)
    if V_T:  # an 8-bit cache's V plane is [pages, heads, dim, page]: a head's dims PAGE apart
        v_row = (kv_ptr + stride_kv_plane + (slot // PAGE) * (PAGE * stride_kv_slot) + (h - QK) * (HEAD_DIM * PAGE)
                 + slot % PAGE)
        kv_row = tl.where(is_v, v_row, kv_row)
        kv_step = tl.where(is_v, PAGE, 1).to(tl.int64)
    kv_ok = h_ok & (h >= NUM_HEADS) & (slot >= 0)

    ss = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HALF > 0:
        i, i_ok, idx1, idx2 = _rope_pair_dims(HALF, IS_NEOX, BLOCK_R)
        m_r = h_ok[:, None] & i_ok[None, :]
        x1 = tl.load(row[:, None] + idx1[None, :], mask=m_r, other=0.0).to(tl.float32)
        x2 = tl.load(row[:, None] + idx2[None, :], mask=m_r, other=0.0).to(tl.float32)
        ss += tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if PASS > 0:
        j = ROT_DIM + tl.arange(0, BLOCK_P)
        j_ok = j < HEAD_DIM
        m_p = h_ok[:, None] & j_ok[None, :]
        xp = tl.load(row[:, None] + j[None, :], mask=m_p, other=0.0).to(tl.float32)
        ss += tl.sum(xp * xp, axis=1)

    if HAS_NORM:  # Qwen3: RMSNorm of each q and k head over head_dim, before RoPE
        rstd = tl.rsqrt(ss * inv_d + eps)
        if HALF > 0:
            x1 = _head_norm(x1, rstd, q_w_ptr, k_w_ptr, idx1, i_ok, is_q, is_qk, DT)
            x2 = _head_norm(x2, rstd, q_w_ptr, k_w_ptr, idx2, i_ok, is_q, is_qk, DT)
        if PASS > 0:
            xp = _head_norm(xp, rstd, q_w_ptr, k_w_ptr, j, j_ok, is_q, is_qk, DT)

    if HALF > 0:
        # HF: cos/sin cast to the activation dtype; x*cos and rotate_half(x)*sin each rounded, then the sum.
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i_ok, other=0.0).to(DT).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i_ok, other=0.0).to(DT).to(tl.float32)[None, :]
        o1, o2 = _rope_pair(x1, x2, cos, sin, DT)
        o1 = tl.where(is_qk[:, None], o1, x1.to(DT))
        o2 = tl.where(is_qk[:, None], o2, x2.to(DT))
        tl.store(q_row[:, None] + idx1[None, :], o1, mask=m_r & is_q[:, None])
        tl.store(q_row[:, None] + idx2[None, :], o2, mask=m_r & is_q[:, None])
        tl.store(_kv_ptrs(kv_row, kv_step, idx1, V_T), _to_cache(o1, KV_DT, KV_LIMIT), mask=m_r & kv_ok[:, None])
        tl.store(_kv_ptrs(kv_row, kv_step, idx2, V_T), _to_cache(o2, KV_DT, KV_LIMIT), mask=m_r & kv_ok[:, None])
    if PASS > 0:
        tl.store(q_row[:, None] + j[None, :], xp.to(DT), mask=m_p & is_q[:, None])
        tl.store(_kv_ptrs(kv_row, kv_step, j, V_T), _to_cache(xp.to(DT), KV_DT, KV_LIMIT),
                 mask=m_p & kv_ok[:, None])


# From this many tokens on, the prologue moves 2048 elements a program (16 heads of 128) instead of 512:
# measured on an H200 for a Qwen3-8B layer, small tiles are ~20% faster at decode (more programs in
# flight) and large ones ~15% faster at T >= 512 (2.9 TB/s at T = 8192). Two compiled variants a model,
# both made during start-up (graph capture at decode sizes, the profiling run at the token budget).
QK_LARGE_TILE_TOKENS = 256


def qk_block(num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
             num_tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_H heads, BLOCK_R rotary pairs, BLOCK_P pass-through dims, num_warps) of one program of the
    attention prologue."""
    block_r = triton.next_power_of_2(max(rotary_dim // 2, 1))
    block_p = triton.next_power_of_2(max(head_dim - rotary_dim, 1))
    per_head = (2 * block_r if rotary_dim else 0) + (block_p if head_dim > rotary_dim else 0)
    total = num_heads + 2 * num_kv_heads
    target = 2048 if num_tokens >= QK_LARGE_TILE_TOKENS else 512
    block_h = max(1, min(triton.next_power_of_2(total), target // per_head))
    return block_h, block_r, block_p, max(1, min(4, block_h * per_head // 128))


def qk_norm_rope_kv_write_triton(
    qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None, eps: float, rotary_dim: int, is_neox: bool,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D]; k and v rows written to kv_cache at slot_mapping."""
    num_tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,)
    assert rotary_dim % 2 == 0 and 0 <= rotary_dim <= head_dim
    assert cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    _, num_pages, page, cache_heads, cache_dim = kv_cache.shape
    assert cache_heads == num_kv_heads and cache_dim == head_dim and kv_cache.stride(4) == 1
    assert kv_cache.stride(1) == page * kv_cache.stride(2), "a page's slots must be contiguous"
    has_norm = q_norm_weight is not None
    assert has_norm == (k_norm_weight is not None)
    if has_norm:
        assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
        assert q_norm_weight.dtype == qkv.dtype and k_norm_weight.dtype == qkv.dtype
    if q_out is None:
        q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    block_h, block_r, block_p, num_warps = qk_block(num_heads, num_kv_heads, head_dim, rotary_dim, num_tokens)
    q_w = q_norm_weight if has_norm else qkv
    k_w = k_norm_weight if has_norm else qkv
    grid = (num_tokens, triton.cdiv(num_heads + 2 * num_kv_heads, block_h))
    _qk_norm_rope_kv_kernel[grid](
        qkv, positions, cos_cache, sin_cache, q_w, k_w, q_out, kv_cache, slot_mapping,
        eps, 1.0 / head_dim,
        qkv.stride(0), cos_cache.stride(0), sin_cache.stride(0), q_out.stride(0),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROT_DIM=rotary_dim,
        IS_NEOX=is_neox, HAS_NORM=has_norm, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=block_p,
        KV_LIMIT=cache_limit(kv_cache.dtype), PAGE=page, V_T=v_transposed(kv_cache.dtype), num_warps=num_warps,
        enable_fp_fusion=False, **launch_options(qkv.device),
    )
    return q_out


# --------------------------------------------------------------------------------------------------
# MLA's prologue: the latent's RMSNorm, RoPE of q_pe and k_pe, the latent cache row's write, in one launch
# --------------------------------------------------------------------------------------------------

@triton.jit
def _mla_prologue_kernel(
    q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, q_pe_ptr, cache_ptr, slot_ptr,
    eps, inv_l,
    stride_q, stride_kv, stride_cos, stride_sin, stride_q_pe,
    NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, LATENT: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, KV_LIMIT: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    # Program (t, b): token t's q heads b*BLOCK_H ..; program (t, 0) also the latent row (norm, k_pe, cache write).
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    HALF: tl.constexpr = ROPE // 2
    DT: tl.constexpr = q_ptr.dtype.element_ty
    KV_DT: tl.constexpr = cache_ptr.dtype.element_ty
    i, i_ok, idx1, idx2 = _rope_pair_dims(HALF, IS_NEOX, BLOCK_R)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i_ok, other=0.0).to(DT).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i_ok, other=0.0).to(DT).to(tl.float32)

    h = b * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (h < NUM_HEADS)[:, None] & i_ok[None, :]
    row = q_ptr + t * stride_q + h * (NOPE + ROPE) + NOPE
    x1 = tl.load(row[:, None] + idx1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row[:, None] + idx2[None, :], mask=m, other=0.0).to(tl.float32)
    o1, o2 = _rope_pair(x1, x2, cos[None, :], sin[None, :], DT)
    out = q_pe_ptr + t * stride_q_pe + h * ROPE
    tl.store(out[:, None] + idx1[None, :], o1, mask=m)
    tl.store(out[:, None] + idx2[None, :], o2, mask=m)

    if b == 0:
        # The slot broadcast over the row (the interpreter cannot `&` a scalar bool with a vector); a slot < 0 is a
        # padding row: nothing is written.
        j = tl.arange(0, BLOCK_L)
        slot_j = tl.zeros([BLOCK_L], dtype=tl.int64) + tl.load(slot_ptr + t).to(tl.int64)
        slot_i = tl.zeros([BLOCK_R], dtype=tl.int64) + tl.load(slot_ptr + t).to(tl.int64)
        j_ok = j < LATENT
        c = tl.load(kv_ptr + t * stride_kv + j, mask=j_ok, other=0.0).to(tl.float32)
        # HF RMSNorm (as _rms_norm_kernel): mean(x^2) as sum * (1/N), x * rstd rounded, times the weight, rounded.
        rstd = tl.rsqrt(tl.sum(c * c, axis=0) * inv_l + eps)
        w = tl.load(w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
        c = (w * (c * rstd).to(DT).to(tl.float32)).to(DT)
        k1 = tl.load(kv_ptr + t * stride_kv + LATENT + idx1, mask=i_ok, other=0.0).to(tl.float32)
        k2 = tl.load(kv_ptr + t * stride_kv + LATENT + idx2, mask=i_ok, other=0.0).to(tl.float32)
        r1, r2 = _rope_pair(k1, k2, cos, sin, DT)
        dst_j = cache_ptr + slot_j * (LATENT + ROPE)
        dst_i = cache_ptr + slot_i * (LATENT + ROPE) + LATENT
        tl.store(dst_j + j, _to_cache(c, KV_DT, KV_LIMIT), mask=j_ok & (slot_j >= 0))
        tl.store(dst_i + idx1, _to_cache(r1, KV_DT, KV_LIMIT), mask=i_ok & (slot_i >= 0))
        tl.store(dst_i + idx2, _to_cache(r2, KV_DT, KV_LIMIT), mask=i_ok & (slot_i >= 0))


def mla_prologue_triton(
    q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, num_heads: int, nope_dim: int, is_neox: bool, cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q [T, H * (P + R)], kv_a [T, Lkv + R] -> q_pe [T, H, R]; the row [norm(c) | k_pe] written to cache
    [pages, block, Lkv + R] at slot_mapping (fused_ops.mla_prologue_ref's function, RoPE over all R dims)."""
    num_tokens = q.shape[0]
    latent = norm_weight.shape[0]
    rope_dim = kv_a.shape[1] - latent
    assert q.dim() == 2 and q.stride(1) == 1 and q.shape[1] == num_heads * (nope_dim + rope_dim)
    assert kv_a.dim() == 2 and kv_a.stride(1) == 1 and kv_a.shape[0] == num_tokens and rope_dim % 2 == 0
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,)
    assert cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1 and norm_weight.is_contiguous()
    assert cache.dim() == 3 and cache.shape[2] == latent + rope_dim and cache.is_contiguous()
    q_pe_out = torch.empty(num_tokens, num_heads, rope_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_pe_out
    block_r = triton.next_power_of_2(max(rope_dim // 2, 1))
    block_h = max(1, min(triton.next_power_of_2(max(num_heads, 1)), 512 // block_r))
    grid = (num_tokens, max(1, triton.cdiv(num_heads, block_h)))
    _mla_prologue_kernel[grid](
        q, kv_a, positions, cos_cache, sin_cache, norm_weight, q_pe_out, cache, slot_mapping,
        eps, 1.0 / latent,
        q.stride(0), kv_a.stride(0), cos_cache.stride(0), sin_cache.stride(0), q_pe_out.stride(0),
        NUM_HEADS=num_heads, NOPE=nope_dim, ROPE=rope_dim, LATENT=latent, IS_NEOX=is_neox, BLOCK_H=block_h,
        BLOCK_R=block_r, BLOCK_L=triton.next_power_of_2(latent), KV_LIMIT=cache_limit(cache.dtype), num_warps=4,
        enable_fp_fusion=False, **launch_options(q.device),
    )
    return q_pe_out


# --------------------------------------------------------------------------------------------------
# Gated activations: act(gate) * up
# --------------------------------------------------------------------------------------------------

@triton.jit
def gated_act(g, ACT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """act(g) in float32 for the gated MLPs (ACT_*), as PyTorch computes it; also the GEMV's epilogue."""
    if ACT == 0:  # silu: x / (1 + exp(-x)), IEEE division like PyTorch
        if LIBDEVICE:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        a = tl.div_rn(g, 1.0 + e)
    elif ACT == 1:  # gelu, tanh approximation, PyTorch's formula: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        u = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        if LIBDEVICE:
            th = libdevice.tanh(u)
        else:
            e = tl.exp(-2.0 * tl.abs(u))  # tanh(|u|) = (1 - e) / (1 + e), accurate for every |u|
            th = tl.div_rn(1.0 - e, 1.0 + e)
            th = tl.where(u < 0, -th, th)
        a = 0.5 * g * (1.0 + th)
    elif ACT == 2:  # gelu (erf): x * 0.5 * (1 + erf(x / sqrt(2)))
        if LIBDEVICE:
            erf = libdevice.erf(g * 0.7071067811865476)
        else:
            erf = tl.erf(g * 0.7071067811865476)
        a = g * 0.5 * (1.0 + erf)
    else:  # relu (ACT_RELU)
        a = tl.maximum(g, 0.0)
    return a


@triton.jit
def gated_pair(gate, up, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, DT: tl.constexpr, alpha, limit):
    """act(gate) * up in float32, not yet rounded, from gate and up already rounded to DT, rounding to DT after each
    operation as PyTorch's ops in DT do: act_and_mul's epilogue (ACT 0-2, 5), kernels/moe.py's clamped_swiglu (ACT 3:
    gate clamped above at limit, up to [-limit, limit], then (up + 1) * (gate * sigmoid(gate * alpha))) and
    limited_silu_and_mul (ACT 4: silu(gate clamped above) * (up clamped))."""
    if ACT == 3:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        z = (g * alpha).to(DT).to(tl.float32)
        if LIBDEVICE:  # (PyTorch's sigmoid: 1 / (1 + exp(-z)), expf and an IEEE division)
            e = libdevice.exp(-z)
        else:
            e = tl.exp(-z)
        sig = tl.div_rn(1.0, 1.0 + e).to(DT).to(tl.float32)
        out = (u + 1.0).to(DT).to(tl.float32) * (g * sig).to(DT).to(tl.float32)
    elif ACT == 4:
        out = (gated_act(tl.minimum(gate, limit), 0, LIBDEVICE).to(DT).to(tl.float32)
               * tl.minimum(tl.maximum(up, -limit), limit))
    else:
        out = gated_act(gate, ACT, LIBDEVICE).to(DT).to(tl.float32) * up
    return out


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, alpha, limit, ACT: tl.constexpr,
                        BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    DT: tl.constexpr = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # (ACT 0-2, 5: act(gate) rounded to the activation dtype, then the product; 3-4 the clamped forms)
    out = gated_pair(g, up, ACT, LIBDEVICE, DT, alpha, limit)
    tl.store(out_ptr + t * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _act_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, n_rows, inter, stride_x, stride_q, stride_sm, stride_sg,
                              ACT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, LIBDEVICE: tl.constexpr,
                              FP8_MAX: tl.constexpr, FMA: tl.constexpr, PDL: tl.constexpr):
    """_act_and_mul_kernel's act(gate) * up (inter a multiple of GROUP, BLOCK of them), rounded to the activation
    dtype as that kernel stores it, then quantized per 1 x GROUP group into q and s (fp8_linear.QuantizedRows);
    rows n_rows on (padding) get zeros and the smallest scale."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < inter) & ((t + tl.zeros([BLOCK], tl.int64)) < n_rows)  # (padding rows read nothing)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    a = gated_act(g, ACT, LIBDEVICE).to(DT).to(tl.float32)
    y = (a * up).to(DT).to(tl.float32)
    rows = t + tl.zeros([1], tl.int64)  # (the one row, as the helper's [BLOCK_M] rows; every row of the grid is stored)
    _quantize_group_rows(tl.reshape(y, [1, BLOCK]), rows, rows >= 0, inter, q_ptr, s_ptr, stride_q, stride_sm,
                         stride_sg, tl.program_id(1) * (BLOCK // GROUP), 1, BLOCK, GROUP, FP8_MAX, FMA)


def act_and_mul_quant_triton(x: torch.Tensor, act: int, pad_rows_to: int = 4, group: int = 128):
    """x [T, 2I] = [gate | up] (I a multiple of group) -> act(gate) * up quantized per 1 x group group: (q [T', I]
    FP8, scales [T', I / group] M-major), T' = T padded to pad_rows_to; what quantize_groups_triton(
    act_and_mul_triton(x, act), group, pad_rows_to, m_major=True) gives, in one kernel."""
    from atlas.kernels.fp8_linear import FP8_MAX

    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % (2 * group) == 0, x.shape
    n_rows, inter = x.shape[0], x.shape[1] // 2
    q, s = quantized_rows_buffers(n_rows, inter, group, pad_rows_to, x.device)
    block, num_warps = act_block(inter)
    block = max(block, group)
    if q.shape[0]:
        _act_and_mul_quant_kernel[(q.shape[0], triton.cdiv(inter, block))](
            x, q, s, n_rows, inter, x.stride(0), q.stride(0), s.stride(0), s.stride(1), ACT=act, BLOCK=block,
            GROUP=group, LIBDEVICE=_LIBDEVICE_MATH, FP8_MAX=FP8_MAX, FMA=settings.tuning.fp8_quant_fma,
            num_warps=num_warps, **launch_options(x.device))  # (FP fusion as _act_and_mul_kernel's: the same rows)
    return q, s


def act_block(inter: int) -> tuple[int, int]:
    """(BLOCK columns, num_warps) of one program of the gated activation."""
    block = min(1024, triton.next_power_of_2(inter))
    return block, _num_warps(block)


def act_and_mul_triton(x: torch.Tensor, act: int, out: torch.Tensor | None = None, alpha: float = 1.0,
                       limit: float = 0.0) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> act(gate) * up [T, I]; ACT_CLAMPED_SWIGLU (with alpha and limit) and
    ACT_LIMITED_SILU (with limit) their clamped forms, rounding as kernels/moe.py's PyTorch ops (gated_pair)."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or inter == 0:
        return out
    block, num_warps = act_block(inter)
    _act_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), float(alpha), float(limit), ACT=act, BLOCK=block,
        LIBDEVICE=_LIBDEVICE_MATH, num_warps=num_warps, **launch_options(x.device))
    return out
