"""Triton kernel for the decode and verify steps of Mamba-2's selective scan (kernels/mamba2.py has the recurrence
and the PyTorch reference, ssd_recurrent, that the tests compare it with).

One launch advances every listed sequence's state by its rows, in place in the state pool: program (b, h, j) owns
head-dim columns j * BLOCK_P .. of head h of sequence b, whose Q rows are rows[b] .. rows[b] + Q - 1 (Q = 1: a
decode step; Q = 1 + K: a verify step through the CUDA graphs). Its [N, BLOCK_P] float32 slice of the state is
loaded from the sequence's slot once (zeros where keep is 0: a sequence whose first row is its position 0) and
stored back once; for each row it reads x (its columns of head h), dt (already softplus'd and clamped: time_steps)
and the B and C of the head's group (h // (H / G)), and

    S <- exp(dt A_h) S + B (dt x)^T,    y = S^T C          (float32; the layer adds the D skip)

Every number comes from device tensors (no host sync), so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ssd_decode_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, state_ptr, out_ptr, rows_ptr, slots_ptr, keep_ptr,
                       stride_xt, stride_xh, stride_dt, stride_bt, stride_bg, stride_ct, stride_cg, stride_ss,
                       stride_sh, stride_sn, stride_ot, stride_oh, RATIO: tl.constexpr, N: tl.constexpr,
                       P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, Q: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep = tl.load(keep_ptr + b)
    g = h // RATIO
    on = tl.arange(0, BLOCK_N)
    op = j * BLOCK_P + tl.arange(0, BLOCK_P)
    mn = on < N
    mp = op < P
    ptrs = state_ptr + slot * stride_ss + h * stride_sh + on[:, None] * stride_sn + op[None, :]
    mask = mn[:, None] & mp[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0)
    s = tl.where(keep != 0, s, 0.0)
    a = tl.load(a_ptr + h).to(tl.float32)
    for t in tl.static_range(Q):
        r = row + t
        x = tl.load(x_ptr + r * stride_xt + h * stride_xh + op, mask=mp, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + r * stride_dt + h).to(tl.float32)
        bv = tl.load(b_ptr + r * stride_bt + g * stride_bg + on, mask=mn, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + r * stride_ct + g * stride_cg + on, mask=mn, other=0.0).to(tl.float32)
        s = s * tl.exp(dt * a) + bv[:, None] * (dt * x)[None, :]
        y = tl.sum(s * cv[:, None], axis=0)
        tl.store(out_ptr + r * stride_ot + h * stride_oh + op, y, mask=mp)
    tl.store(ptrs, s, mask=mask)


def ssd_decode(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               state: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
               q_len: int = 1) -> None:
    """Sequences of q_len consecutive rows each, starting at `rows` [n], of x [T, H, P], dt [T, H] float32, B, C
    [T, G, N]: each advances the float32 state at `slots` [n] of `state` [S, H, N, P] (from zeros where keep [n] is
    0) by its rows in order and writes their y rows into out [T, H, P] float32."""
    n = rows.shape[0]
    if n == 0:
        return
    H, P = x.shape[1], x.shape[2]
    N = B.shape[2]
    for t in (x, B, C, out):
        assert t.stride(-1) == 1, "rows of unit column stride"
    assert state.dtype == torch.float32 and state.stride(-1) == 1 and out.dtype == torch.float32
    block_n = triton.next_power_of_2(N)
    block_p = min(triton.next_power_of_2(P), max(16, 4096 // block_n))  # (an [N, BLOCK_P] float32 tile)
    grid = (n, H, triton.cdiv(P, block_p))
    _ssd_decode_kernel[grid](
        x, dt, A, B, C, state, out, rows, slots, keep, x.stride(0), x.stride(1), dt.stride(0), B.stride(0),
        B.stride(1), C.stride(0), C.stride(1), state.stride(0), state.stride(1), state.stride(2), out.stride(0),
        out.stride(1), RATIO=H // B.shape[1], N=N, P=P, BLOCK_N=block_n, BLOCK_P=block_p, Q=q_len)
