"""Triton kernel of the one-shot all-reduce over peer memory (kernels/peer_all_reduce.py holds the set-up),
optionally followed by the decoder layer's residual add and RMSNorm, all in one launch.

Each rank's peer-visible buffer holds, for each of two epoch parities, one slot per source rank and row.
One program per row. Program r of every rank, in step:
1. bumps its own epoch counter (local memory) and writes its row into its own slot of every peer's
   buffer, at the parity of that epoch (stores over NVLink);
2. after a CTA barrier, writes the epoch into its flag on every peer (a system-scope release, so the
   row is visible before the flag), then spins until every peer's flag for it holds the same epoch
   (a system-scope acquire);
3. sums the row over the ranks in rank order from its own buffer (in float32, rounded once to the
   activation dtype), so every rank computes bit-identical sums;
4. with NORM, adds the residual and applies RMSNorm with the rounding points of
   fused_ops_triton._rms_norm_kernel.

Why two parities are enough (no second barrier): a rank writes a peer's slot for epoch e + 2 only after
that peer signalled epoch e + 1, which it does only after finishing epoch e's reads of that slot
(kernels are stream-ordered); rows and sources have fixed slots, so programs never share memory.
Every rank must issue the same sequence of these all-reduces with the same row counts, which tensor
parallelism guarantees (every rank runs the same forward).

Flags and counters are int32 and compared for equality, so they may wrap.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin


@triton.jit
def _peer_all_reduce_kernel(
    x_ptr, stride_x,
    res_ptr, stride_res, w_ptr, out_ptr, stride_out, res_out_ptr, stride_res_out,
    buffer_ptrs, flag_ptrs, counter_ptr,
    eps, inv_n,
    RANK: tl.constexpr, WORLD: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_SLOT: tl.constexpr, SOURCE_STRIDE: tl.constexpr, PARITY_STRIDE: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)  # (kernels/pdl.py: nothing is read or written before the previous kernel has ended)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0)

    epoch = tl.load(counter_ptr + row) + 1
    tl.store(counter_ptr + row, epoch)  # this program alone owns this counter
    base = (epoch & 1) * PARITY_STRIDE + row * ROW_SLOT  # this row's slots at this epoch's parity
    # Push: this rank's row goes straight into its slot of every peer's buffer (stores over NVLink
    # are posted; the reads at the end are of local memory).
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = tl.load(buffer_ptrs + r).to(tl.pointer_type(DT))
            tl.store(peer + base + RANK * SOURCE_STRIDE + cols, x, mask=ok)
    tl.debug_barrier()  # the whole row is written before the flag is released
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + row * WORLD + RANK, epoch, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            while tl.atomic_add(own_flags + row * WORLD + r, 0, sem="acquire", scope="sys") != epoch:
                pass
    tl.debug_barrier()

    own = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(DT))
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += x.to(tl.float32)
        else:  # (volatile: the peers wrote it, this SM's L1 may hold an older epoch's row)
            acc += tl.load(own + base + r * SOURCE_STRIDE + cols, mask=ok, other=0.0, volatile=True).to(tl.float32)
    total = acc.to(DT)  # what an all-reduce returns

    if NORM:
        res = tl.load(res_ptr + row.to(tl.int64) * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        h = (total.to(tl.float32) + res).to(DT)  # the new residual stream, rounded like `x + residual`
        tl.store(res_out_ptr + row.to(tl.int64) * stride_res_out + cols, h, mask=ok)
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) * inv_n + eps)
        y = (hf * rstd).to(DT).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, total, mask=ok)


def num_warps_for(n: int) -> int:
    return max(1, min(16, triton.next_power_of_2(n) // 256))


def launch(x, residual, weight, out, residual_out, buffer_ptrs, flag_ptrs, counters, eps: float, rank: int,
           world: int, max_rows: int, row_slot: int) -> None:
    """x [T, N] (unit column stride) -> out (the sum over ranks), or with a residual and weight: out =
    rms_norm(sum + residual) and residual_out = sum + residual."""
    rows, n = x.shape
    norm = residual is not None
    res = residual if norm else x
    res_out = residual_out if norm else out
    w = weight if norm else x
    _peer_all_reduce_kernel[(rows,)](
        x, x.stride(0), res, res.stride(0), w, out, out.stride(0), res_out, res_out.stride(0),
        buffer_ptrs, flag_ptrs, counters, eps, 1.0 / n,
        RANK=rank, WORLD=world, N=n, BLOCK_N=triton.next_power_of_2(n), ROW_SLOT=row_slot,
        SOURCE_STRIDE=max_rows * row_slot, PARITY_STRIDE=world * max_rows * row_slot, NORM=norm, num_warps=num_warps_for(n), enable_fp_fusion=False,
        **launch_options(x.device),
    )
