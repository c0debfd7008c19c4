"""Triton kernel for the decode step of the gated delta rule (kernels/gated_delta_rule.py has the recurrence and
the PyTorch reference, gated_delta_rule_recurrent, that the tests compare it with).

One launch advances every decoding sequence's delta-rule state by its tokens, in place in the state pool:
program (b, h, j) owns value columns j * BLOCK_V .. of value head h of sequence b, whose Q tokens are the rows
rows[b] .. rows[b] + Q - 1 (Q = 1: a decode step; Q = 1 + K: a speculative verify step through the CUDA graphs).
For each token it reads the row's q and k (key head h // (Hv / Hk)), L2-normalises them in float32, applies
decay, delta-rule write and read to its [Dk, BLOCK_V] slice of the sequence's state, and stores the output
columns; the slice is loaded from the slot once (zeros for a sequence whose first row is its position 0) and
stored back once. Every number comes from device tensors (no host sync), so the launch can be captured in a CUDA
graph. With FUSED_GATES the kernel takes the layer's raw a and b projections and computes the decay and write
strength itself (kernels/gated_delta_rule.gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) in b's
dtype), saving their elementwise launches.

`_conv_uniform_kernel` is the short causal convolution of the same steps (kernels/gated_delta_rule.
causal_conv1d_uniform): program (b, j) takes channels j * BLOCK_C .. of sequence b, its K - 1 state inputs from its
slot (zeros where keep is 0) and its Q rows, and writes silu(conv) and the new state. Both convolution kernels add a
per-channel bias with HAS_BIAS (Mamba-2's conv1d; kernels/mamba2.py) and leave out the silu with SILU=False
(LFM2's short convolution; layers/short_conv.py).

`_conv_varlen_kernel` is the same convolution over an eager step's rows, sequences of any lengths back to back
(kernels/gated_delta_rule.causal_conv1d_varlen): program (i, j) takes rows i * BLOCK_T .. and channels j * BLOCK_C ..,
each row reading its window from the step's rows or, before its sequence's first row, from the sequence's state.
`_conv_state_kernel` then gathers, for each (sequence, rows consumed) entry, the state after those rows (the last K - 1
inputs) into a scratch tensor, which the caller copies into the pool: the sequences' new states and any prefix-cache
snapshot taken part-way through a sequence's rows, all read before any slot is written.

A mixed step replayed from a CUDA graph (kernels/gated_delta_rule.RecurrentRows) takes the same kernels from static
buffers: the convolution over every row, `_conv_state_kernel` in its DIRECT form writing each entry's state straight
into the pool (unused entries skipped; the snapshots' launch before the sequences' own), and the recurrent kernel with
a row count per entry (an entry of no rows reads and writes nothing) and SNAPS, which also stores the state after an
entry's first snap_rows rows into its snapshot slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels.fused_ops_triton import _LIBDEVICE_MATH, gated_act

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    libdevice = None


@triton.jit
def _recurrent_row(s, r, h, hk, ok, ov, mk, mv, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, stride_qt, stride_qh,
                   stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh, scale, eps,
                   FUSED_GATES: tl.constexpr, a_log_ptr, dt_bias_ptr, LIBDEVICE: tl.constexpr):
    """One row r of head h: the state slice s [BLOCK_K, BLOCK_V] advanced by it, its out columns stored."""
    q = tl.load(q_ptr + r * stride_qt + hk * stride_qh + ok, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + r * stride_kt + hk * stride_kh + ok, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + r * stride_vt + h * stride_vh + ov, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * stride_gt + h).to(tl.float32)
    beta = tl.load(beta_ptr + r * stride_bt + h).to(tl.float32)
    if FUSED_GATES:  # (g_ptr, beta_ptr: the raw a and b; as kernels/gated_delta_rule.gates)
        x = g + tl.load(dt_bias_ptr + h).to(tl.float32)
        if LIBDEVICE:
            softplus = tl.where(x > 20.0, x, libdevice.log1p(libdevice.exp(x)))
            decay = libdevice.exp(tl.load(a_log_ptr + h).to(tl.float32))
            e = libdevice.exp(-beta)
        else:
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
            decay = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
            e = tl.exp(-beta)
        g = -decay * softplus
        beta = tl.div_rn(1.0, 1.0 + e).to(beta_ptr.dtype.element_ty).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
    q = q * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    s = s * tl.exp(g)
    predicted = tl.sum(s * k[:, None], axis=0)
    delta = (v - predicted) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + r * stride_ot + h * stride_oh + ov, o.to(out_ptr.dtype.element_ty), mask=mv)
    return s


@triton.jit
def _recurrent_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, rows_ptr, slots_ptr, keep_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                             stride_ss, stride_sh, stride_sk, stride_ot, stride_oh, scale, eps,
                             RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_V: tl.constexpr, Q: tl.constexpr, FUSED_GATES: tl.constexpr = False,
                             a_log_ptr=None, dt_bias_ptr=None, LIBDEVICE: tl.constexpr = False, counts_ptr=None,
                             COUNTS: tl.constexpr = False, snap_rows_ptr=None, snap_slots_ptr=None,
                             SNAPS: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep = tl.load(keep_ptr + b)
    hk = h // RATIO
    ok = tl.arange(0, BLOCK_K)
    ov = j * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ok < DK
    mv = ov < DV
    ptrs = state_ptr + slot * stride_ss + h * stride_sh + ok[:, None] * stride_sk + ov[None, :]
    mask = mk[:, None] & mv[None, :]
    if COUNTS:  # (a sequence of no rows, a static buffer's unused entry, reads and writes nothing)
        count = tl.load(counts_ptr + b)
        mask = mask & (ok[:, None] * 0 + count > 0)
    s = tl.load(ptrs, mask=mask, other=0.0)
    s = tl.where(keep != 0, s, 0.0)
    if COUNTS:  # (each sequence its own number of rows, counts[b]: a loop, not unrolled)
        if SNAPS:  # (the state after the first snap_rows[b] rows also into slot snap_slots[b]; 0 rows: none)
            snap_at = tl.load(snap_rows_ptr + b)
            snap_ptrs = (state_ptr + tl.load(snap_slots_ptr + b).to(tl.int64) * stride_ss + h * stride_sh
                         + ok[:, None] * stride_sk + ov[None, :])
        for t in range(0, count):
            s = _recurrent_row(s, row + t, h, hk, ok, ov, mk, mv, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                               stride_ot, stride_oh, scale, eps, FUSED_GATES, a_log_ptr, dt_bias_ptr, LIBDEVICE)
            if SNAPS:
                tl.store(snap_ptrs, s, mask=mask & (ok[:, None] * 0 + (t + 1) == snap_at))
    else:
        for t in tl.static_range(Q):
            s = _recurrent_row(s, row + t, h, hk, ok, ov, mk, mv, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                               stride_ot, stride_oh, scale, eps, FUSED_GATES, a_log_ptr, dt_bias_ptr, LIBDEVICE)
    tl.store(ptrs, s, mask=mask)


@triton.jit
def _conv_uniform_kernel(x_ptr, w_ptr, state_ptr, out_ptr, slots_ptr, keep_ptr, C, stride_xt, stride_wc, stride_ss,
                         stride_sc, stride_ot, Q: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr,
                         LIBDEVICE: tl.constexpr, bias_ptr=None, HAS_BIAS: tl.constexpr = False,
                         SILU: tl.constexpr = True):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep = tl.load(keep_ptr + b)
    row0 = b.to(tl.int64) * Q
    DT: tl.constexpr = x_ptr.dtype.element_ty
    state = state_ptr + slot * stride_ss + c * stride_sc
    for t in tl.static_range(Q):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            # (window position t + j: the state's inputs first, then the step's rows)
            if t + j < K - 1:
                v = tl.load(state + (t + j), mask=mc, other=0.0).to(tl.float32)
                v = tl.where(keep != 0, v, 0.0)
            else:
                v = tl.load(x_ptr + (row0 + (t + j - (K - 1))) * stride_xt + c, mask=mc, other=0.0).to(tl.float32)
            acc += v * tl.load(w_ptr + c * stride_wc + j, mask=mc, other=0.0).to(tl.float32)
        if HAS_BIAS:  # (Mamba-2's conv bias, inside the rounded sum as conv1d adds it)
            acc += tl.load(bias_ptr + c, mask=mc, other=0.0).to(tl.float32)
        y = acc.to(DT).to(tl.float32)
        if SILU:
            y = gated_act(y, 0, LIBDEVICE)  # silu of the rounded convolution
        tl.store(out_ptr + (row0 + t) * stride_ot + c, y.to(out_ptr.dtype.element_ty), mask=mc)
    for i in tl.static_range(K - 1):  # the new state: window positions Q .. Q + K - 2 (read before overwritten)
        if Q + i < K - 1:
            v = tl.load(state + (Q + i), mask=mc, other=0.0)
            v = tl.where(keep != 0, v, 0.0)
        else:
            v = tl.load(x_ptr + (row0 + (Q + i - (K - 1))) * stride_xt + c, mask=mc, other=0.0)
        tl.store(state + i, v.to(state_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _conv_varlen_kernel(x_ptr, w_ptr, state_ptr, out_ptr, row_seq_ptr, starts_ptr, slots_ptr, keep_ptr, T, C,
                        stride_xt, stride_wc, stride_ss, stride_sc, stride_ot, K: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr, HAS_STATE: tl.constexpr, LIBDEVICE: tl.constexpr, bias_ptr=None,
                        HAS_BIAS: tl.constexpr = False, SILU: tl.constexpr = True):
    r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mr, mc = r < T, c < C
    seq = tl.load(row_seq_ptr + r, mask=mr, other=0)
    pos = r - tl.load(starts_ptr + seq, mask=mr, other=0)  # the row's place among its sequence's rows of the step
    if HAS_STATE:
        slot = tl.load(slots_ptr + seq, mask=mr, other=0).to(tl.int64)
        keep = tl.load(keep_ptr + seq, mask=mr, other=0)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        back = j - (K - 1)  # (window position j: the row `back` rows before this one)
        in_rows = mr & (pos + back >= 0)
        v = tl.load(x_ptr + (r + back).to(tl.int64)[:, None] * stride_xt + c[None, :],
                    mask=in_rows[:, None] & mc[None, :], other=0.0).to(tl.float32)
        if HAS_STATE:  # before the sequence's first row: its state's inputs (zeros where keep is 0)
            in_state = mr & (pos + back < 0) & (keep != 0)
            v += tl.load(state_ptr + slot[:, None] * stride_ss + c[None, :] * stride_sc + (pos + j)[:, None],
                         mask=in_state[:, None] & mc[None, :], other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + c * stride_wc + j, mask=mc, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=mc, other=0.0).to(tl.float32)[None, :]
    y = acc.to(DT).to(tl.float32)
    if SILU:
        y = gated_act(y, 0, LIBDEVICE)  # silu of the rounded convolution
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_ot + c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mr[:, None] & mc[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, new_ptr, starts_ptr, consumed_ptr, slots_ptr, keep_ptr, C, stride_xt,
                       stride_ss, stride_sc, stride_ne, stride_nc, K: tl.constexpr, BLOCK_C: tl.constexpr,
                       dest_ptr=None, DIRECT: tl.constexpr = False):
    e = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    start = tl.load(starts_ptr + e).to(tl.int64)
    n = tl.load(consumed_ptr + e)
    slot = tl.load(slots_ptr + e).to(tl.int64)
    keep = tl.load(keep_ptr + e)
    zero = tl.zeros([BLOCK_C], dtype=tl.int64)
    if DIRECT:  # (into the pool at dest[e]; an entry of consumed < 0 is unused and writes nothing)
        mc = mc & (zero + n >= 0)
        out = state_ptr + tl.load(dest_ptr + e).to(tl.int64) * stride_ss + c * stride_sc
    else:
        out = new_ptr + e * stride_ne + c * stride_nc
    for i in tl.static_range(K - 1):  # the state's input i: the row n - (K - 1) + i of the sequence, or before it
        at = zero + (n - (K - 1) + i)
        v = tl.load(x_ptr + (start + at) * stride_xt + c, mask=mc & (at >= 0), other=0.0)
        old = tl.load(state_ptr + slot * stride_ss + c * stride_sc + (at + (K - 1)),
                      mask=mc & (at < 0) & (zero + keep != 0), other=0.0)
        v = tl.where(at >= 0, v, old.to(v.dtype))
        # (DIRECT in place: input i is read from the old state's position n + i, never one written before it)
        tl.store(out + i, v.to(out.dtype.element_ty), mask=mc)


def conv_varlen(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, row_seq: torch.Tensor,
                starts: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
                bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """x [T, C] (unit column stride; sequences back to back, row_seq [T] each row's sequence, starts [B] each one's
    first row), weight [C, K] (bias [C]), state [S, C, K - 1] or None (every sequence from zeros); slots, keep [B] ->
    silu(conv(x)) [T, C] in x's dtype (conv(x) with silu=False). The states are not written: conv_states gathers
    them."""
    (T, C), K = x.shape, weight.shape[1]
    assert x.stride(-1) == 1 and (state is None or state.stride(-1) == 1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_c = min(128, triton.next_power_of_2(C))
    block_t = 16
    # (no state: `starts` stands in for its pointer, which the kernel then never reads)
    _conv_varlen_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
        x, weight, starts if state is None else state, out, row_seq, starts, slots, keep, T, C, x.stride(0),
        weight.stride(0), 0 if state is None else state.stride(0), 0 if state is None else state.stride(1),
        out.stride(0), K=K, BLOCK_T=block_t, BLOCK_C=block_c, HAS_STATE=state is not None,
        LIBDEVICE=_LIBDEVICE_MATH, bias_ptr=bias, HAS_BIAS=bias is not None, SILU=silu)
    return out


def conv_states(x: torch.Tensor, state: torch.Tensor, starts: torch.Tensor, consumed: torch.Tensor,
                slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """For each entry e: the conv state [C, K - 1] after the first consumed[e] rows of the sequence whose rows start
    at starts[e] (row starts[e] + consumed[e] - 1 its last input), continuing from its state at slots[e] (zeros
    where keep[e] is 0) -> [E, C, K - 1] in the state's dtype."""
    E, (C, km1) = starts.shape[0], state.shape[1:]
    new = torch.empty(E, C, km1, dtype=state.dtype, device=state.device)
    if E:
        block_c = min(256, triton.next_power_of_2(C))
        _conv_state_kernel[(E, triton.cdiv(C, block_c))](
            x, state, new, starts, consumed, slots, keep, C, x.stride(0), state.stride(0), state.stride(1),
            new.stride(0), new.stride(1), K=km1 + 1, BLOCK_C=block_c)
    return new


