"""Mamba (version 1)'s selective scan, the SSM of Jamba's Mamba layers: PyTorch kernels, with a Triton kernel on
CUDA (kernels/mamba1_triton.py).

Per sequence and layer the scan keeps one state S [D, N] (float32): D the layer's channels, N the state size. For
one token t, with step dt_t [D] >= 0 (softplus of dt_proj's output), A = -exp(A_log) [D, N], and B_t, C_t [N]:

    S <- exp(dt_t[:, None] * A) * S + (dt_t * x_t)[:, None] * B_t[None, :]
    y_t = S C_t                                            (the D skip and the gate are the layer's)

Unlike Mamba-2's scan the decay is per channel and state entry, so there is no chunked matrix form: every form
runs the recurrence token by token (`selective_scan_ref`); on CUDA one Triton launch takes each sequence's rows in a
program per block of channels, decode, verify and prompt rows alike. A row of dt = 0 and x = 0 leaves the state as
it is (the padding of the batched CPU form). `scan_varlen` takes an engine step's flat rows over a pool of state
slots, `scan_uniform` a step of n sequences of q rows each from device tensors only (what a CUDA graph holds); both
follow the Gated DeltaNet kernels' conventions (kernels/gated_delta_rule.py): a sequence whose first row is its
position 0 starts from zeros; a prefix-cache snapshot inside a step's rows takes two passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atlas.kernels.gated_delta_rule import (
    STATE_DTYPE,
    _in_two_phases,
    _length_groups,
    _padded,
    _spans,
    _states_of,
    _upload,
    _with_zero_row,
    use_triton,
)


def selective_scan_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, dt [n, L, D] (dt float32), A [D, N] float32 (negative), B, C [n, L, N], state [n, D, N] float32 (None:
    zeros) -> (y [n, L, D] float32, the final state)."""
    n, L, D = x.shape
    S = x.new_zeros(n, D, A.shape[1], dtype=STATE_DTYPE) if state is None else state.to(STATE_DTYPE)
    ys = []
    for t in range(L):
        d = dt[:, t].float()  # [n, D]
        S = S * torch.exp(d[..., None] * A) + (d * x[:, t].float())[..., None] * B[:, t].float()[:, None, :]
        ys.append((S * C[:, t].float()[:, None, :]).sum(-1))
    return torch.stack(ys, dim=1), S


def _triton_rows(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 pool: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor,
                 keep: torch.Tensor, out: torch.Tensor) -> None:
    from atlas.kernels.mamba1_triton import selective_scan_rows

    selective_scan_rows(x, dt, A, B, C, pool, out, starts, counts, slots, keep.to(torch.int32))


def scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                ssm_state: torch.Tensor | None, query_start_loc: Sequence[int], seq_lens: Sequence[int],
                slots: Sequence[int] | None, splits: Sequence[tuple[int, int, int]] = (),
                cache: dict | None = None) -> torch.Tensor:
    """x, dt [T, D] (dt float32), B, C [T, N] (sequences back to back), ssm_state [slots, D, N] float32 (None: no
    state kept) -> y [T, D] float32; each sequence's final state is written to its slot. `splits` and `cache` as
    gated_delta_rule.causal_conv1d_varlen's."""
    out = x.new_zeros(x.shape, dtype=torch.float32)
    spans = _spans(query_start_loc, seq_lens)
    pool = ssm_state
    if pool is None and use_triton(x):  # (no state kept: a scratch pool, each sequence from zeros)
        pool = x.new_empty(len(spans), x.shape[1], A.shape[1], dtype=STATE_DTYPE)

    def run(spans: list[tuple[int, int, bool]]) -> None:
        live = [b for b, (_, n, _) in enumerate(spans) if n > 0]
        if not live:
            return
        if use_triton(x):
            entry_slots = [slots[b] for b in live] if ssm_state is not None else live
            keep = [spans[b][2] and ssm_state is not None for b in live]
            starts, counts, idx, kept = _upload([spans[b][0] for b in live], [spans[b][1] for b in live],
                                                entry_slots, keep, device=x.device)
            _triton_rows(x, dt, A, B, C, pool, starts, counts, idx, kept, out)
            return
        for group in _length_groups(live, spans, 1):
            p = _padded(group, spans, slots, x.shape[0], x.device, cache)
            state = _states_of(ssm_state, p.slots, p.keep) if ssm_state is not None else None
            y, new = selective_scan_ref(*(_with_zero_row(t)[p.rows] for t in (x, dt)), A,
                                        *(_with_zero_row(t)[p.rows] for t in (B, C)), state=state)
            p.scatter(out, y)
            if ssm_state is not None:
                ssm_state.index_copy_(0, p.slots, new)

    _in_two_phases(run, spans, splits, ssm_state, slots, cache)
    return out


def scan_uniform(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 ssm_state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q_len: int) -> torch.Tensor:
    """x, dt [n * q_len, D], B, C [n * q_len, N] (n sequences of q_len rows each), ssm_state [slots, D, N] float32,
    slots and keep [n] on the device -> y [n * q_len, D] float32. No host value is read: a CUDA graph can hold it."""
    n = slots.shape[0]
    if use_triton(x):
        out = x.new_empty(x.shape, dtype=torch.float32)
        starts = torch.arange(0, n * q_len, q_len, device=x.device)
        _triton_rows(x, dt, A, B, C, ssm_state, starts, torch.full_like(starts, q_len), slots, keep, out)
        return out
    y, new = selective_scan_ref(*(t.view(n, q_len, -1) for t in (x, dt)), A, *(t.view(n, q_len, -1) for t in (B, C)),
                                state=_states_of(ssm_state, slots, keep))
    ssm_state.index_copy_(0, slots, new)
    return y.reshape(x.shape)
