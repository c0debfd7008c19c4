"""Triton kernel of the one-shot all-reduce over peer memory (kernels/peer_all_reduce.py holds the set-up),
optionally followed by the decoder layer's residual add and RMSNorm, all in one launch.

Each rank's peer-visible buffer holds, for each of two epoch parities, one slot per source rank and row.
A slot holds either a row or, element by element, the EMPTY bit pattern (negative zero, which no row
sent here contains: senders write -0.0 as +0.0). The data is its own flag, so no fence or flag write
stands between a rank's stores and its peers' reads. One program per row. Program r of every rank:
1. bumps its own epoch counter (local memory) and writes its row into its own slot of every peer's
   buffer, at the parity of that epoch (posted stores over NVLink);
2. polls each peer's slot in its own buffer until no element is EMPTY, then writes EMPTY back over it;
3. sums the row over the ranks in rank order (in float32, rounded once to the activation dtype), so
   every rank computes bit-identical sums;
4. with NORM, adds the residual and applies RMSNorm with the rounding points of
   fused_ops_triton._rms_norm_kernel.

Why two parities are enough: a peer writes a rank's slot for epoch e + 2 only after it has read that
rank's row of epoch e + 1, which the rank writes only after its kernel of epoch e (the reads and the
EMPTY written over them) has ended (kernels are stream-ordered), so the slot is EMPTY again before the
peer's next row for it arrives; and a slot holds EMPTY or the current epoch's row, never an older one.
Each element is stored and loaded whole, so a poll may see a row half-arrived but never a torn
element. Rows and sources have fixed slots, so programs never share memory. Every rank must issue the
same sequence of these all-reduces with the same row counts, which tensor parallelism guarantees
(every rank runs the same forward).

The epoch counters are int32; only their parity is used, so they may wrap.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin


@triton.jit
def push_slots(rows, row_ok, buffer_ptrs, counter_ptr, RANK: tl.constexpr, WORLD: tl.constexpr,
               ROW_SLOT: tl.constexpr, SOURCE_STRIDE: tl.constexpr, PARITY_STRIDE: tl.constexpr):
    """Step 1 done by the kernel that computes the rows about to be all-reduced (a GEMV's epilogue,
    push_tile), part one, early in that kernel (after its PDL wait): (every rank's buffer address
    [next_power_of_2(WORLD)], this rank's slot offsets for `rows` [R] at the parity of the all-reduce that
    takes them next: their counters + 1). The epoch argument above holds as is: such a kernel runs after the
    rank's previous all-reduce of these rows has ended."""
    ranks = tl.arange(0, triton.next_power_of_2(WORLD))
    peers = tl.load(buffer_ptrs + ranks, mask=ranks < WORLD, other=0)
    epoch = tl.load(counter_ptr + rows, mask=row_ok, other=0) + 1
    return peers, (epoch & 1) * PARITY_STRIDE + rows * ROW_SLOT + RANK * SOURCE_STRIDE


