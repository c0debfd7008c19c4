"""Mamba-2's selective state-space scan (the SSD layer of Granite 4.0-H and the other Mamba-2 hybrids): PyTorch
kernels, on every device.

Per sequence and layer a Mamba-2 mixer keeps the short convolution's last inputs (as Gated DeltaNet does:
kernels/gated_delta_rule.causal_conv1d_*) and one state matrix S [N, P] per head (float32), N the state size and P
the head dim. For one token t of one head, with step dt_t >= 0 (softplus of the projection plus dt_bias, clamped to
the layer's time_step_limit) and A = -exp(A_log) < 0:

    S <- exp(dt_t * A) * S + B_t (dt_t * x_t)^T          (B_t, C_t [N]: the head's group's)
    y_t = S^T C_t                                          (the D skip, y + D * x, is the layer's)

`ssd_recurrent` runs exactly that, token by token (a decode step, a verify step). `ssd_chunked` is the same
recurrence in chunks of L tokens (prefill): inside a chunk, with cumulative log-decays a_i = sum_{j <= i} dt_j A,

    Y = ((C B^T) * exp(a_i - a_j) * causal) (dt X) + exp(a) * (C S0),   S <- exp(a_L) S0 + (B * exp(a_L - a))^T (dt X).

A row of dt = 0 and x = 0 leaves the state as it is (decay exp(0), nothing written): the padding of a batched
prefill is such rows. `ssd_varlen` takes an engine step's flat rows over a pool of state slots (the eager step:
decodes together through the recurrent form, longer rows through the chunked one, grouped by length), and
`ssd_uniform` a step of n sequences of q rows each from device tensors only (what a CUDA graph holds). On CUDA
the recurrent form of both is one Triton launch (kernels/mamba2_triton.py); the chunked form is PyTorch everywhere.
Both follow the Gated DeltaNet kernels' conventions (a sequence whose first row is its position 0 starts from
zeros; a prefix-cache snapshot inside a step's rows takes two passes), sharing their step-over-slots helpers.

Written from the recurrence above; the tests compare the layer with transformers' own torch functions, and the
Triton kernel with ssd_recurrent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from atlas.kernels.gated_delta_rule import (
    STATE_DTYPE,
    _decode_indices,
    _in_two_phases,
    _length_groups,
    _padded,
    _spans,
    _states_of,
    _with_zero_row,
    use_triton,
)

DEFAULT_CHUNK = 64


def time_steps(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """A Mamba-2 layer's steps from its raw dt projection [T, H]: softplus(dt + dt_bias) clamped to `limit`,
    float32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(limit[0], limit[1])


