"""Triton kernel for Mamba (version 1)'s selective scan (kernels/mamba1.py has the recurrence and the PyTorch
reference, selective_scan_ref, that the tests compare it with).

One launch advances every listed sequence's state by its rows, in place in the state pool: program (b, j) owns
channels j * BLOCK_D .. of sequence b, whose rows are starts[b] .. starts[b] + counts[b] - 1 (one row: a decode step;
a few: a verify step; many: a prompt chunk). Its [BLOCK_D, N] float32 slice of the state is loaded from the sequence's
slot once (zeros where keep is 0) and stored back once; for each row it reads x and dt (already softplus'd) of its
channels and the row's B and C, and

    S <- exp(dt[:, None] * A) * S + (dt * x)[:, None] * B[None, :],    y = S C     (float32)

Every number comes from device tensors (no host sync), so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _selective_scan_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, state_ptr, out_ptr, starts_ptr, counts_ptr, slots_ptr,
                           keep_ptr, D, stride_xt, stride_dt, stride_bt, stride_ct, stride_ss, stride_sd, stride_ot,
                           N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    md, mn = d < D, n < N
    mask = md[:, None] & mn[None, :]
    start = tl.load(starts_ptr + b).to(tl.int64)
    count = tl.load(counts_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep = tl.load(keep_ptr + b)
    ptrs = state_ptr + slot * stride_ss + d[:, None] * stride_sd + n[None, :]
    live = mask & (d[:, None] * 0 + count > 0)  # (an entry of no rows reads and writes nothing)
    s = tl.load(ptrs, mask=live, other=0.0)
    s = tl.where(keep != 0, s, 0.0)
    a = tl.load(a_ptr + d[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
    for t in range(0, count):
        r = start + t
        x = tl.load(x_ptr + r * stride_xt + d, mask=md, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + r * stride_dt + d, mask=md, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + r * stride_bt + n, mask=mn, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + r * stride_ct + n, mask=mn, other=0.0).to(tl.float32)
        s = s * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * bv[None, :]
        y = tl.sum(s * cv[None, :], axis=1)
        tl.store(out_ptr + r * stride_ot + d, y, mask=md)
    tl.store(ptrs, s, mask=live)


def selective_scan_rows(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        state: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                        slots: torch.Tensor, keep: torch.Tensor) -> None:
    """Sequences of counts[b] consecutive rows starting at starts[b] of x, dt [T, D], B, C [T, N]: each advances the
    float32 state at slots[b] of `state` [S, D, N] (from zeros where keep[b] is 0) by its rows in order and writes
    their y rows into out [T, D] float32. A [D, N] float32, contiguous."""
    n = starts.shape[0]
    if n == 0:
        return
    D, N = A.shape
    for t in (x, dt, B, C, out):
        assert t.stride(-1) == 1, "rows of unit column stride"
    assert state.dtype == torch.float32 and state.stride(-1) == 1 and A.is_contiguous()
    block_n = triton.next_power_of_2(N)
    block_d = max(16, min(128, 2048 // block_n))  # (a [BLOCK_D, N] float32 tile)
    _selective_scan_kernel[(n, triton.cdiv(D, block_d))](
        x, dt, A, B, C, state, out, starts, counts, slots, keep, D, x.stride(0), dt.stride(0), B.stride(0),
        C.stride(0), state.stride(0), state.stride(1), out.stride(0), N=N, BLOCK_D=block_d, BLOCK_N=block_n)