@triton.jit
def push_tile(y, peers, slots, row_ok, cols, col_ok, own_ptr, RANK: tl.constexpr, WORLD: tl.constexpr,
              EMPTY: tl.constexpr):
    """Part two: y [R, C] (the activation dtype) at the rows of push_slots' `slots` [R] and columns `cols` [C]
    (masks alike) goes into this rank's slots of every peer's buffer, the all-reduce's step 1."""
    BITS: tl.constexpr = own_ptr.dtype.element_ty
    bits = y.to(BITS, bitcast=True)
    bits = tl.where(bits == EMPTY, tl.zeros_like(bits), bits)
    ranks = tl.arange(0, triton.next_power_of_2(WORLD))
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = tl.sum(tl.where(ranks == r, peers, 0), axis=0).to(tl.pointer_type(BITS))
            peer = tl.multiple_of(peer, 16)
            tl.store(peer + slots[:, None] + cols[None, :], bits, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _peer_all_reduce_kernel(
    x_ptr, stride_x,
    res_ptr, stride_res, w_ptr, out_ptr, stride_out, res_out_ptr, stride_res_out,
    buffer_ptrs, own_ptr, counter_ptr,
    eps, inv_n,
    RANK: tl.constexpr, WORLD: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, EMPTY: tl.constexpr,
    ROW_SLOT: tl.constexpr, SOURCE_STRIDE: tl.constexpr, PARITY_STRIDE: tl.constexpr, NORM: tl.constexpr,
    PUSHED: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)  # (kernels/pdl.py: nothing is read or written before the previous kernel has ended)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    DT: tl.constexpr = x_ptr.dtype.element_ty
    BITS: tl.constexpr = own_ptr.dtype.element_ty  # an integer type of DT's width: the slots' elements
    bits = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0).to(BITS, bitcast=True)
    bits = tl.where(bits == EMPTY, tl.zeros_like(bits), bits)  # -0.0 is EMPTY: send +0.0 (and add it here too)

    epoch = tl.load(counter_ptr + row) + 1
    tl.store(counter_ptr + row, epoch)  # this program alone owns this counter
    base = (epoch & 1) * PARITY_STRIDE + row * ROW_SLOT  # this row's slots at this epoch's parity
    # Push: this rank's row goes straight into its slot of every peer's buffer (PUSHED: the kernel that
    # computed the row has done it, push_tile).
    for r in tl.static_range(WORLD):
        if r != RANK and not PUSHED:
            # (aligned like the own buffer: the row goes out in 16-byte stores, not one per element)
            peer = tl.multiple_of(tl.load(buffer_ptrs + r).to(tl.pointer_type(BITS)), 16)
            tl.store(peer + base + RANK * SOURCE_STRIDE + cols, bits, mask=ok)

    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += bits.to(DT, bitcast=True).to(tl.float32)
        else:
            slot = own_ptr + base + r * SOURCE_STRIDE + cols
            # (volatile: the peer writes it while this program reads; each poll goes to memory)
            got = tl.load(slot, mask=ok, other=0, volatile=True)
            while tl.sum((got == EMPTY).to(tl.int32), axis=0) != 0:
                got = tl.load(slot, mask=ok, other=0, volatile=True)
            tl.store(slot, tl.full([BLOCK_N], EMPTY, BITS), mask=ok)  # ready for epoch + 2
            acc += got.to(DT, bitcast=True).to(tl.float32)
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


def launch(x, residual, weight, out, residual_out, buffer_ptrs, own_bits, counters, eps: float, rank: int,
           world: int, max_rows: int, row_slot: int, pushed: bool = False) -> None:
    """x [T, N] (unit column stride) -> out (the sum over ranks), or with a residual and weight: out =
    rms_norm(sum + residual) and residual_out = sum + residual. `own_bits`: this rank's buffer viewed as
    the integer type of x's width (kernels/peer_all_reduce.py: PeerAllReduce.own_bits). pushed: the kernel
    that computed x has sent it to the peers (push_tile)."""
    rows, n = x.shape
    norm = residual is not None
    res = residual if norm else x
    res_out = residual_out if norm else out
    w = weight if norm else x
    _peer_all_reduce_kernel[(rows,)](
        x, x.stride(0), res, res.stride(0), w, out, out.stride(0), res_out, res_out.stride(0),
        buffer_ptrs, own_bits, counters, eps, 1.0 / n,
        RANK=rank, WORLD=world, N=n, BLOCK_N=triton.next_power_of_2(n), EMPTY=empty_bits(own_bits.element_size()),
        ROW_SLOT=row_slot, SOURCE_STRIDE=max_rows * row_slot, PARITY_STRIDE=world * max_rows * row_slot,
        NORM=norm, PUSHED=pushed, num_warps=num_warps_for(n), enable_fp_fusion=False, **launch_options(x.device),
    )


def empty_bits(itemsize: int) -> int:
    """-0.0's bit pattern read as a signed integer of `itemsize` bytes: the EMPTY mark of a slot element."""
    return -(1 << (8 * itemsize - 1))
