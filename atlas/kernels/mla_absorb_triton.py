"""Triton kernels of MLA's absorbed products at a few query rows (kernels/mla_absorb.py; imported lazily, only on
CUDA and in the tests). Each program holds one head's slice of the weight and runs every query row against it,
summing in float32 and rounding once to the activation dtype (as cuBLAS's batched matmul does, in another order).
The row count is neither a specialised argument nor a tile size: one compiled variant serves every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin

ROWS = 4  # query rows a pass of a program (a loop covers more)


@triton.jit(do_not_specialize=["n_rows"])
def _absorb_query_kernel(x_ptr, w_ptr, out_ptr, n_rows, stride_xt, stride_xh, stride_wh, stride_wp, stride_ot,
                         stride_oh, P: tl.constexpr, L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    """out[t, h, l] = sum_p x[t, h, p] w[h, p, l]: program (h, block of L)."""
    pdl_begin(PDL)
    h = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    col_ok = cols < L
    ti = tl.arange(0, BLOCK_T)
    pi = tl.arange(0, BLOCK_P)
    for t0 in range(0, n_rows, BLOCK_T):
        t = t0 + ti
        t_ok = t < n_rows
        acc = tl.zeros([BLOCK_T, BLOCK_L], dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + pi
            p_ok = p < P
            x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + h * stride_xh + p[None, :],
                        mask=t_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + h * stride_wh + p[:, None] * stride_wp + cols[None, :],
                        mask=p_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ot + h * stride_oh + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n_rows"])
def _expand_values_kernel(x_ptr, w_ptr, out_ptr, n_rows, stride_xt, stride_xh, stride_wh, stride_wv, stride_ot,
                          V: tl.constexpr, L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    """out[t, h * V + v] = sum_l x[t, h, l] w[h, v, l]: program (h, block of V)."""
    pdl_begin(PDL)
    h = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V
    ti = tl.arange(0, BLOCK_T)
    li = tl.arange(0, BLOCK_L)
    for t0 in range(0, n_rows, BLOCK_T):
        t = t0 + ti
        t_ok = t < n_rows
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        for l0 in range(0, L, BLOCK_L):
            cols = l0 + li
            l_ok = cols < L
            x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + h * stride_xh + cols[None, :],
                        mask=t_ok[:, None] & l_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + h * stride_wh + v[:, None] * stride_wv + cols[None, :],
                        mask=v_ok[:, None] & l_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ot + h * V + v[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])


def absorb_query_triton(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, P] (any row and head strides, unit stride on P), w_uk [H, P, L] (unit stride on L) ->
    q_latent [T, H, L], contiguous."""
    t, heads, p = q_nope.shape
    assert w_uk.shape[:2] == (heads, p) and q_nope.stride(2) == 1 and w_uk.stride(2) == 1
    latent = w_uk.shape[2]
    out = torch.empty(t, heads, latent, dtype=q_nope.dtype, device=q_nope.device)
    if t == 0 or heads == 0:
        return out
    block_l = min(64, triton.next_power_of_2(latent))
    _absorb_query_kernel[(heads, triton.cdiv(latent, block_l))](
        q_nope, w_uk, out, t, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1), out.stride(0),
        out.stride(1), P=p, L=latent, BLOCK_T=ROWS, BLOCK_P=min(32, triton.next_power_of_2(p)), BLOCK_L=block_l,
        num_warps=4, **launch_options(q_nope.device))
    return out


def expand_values_triton(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [T, H, L] (unit stride on L), w_uv [H, V, L] (unit stride on L) -> [T, H * V], contiguous."""
    t, heads, latent = o_latent.shape
    assert w_uv.shape[0] == heads and w_uv.shape[2] == latent and o_latent.stride(2) == 1 and w_uv.stride(2) == 1
    v = w_uv.shape[1]
    out = torch.empty(t, heads * v, dtype=o_latent.dtype, device=o_latent.device)
    if t == 0 or heads == 0:
        return out
    block_v = min(16, triton.next_power_of_2(v))
    _expand_values_kernel[(heads, triton.cdiv(v, block_v))](
        o_latent, w_uv, out, t, o_latent.stride(0), o_latent.stride(1), w_uv.stride(0), w_uv.stride(1),
        out.stride(0), V=v, L=latent, BLOCK_T=ROWS, BLOCK_V=block_v, BLOCK_L=min(128, triton.next_power_of_2(latent)),
        num_warps=4, **launch_options(o_latent.device))
    return out