def conv_states_into(x: torch.Tensor, state: torch.Tensor, starts: torch.Tensor, consumed: torch.Tensor,
                     slots: torch.Tensor, keep: torch.Tensor, dest: torch.Tensor) -> None:
    """conv_states written straight into the pool: entry e's state into slot dest[e]; entries of consumed < 0 are
    skipped (a static buffer's unused ones). No entry may read a slot that another entry of the launch writes (an
    entry may write the slot it reads: it reads each input before it writes any earlier one)."""
    E, C = starts.shape[0], state.shape[1]
    if E:
        block_c = min(256, triton.next_power_of_2(C))
        _conv_state_kernel[(E, triton.cdiv(C, block_c))](
            x, state, state, starts, consumed, slots, keep, C, x.stride(0), state.stride(0), state.stride(1),
            0, 0, K=state.shape[2] + 1, BLOCK_C=block_c, dest_ptr=dest, DIRECT=True)


def conv_uniform(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
                 q_len: int, bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """x [n * q_len, C] (unit column stride), weight [C, K] (bias [C]), state [S, C, K - 1]; slots, keep [n] ->
    silu(conv(x)) [n * q_len, C] in x's dtype; each sequence's state at its slot advances by its rows."""
    n, (C, K) = slots.shape[0], weight.shape
    assert x.stride(-1) == 1 and state.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = min(256, triton.next_power_of_2(C))
    _conv_uniform_kernel[(n, triton.cdiv(C, block))](
        x, weight, state, out, slots, keep, C, x.stride(0), weight.stride(0), state.stride(0), state.stride(1),
        out.stride(0), Q=q_len, K=K, BLOCK_C=block, LIBDEVICE=_LIBDEVICE_MATH, bias_ptr=bias,
        HAS_BIAS=bias is not None, SILU=silu)
    return out


def recurrent_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                     keep: torch.Tensor, eps: float = 1e-6, q_len: int = 1,
                     gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
                     counts: torch.Tensor | None = None,
                     snapshots: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Sequences of q_len consecutive rows each, starting at `rows` [B], of q, k [T, Hk, Dk], v [T, Hv, Dv],
    g, beta [T, Hv]: each advances the float32 state at `slots` [B] of `state` [S, Hv, Dk, Dv] (from zeros where
    keep [B] is 0) by its rows in order and writes their out rows [., Hv, Dv]. gate_params (A_log, dt_bias) [Hv]:
    g and beta are the layer's raw a and b, from which the kernel computes the decay and write strength.
    counts [B]: each sequence's number of rows instead (q_len unused; a sequence of 0 rows touches nothing).
    snapshots (rows, slots) [B], with counts: the state after a sequence's first rows[b] rows is also stored at
    slots[b] (rows[b] 0: none)."""
    n = rows.shape[0]
    if n == 0:
        return
    g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, beta))
    hk, dk = k.shape[1], k.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    for t in (q, k, v, out):
        assert t.stride(-1) == 1, "rows of unit column stride"
    assert state.dtype == torch.float32 and state.stride(-1) == 1
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 4096 // block_k))  # (a [Dk, BLOCK_V] float32 tile)
    grid = (n, hv, triton.cdiv(dv, block_v))
    _recurrent_decode_kernel[grid](
        q, k, v, g, beta, state, out, rows, slots, keep,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1), dk ** -0.5, eps,
        RATIO=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, Q=q_len, FUSED_GATES=gate_params is not None,
        a_log_ptr=None if gate_params is None else gate_params[0],
        dt_bias_ptr=None if gate_params is None else gate_params[1], LIBDEVICE=_LIBDEVICE_MATH, counts_ptr=counts,
        COUNTS=counts is not None, snap_rows_ptr=None if snapshots is None else snapshots[0],
        snap_slots_ptr=None if snapshots is None else snapshots[1], SNAPS=snapshots is not None)