def per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [..., G, N] -> [..., heads, N]: head h reads group h // (heads / G)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def ssd_recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, L, H, P], dt [n, L, H] float32, A [H] float32 (negative), B, C [n, L, G, N] (G groups of heads),
    state [n, H, N, P] float32 (None: zeros) -> (y [n, L, H, P] float32, the final state)."""
    n, L, H, P = x.shape
    B, C = per_head(B, H), per_head(C, H)
    S = x.new_zeros(n, H, B.shape[-1], P, dtype=STATE_DTYPE) if state is None else state.to(STATE_DTYPE)
    ys = []
    for t in range(L):
        d = dt[:, t].float()  # [n, H]
        S = S * torch.exp(d * A)[..., None, None] + B[:, t].float()[..., None] * (d[..., None] * x[:, t].float()
                                                                                   )[:, :, None, :]
        ys.append(torch.einsum("nhsp,nhs->nhp", S, C[:, t].float()))
    return torch.stack(ys, dim=1), S


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                state: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd_recurrent's function in chunks of `chunk` tokens (the same recurrence, another order of sums)."""
    n, L, H, P = x.shape
    N = B.shape[-1]
    B, C = per_head(B, H), per_head(C, H)
    pad = -L % chunk
    X = F.pad(x.float() * dt.float()[..., None], (0, 0, 0, 0, 0, pad))  # dt x, zero rows after L
    a = F.pad(dt.float() * A, (0, 0, 0, pad))
    Bf, Cf = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (B, C))
    c = (L + pad) // chunk
    X, Bf, Cf = (t.view(n, c, chunk, H, -1) for t in (X, Bf, Cf))
    acum = a.view(n, c, chunk, H).cumsum(dim=2)  # [n, c, l, H]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    diff = acum[:, :, :, None, :] - acum[:, :, None, :, :]  # [n, c, l, s, H]: a_l - a_s
    decay = torch.exp(diff.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    scores = torch.einsum("nclhk,ncshk->nclsh", Cf, Bf) * decay
    y = torch.einsum("nclsh,ncshp->nclhp", scores, X)
    to_end = torch.exp(acum[:, :, -1:, :] - acum)  # [n, c, l, H]
    written = torch.einsum("nclhk,nclh,nclhp->nchkp", Bf, to_end, X)  # each chunk's own writes
    S = x.new_zeros(n, H, N, P, dtype=STATE_DTYPE) if state is None else state.to(STATE_DTYPE)
    for i in range(c):
        y[:, i] += torch.einsum("nlhk,nhkp->nlhp", Cf[:, i], S) * torch.exp(acum[:, i])[..., None]
        S = S * torch.exp(acum[:, i, -1])[..., None, None] + written[:, i]
    return y.reshape(n, c * chunk, H, P)[:, :L], S


def ssd_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               ssm_state: torch.Tensor | None, query_start_loc: Sequence[int], seq_lens: Sequence[int],
               slots: Sequence[int] | None, chunk: int = DEFAULT_CHUNK, splits: Sequence[tuple[int, int, int]] = (),
               cache: dict | None = None) -> torch.Tensor:
    """x [T, H, P], dt [T, H] float32 (time_steps'), B, C [T, G, N] (sequences back to back), ssm_state
    [slots, H, N, P] float32 (None: no state kept) -> y [T, H, P] float32; each sequence's final state is written to
    its slot. `splits` and `cache` as gated_delta_rule.causal_conv1d_varlen's."""
    out = x.new_empty(x.shape, dtype=torch.float32)
    spans = _spans(query_start_loc, seq_lens)

    def run(spans: list[tuple[int, int, bool]]) -> None:
        decodes = [b for b, (_, n, _) in enumerate(spans) if n == 1] if ssm_state is not None else []
        if decodes:
            rows, idx, keep = _decode_indices(decodes, spans, slots, x.device, cache)
        if decodes and use_triton(x):
            from atlas.kernels.mamba2_triton import ssd_decode

            ssd_decode(x, dt, A, B, C, ssm_state, out, rows, idx, keep.to(torch.int32))
        elif decodes:
            y, new = ssd_recurrent(*(t.index_select(0, rows)[:, None] for t in (x, dt)), A,
                                   *(t.index_select(0, rows)[:, None] for t in (B, C)),
                                   state=_states_of(ssm_state, idx, keep))
            out.index_copy_(0, rows, y[:, 0])
            ssm_state.index_copy_(0, idx, new)
        done = set(decodes)
        longer = [b for b, (_, n, _) in enumerate(spans) if b not in done and n > 0]
        for group in _length_groups(longer, spans, chunk):
            p = _padded(group, spans, slots, x.shape[0], x.device, cache)
            state = _states_of(ssm_state, p.slots, p.keep) if ssm_state is not None else None
            y, new = ssd_chunked(*(_with_zero_row(t)[p.rows] for t in (x, dt)), A,
                                 *(_with_zero_row(t)[p.rows] for t in (B, C)), state=state, chunk=chunk)
            p.scatter(out, y)
            if ssm_state is not None:
                ssm_state.index_copy_(0, p.slots, new)

    _in_two_phases(run, spans, splits, ssm_state, slots, cache)
    return out


def ssd_uniform(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                ssm_state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q_len: int) -> torch.Tensor:
    """x [n * q_len, H, P], dt [n * q_len, H] float32, B, C [n * q_len, G, N] (n sequences of q_len rows each),
    ssm_state [slots, H, N, P] float32, slots and keep [n] on the device -> y [n * q_len, H, P] float32; each
    sequence's state advances by its rows token by token. No host value is read: a CUDA graph can hold it."""
    n = slots.shape[0]
    if use_triton(x):
        from atlas.kernels.mamba2_triton import ssd_decode

        out = x.new_empty(x.shape, dtype=torch.float32)
        rows = torch.arange(0, n * q_len, q_len, device=x.device)
        ssd_decode(x, dt, A, B, C, ssm_state, out, rows, slots, keep.to(torch.int32), q_len=q_len)
        return out
    y, new = ssd_recurrent(*(t.view(n, q_len, *t.shape[1:]) for t in (x, dt)), A,
                           *(t.view(n, q_len, *t.shape[1:]) for t in (B, C)),
                           state=_states_of(ssm_state, slots, keep))
    ssm_state.index_copy_(0, slots, new)
    return y.reshape(x.shape)
