"""Gated DeltaNet (the linear-attention layers of Qwen3-Next and Qwen3.5): PyTorch reference kernels.

Per sequence and layer two pieces of state carry from step to step:
- the conv state: the last K - 1 inputs of the short depthwise causal convolution ([C, K - 1], model dtype);
- the delta-rule state S: one [Dk, Dv] matrix per value head (float32, as the reference keeps it).

For one token t of one head, with q_t, k_t L2-normalised (then q_t scaled by Dk^-1/2), decay g_t <= 0 (log
space) and write strength beta_t in (0, 1):

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T          (the delta rule: write only what S mispredicts)
    o_t = S^T q_t

`gated_delta_rule_recurrent` runs exactly that, token by token (the decode step). `gated_delta_rule_chunked` is
the same recurrence in chunks of C tokens (prefill): inside a chunk, with cumulative log-decays G_i and the
decay ratios D_ij = exp(G_i - G_j) (i >= j), the C writes are one triangular solve,

    (I + strict_lower(diag(beta) K K^T * D)) [U | W] = [diag(beta) V | diag(beta) K * exp(G)]

after which, from the state S at the chunk's start,

    V' = U - W S,   O = (Q * exp(G)) S + (Q K^T * D * causal) V',   S <- exp(G_C) S + (K * exp(G_C - G))^T V'.

Both take batched [B, L, H, D] tensors. `gated_delta_rule_varlen` and `causal_conv1d_varlen` take an engine
step's flat rows (sequences back to back, `query_start_loc`) and read and write each sequence's state in a pool
of slots; decodes go through the single-step form together, longer rows (prefill chunks) through the chunked form,
batched: grouped by length (in chunks, rounded up to a power of two) and padded to the longest of their group with
zero rows, which leave the state as it is. A sequence whose first row is its position 0 starts from a zero state, whatever its
slot holds (a slot is reused without being cleared).

These are the oracle the GPU kernels are tested against; on the CPU they are the kernels. Written from the
recurrence above; the tests compare them with transformers' own torch functions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atlas.errors import ConfigError
from atlas.host_copy import to_device
from atlas.kernels import settings
from atlas.kernels.fused_ops import MAX_TRITON_HIDDEN, as_rows

STATE_DTYPE = torch.float32  # the delta-rule state (the reference models keep it in float32)
DEFAULT_CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the reference models' form, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             normalize_qk: bool) -> tuple[torch.Tensor, ...]:
    """[B, L, H*, D] inputs -> float32 [B, H, L, D] (q/k heads repeated up to the value heads, normalised, q
    scaled), g and beta [B, H, L]."""
    hk, hv = k.shape[2], v.shape[2]
    if hv != hk:  # each key head serves hv / hk consecutive value heads
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(torch.float32).contiguous() for x in (q, k, v, g, beta))
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None, normalize_qk: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], g, beta [B, L, Hv], state [B, Hv, Dk, Dv] (None: zeros) ->
    (out [B, L, Hv, Dv] in q's dtype, final state [B, Hv, Dk, Dv] float32). Token by token."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize_qk)
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    s = (torch.zeros(B, H, Dk, Dv, dtype=STATE_DTYPE, device=v.device) if state is None
         else state.to(STATE_DTYPE).clone())
    out = torch.empty(B, H, L, Dv, dtype=torch.float32, device=v.device)
    for t in range(L):
        s = s * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = (s * k_t[..., None]).sum(dim=-2)  # S^T k  [B, H, Dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        s = s + k_t[..., None] * delta[..., None, :]
        out[:, :, t] = (s * q[:, :, t, :, None]).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(out_dtype), s


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor | None = None, normalize_qk: bool = True,
                             chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as gated_delta_rule_recurrent, computed chunk by chunk (see the module docstring)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize_qk)
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    pad = -L % chunk
    if pad:  # zero rows at the end: g = 0, beta = 0 write nothing and decay nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (L + pad) // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B, H, n, chunk, *x.shape[3:])

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    cum = g.cumsum(dim=-1)  # G_i, per chunk
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    ratio = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()  # D_ij, 0 above
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * ratio  # its strict lower part; the solve takes the diagonal as 1
    rhs = torch.cat([v * beta[..., None], kb * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :Dv], solved[..., Dv:]
    scores = (q @ k.transpose(-1, -2)) * ratio  # causal, diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    s = (torch.zeros(B, H, Dk, Dv, dtype=STATE_DTYPE, device=v.device) if state is None
         else state.to(STATE_DTYPE).clone())
    out = torch.empty(B, H, n, chunk, Dv, dtype=torch.float32, device=v.device)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ s
        out[:, :, c] = q_decayed[:, :, c] @ s + scores[:, :, c] @ v_new
        s = s * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    out = out.reshape(B, H, n * chunk, Dv)[:, :, :L]
    return out.transpose(1, 2).contiguous().to(out_dtype), s


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                      activation: bool = True, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of x [B, C, L] with weight [C, K] (and bias [C]: Mamba-2's), after the K - 1
    inputs of `state` [B, C, K - 1] (None: zeros). -> (silu(conv) [B, C, L] in x's dtype (no activation with
    activation=False), the new state: the last K - 1 inputs [B, C, K - 1])."""
    B, C, L = x.shape
    K = weight.shape[-1]
    if state is None:
        state = x.new_zeros(B, C, K - 1)
    window = torch.cat([state.to(x.dtype), x], dim=-1)  # [B, C, K - 1 + L]
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, groups=C)  # [B, C, L]
    if activation:
        out = F.silu(out)
    return out.to(x.dtype), window[:, :, window.shape[-1] - (K - 1):]


def rms_norm_gated_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The output norm of a Gated DeltaNet layer: RMSNorm of x [N, D] (float32, rounded to x's dtype, scaled by
    weight), times silu(gate) in float32, rounded to x's dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * x32.to(dtype)
    return (y * F.silu(gate.float())).to(dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_gated_ref's function: one Triton launch on CUDA (kernels/fused_ops_triton.py's RMSNorm kernel with
    its gate), the reference elsewhere."""
    if use_triton(x) and x.dtype == weight.dtype and x.shape[-1] <= MAX_TRITON_HIDDEN:
        from atlas.kernels.fused_ops_triton import rms_norm_triton

        return rms_norm_triton(as_rows(x), weight.contiguous(), eps, gate=as_rows(gate)).view(x.shape)
    return rms_norm_gated_ref(x, gate, weight, eps)


# --------------------------------------------------------------------------------------------------
# A step's flat rows over a pool of state slots
# --------------------------------------------------------------------------------------------------

def _spans(query_start_loc: Sequence[int], seq_lens: Sequence[int]) -> list[tuple[int, int, bool]]:
    """(first row, rows, whether it continues from its state) of each sequence of the step."""
    spans = []
    for b in range(len(query_start_loc) - 1):
        a, e = query_start_loc[b], query_start_loc[b + 1]
        spans.append((a, e - a, seq_lens[b] - (e - a) > 0))
    return spans


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                         query_start_loc: Sequence[int], seq_lens: Sequence[int], slots: Sequence[int] | None,
                         splits: Sequence[tuple[int, int, int]] = (), cache: dict | None = None,
                         bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """x [T, C] (sequences back to back), weight [C, K] (and bias [C]), conv_state [slots, C, K - 1] (None: no state
    kept; every sequence starts from zeros) -> silu(conv(x)) [T, C] (conv(x) with silu=False); each sequence's new
    state is written to its slot.
    `splits` (with a state kept): (sequence, rows, slot) whose state after its first `rows` rows is copied to that
    slot as well (a prefix-cache snapshot inside a prompt chunk). `cache`: the step's index tensors, built by its
    first layer and reused by the others (AttentionMetadata.varlen_cache)."""
    spans = _spans(query_start_loc, seq_lens)
    if use_triton(x) and x.shape[0] == sum(n for _, n, _ in spans) and x.stride(-1) == 1 and weight.stride(-1) == 1:
        return _conv_through_triton(x, weight, conv_state, spans, slots, splits, cache, bias, silu)
    out = torch.empty_like(x)
    _in_two_phases(lambda spans: _conv_spans(x, weight, conv_state, spans, slots, out, cache, bias, silu), spans,
                   splits, conv_state, slots, cache)
    return out


def _conv_through_triton(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                         spans: list[tuple[int, int, bool]], slots: Sequence[int] | None,
                         splits: Sequence[tuple[int, int, int]], cache: dict | None,
                         bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """causal_conv1d_varlen on CUDA: one launch over the rows, one gathering each sequence's new state and each
    snapshot's (a state is its last K - 1 inputs, so a snapshot needs no second pass), one copy into the pool."""
    from atlas.kernels.gated_delta_rule_triton import conv_states, conv_varlen

    kept = conv_state is not None

    def build() -> list[torch.Tensor]:
        # (entries: every sequence, then each snapshot's sequence again; the first len(spans) are the sequences)
        snaps = list(splits) if kept else []
        seqs = [*range(len(spans)), *(b for b, _, _ in snaps)]
        seq_slots = list(slots) if kept else [0] * len(spans)
        return _upload([b for b, (_, n, _) in enumerate(spans) for _ in range(n)], [spans[b][0] for b in seqs],
                       [n for _, n, _ in spans] + [r for _, r, _ in snaps], [seq_slots[b] for b in seqs],
                       [int(spans[b][2]) for b in seqs], seq_slots + [slot for _, _, slot in snaps], device=x.device)

    row_seq, e_starts, consumed, e_slots, e_keep, dst = _cached(cache, ("conv", kept), build)
    n = len(spans)
    out = conv_varlen(x, weight, conv_state, row_seq, e_starts[:n], e_slots[:n], e_keep[:n], bias, silu)
    if kept:
        conv_state.index_copy_(0, dst, conv_states(x, conv_state, e_starts, consumed, e_slots, e_keep))
    return out


def _cached(cache: dict | None, key, build):
    """build(), kept in a step's cache under key (the same for every layer of the step)."""
    if cache is None:
        return build()
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = build()
    return hit


def _in_two_phases(run, spans: list[tuple[int, int, bool]], splits: Sequence[tuple[int, int, int]],
                   pool: torch.Tensor | None, slots: Sequence[int] | None, cache: dict | None = None,
                   run_tails=None) -> None:
    """run(spans) over a step's sequences; where `splits` name (sequence, rows, slot), in two passes: the first
    `rows` rows of those sequences (the others whole), their states copied from their slots to the named slots,
    then the rest of their rows, continuing from the state the first pass left: run(spans) again, or
    run_tails([(sequence, first row, rows)]) where given."""
    if not splits or pool is None:
        run(spans)
        return
    first, second = list(spans), [(a, 0, True) for a, _, _ in spans]
    for b, rows, _ in splits:
        a, n, cont = spans[b]
        if not 0 < rows < n or first[b] != spans[b]:
            raise RuntimeError(f"a state snapshot after {rows} of a sequence's {n} rows in a step (at most one a "
                               "sequence, inside its rows)")
        first[b], second[b] = (a, rows, cont), (a + rows, n - rows, True)
    run(first)
    src, dst = _cached(cache, ("splits", tuple(splits)), lambda: _upload(
        [slots[b] for b, _, _ in splits], [slot for _, _, slot in splits], device=pool.device))
    pool.index_copy_(0, dst, pool.index_select(0, src))
    if run_tails is not None:
        run_tails([(b, a, n) for b, (a, n, _) in enumerate(second) if n])
    else:
        run(second)


def _conv_spans(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                spans: list[tuple[int, int, bool]], slots: Sequence[int] | None, out: torch.Tensor,
                cache: dict | None = None, bias: torch.Tensor | None = None, silu: bool = True) -> None:
    """causal_conv1d_varlen over the sequences' (first row, rows, continues) spans (rows 0: skipped)."""
    decodes = [b for b, (_, n, _) in enumerate(spans) if n == 1]
    if decodes and conv_state is not None:
        rows, idx, keep = _decode_indices(decodes, spans, slots, x.device, cache)
        state = _states_of(conv_state, idx, keep)
        y, new = causal_conv1d_ref(x.index_select(0, rows)[:, :, None], weight, state, activation=silu, bias=bias)
        out.index_copy_(0, rows, y[:, :, 0])
        conv_state.index_copy_(0, idx, new.to(conv_state.dtype))
    else:
        decodes = []
    done = set(decodes)
    longer = [b for b, (_, n, _) in enumerate(spans) if b not in done and n > 0]
    for group in _length_groups(longer, spans, 1):
        p = _padded(group, spans, slots, x.shape[0], x.device, cache)
        padded = _with_zero_row(x)[p.rows]  # [B, L, C], zeros past each sequence's rows
        K = weight.shape[-1]
        state = None
        if conv_state is not None:
            idx, lens = p.slots, p.lens
            state = _states_of(conv_state, idx, p.keep)
        y, _ = causal_conv1d_ref(padded.transpose(1, 2), weight, state, activation=silu, bias=bias)
        p.scatter(out, y.transpose(1, 2))
        if conv_state is not None:  # (each sequence's last K - 1 inputs: window positions len .. len + K - 2)
            window = torch.cat([state.to(x.dtype), padded.transpose(1, 2)], dim=-1)
            at = (lens[:, None] + torch.arange(K - 1, device=x.device))[:, None, :].expand(-1, window.shape[1], -1)
            conv_state.index_copy_(0, idx, window.gather(2, at).to(conv_state.dtype))


def fla_chunk_kernel():
    """flash-linear-attention's chunked gated delta rule (`--tuning gdn_prefill=fla`), or a ConfigError naming the
    package to install."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise ConfigError(f"--tuning gdn_prefill=fla runs flash-linear-attention's kernel, which does not import "
                          f"here ({exc}): `pip install flash-linear-attention`, or drop the knob (gdn_prefill=atlas)"
                          ) from exc
    return chunk_gated_delta_rule


def _prefill_through_fla() -> bool:
    """Whether prompt chunks on CUDA go through flash-linear-attention's chunk kernel (`--tuning gdn_prefill`:
    fla, or auto where the package imports)."""
    knob = settings.tuning.gdn_prefill
    return knob == "fla" or (knob == "auto" and _fla_imports())


@functools.cache
def _fla_imports() -> bool:
    try:
        fla_chunk_kernel()
    except ConfigError:
        return False
    return True


def _chunked_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 ssm_state: torch.Tensor | None, spans: list[tuple[int, int, bool]], seqs: list[int],
                 slots: Sequence[int] | None, out: torch.Tensor, cache: dict | None = None) -> None:
    """The sequences `seqs` of a step (each longer than one row) in one call of flash-linear-attention's varlen chunk
    kernel (L2-normalised q and k, q scaled by Dk^-1/2, from each slot's state or zeros): out rows and final
    states written as gated_delta_rule_varlen's loop does."""
    kernel = fla_chunk_kernel()
    plan = _cached(cache, ("fla", tuple(spans[b] for b in seqs), ssm_state is not None),
                   lambda: _FlaPlan.build(spans, seqs, slots if ssm_state is not None else None, kernel, v.device))
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    if ssm_state is not None:
        state = _states_of(ssm_state, plan.slots, plan.keep)
    else:
        state = torch.zeros(len(seqs), hv, dk, dv, dtype=STATE_DTYPE, device=v.device)
    if plan.first is not None:  # (rows in one run: views, no gather)
        inputs = [x.narrow(0, plan.first, plan.num_rows)[None] for x in (q, k, v, g, beta)]
    else:
        inputs = [x.index_select(0, plan.rows)[None] for x in (q, k, v, g, beta)]
    o, final = kernel(*inputs, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=plan.cu_seqlens, **plan.extra)
    if plan.first is not None:
        out.narrow(0, plan.first, plan.num_rows).copy_(o[0])
    else:
        out.index_copy_(0, plan.rows, o[0].to(out.dtype))
    if ssm_state is not None:
        ssm_state.index_copy_(0, plan.slots, final.to(STATE_DTYPE))


FLA_CHUNK = 64  # flash-linear-attention's default chunk of the gated delta rule (its chunk map below is of it)


@dataclass
class _FlaPlan:
    """A step's index tensors for flash-linear-attention's varlen call over some of its sequences: their rows (or,
    rows in one run, the first and count), cu_seqlens, slots and keep flags, and, where the kernel takes them, the
    chunk map (which the kernel would otherwise build and copy up from pageable memory, waiting for the device, in
    every layer) and a host copy of cu_seqlens. Built once a step: the kernel's own caches, keyed on these very
    tensors, then hit in every later layer."""

    first: int | None
    num_rows: int
    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    keep: torch.Tensor
    extra: dict

    @staticmethod
    def build(spans: list[tuple[int, int, bool]], seqs: list[int], slots: Sequence[int] | None, kernel,
              device: torch.device) -> _FlaPlan:
        cu = [0]
        for b in seqs:
            cu.append(cu[-1] + spans[b][1])
        first = spans[seqs[0]][0]
        in_one_run = all(spans[b][0] == first + cu[i] for i, b in enumerate(seqs))
        rows = [] if in_one_run else [r for b in seqs for r in range(spans[b][0], spans[b][0] + spans[b][1])]
        params = _kernel_params(kernel)
        chunk_map = ([v for i, b in enumerate(seqs) for c in range(-(-spans[b][1] // FLA_CHUNK)) for v in (i, c)]
                     if "chunk_indices" in params else [])
        rows_t, cu_t, slots_t, keep_t, chunks_t = _upload(
            rows, cu, [slots[b] for b in seqs] if slots is not None else [], [spans[b][2] for b in seqs], chunk_map,
            device=device)
        extra = {}
        if "cu_seqlens_cpu" in params:
            extra["cu_seqlens_cpu"] = torch.tensor(cu)
        if chunk_map:
            extra["chunk_indices"] = chunks_t.view(-1, 2)
            extra["chunk_size"] = FLA_CHUNK
        return _FlaPlan(first if in_one_run else None, cu[-1], rows_t, cu_t, slots_t, keep_t, extra)


@functools.cache
def _kernel_params(kernel) -> frozenset[str]:
    """The parameters flash-linear-attention's chunk kernel names (0.6 takes cu_seqlens_cpu and chunk_indices)."""
    return frozenset(inspect.signature(kernel).parameters)


def _length_groups(seqs: list[int], spans: list[tuple[int, int, bool]], chunk: int) -> list[list[int]]:
    """The sequences of a step that are longer than one row, grouped by their length in chunks rounded up to a power
    of two, so that padding each group to its longest wastes at most half of it: each group is one batched call."""
    groups: dict[int, list[int]] = {}
    for b in seqs:
        chunks = -(-spans[b][1] // chunk)
        groups.setdefault(1 << (chunks - 1).bit_length(), []).append(b)
    return list(groups.values())


def _upload(*lists: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Host index lists as int64 tensors on the device in one non-blocking copy (a plain torch.tensor(...,
    device=cuda) waits for the work queued before it, which in an eager step is every earlier layer's)."""
    packed = to_device([int(v) for values in lists for v in values], torch.long, device)
    return list(packed.split([len(values) for values in lists]))


def _decode_indices(decodes: list[int], spans: list[tuple[int, int, bool]], slots: Sequence[int],
                    device: torch.device, cache: dict | None = None) -> list[torch.Tensor]:
    """The rows, slots and keep flags (1: continues from its state) of the step's single-row sequences."""
    return _cached(cache, ("decodes", tuple(spans[b] for b in decodes)), lambda: _upload(
        [spans[b][0] for b in decodes], [slots[b] for b in decodes], [spans[b][2] for b in decodes], device=device))


@dataclass
class _Padded:
    """A group of sequences padded to its longest, L rows each: `rows` [B, L] the step's rows (padding: row
    num_rows, the zero row that _with_zero_row appends), `real` and `at` the real rows and where they sit in the
    flattened [B * L], each sequence's length `lens` [B], slot and keep flag [B] (where slots are kept)."""

    rows: torch.Tensor
    real: torch.Tensor
    at: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    keep: torch.Tensor

    def scatter(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """The real rows of y [B, L, ...] into out [T, ...]."""
        out.index_copy_(0, self.real, y.reshape(-1, *y.shape[2:]).index_select(0, self.at).to(out.dtype))


def _padded(group: list[int], spans: list[tuple[int, int, bool]], slots: Sequence[int] | None, num_rows: int,
            device: torch.device, cache: dict | None = None) -> _Padded:
    return _cached(cache, ("padded", tuple(spans[b] for b in group), slots is not None),
                   lambda: _build_padded(group, spans, slots, num_rows, device))


def _build_padded(group: list[int], spans: list[tuple[int, int, bool]], slots: Sequence[int] | None, num_rows: int,
                  device: torch.device) -> _Padded:
    width = max(spans[b][1] for b in group)
    rows, real, at = [], [], []
    for i, b in enumerate(group):
        first, n, _ = spans[b]
        rows += [*range(first, first + n), *[num_rows] * (width - n)]
        real += range(first, first + n)
        at += range(i * width, i * width + n)
    rows_t, real_t, at_t, lens, slot_t, keep = _upload(
        rows, real, at, [spans[b][1] for b in group], [slots[b] for b in group] if slots is not None else [],
        [spans[b][2] for b in group], device=device)
    return _Padded(rows_t.view(len(group), width), real_t, at_t, lens, slot_t, keep)


def _states_of(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The states at `slots` [n] of a pool, zeros where keep [n] is 0 (a sequence whose first row is its position 0:
    its slot may hold another sequence's leftovers)."""
    return pool.index_select(0, slots) * keep.view(-1, *[1] * (pool.dim() - 1)).to(pool.dtype)


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def use_triton(x: torch.Tensor) -> bool:
    """The decode step runs the Triton kernel (kernels/gated_delta_rule_triton.py) on CUDA where triton imports."""
    from atlas.kernels import triton_available

    return x.is_cuda and triton_available()


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            ssm_state: torch.Tensor | None, query_start_loc: Sequence[int], seq_lens: Sequence[int],
                            slots: Sequence[int] | None, chunk: int = DEFAULT_CHUNK,
                            splits: Sequence[tuple[int, int, int]] = (), cache: dict | None = None) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] (sequences back to back), ssm_state [slots, Hv, Dk, Dv]
    float32 (None: no state kept) -> out [T, Hv, Dv]; each sequence's final state is written to its slot.
    Single-row sequences (decodes) take the recurrent step together (on CUDA: the Triton kernel); longer ones the
    chunked form. `splits` and `cache`: as causal_conv1d_varlen's (a snapshot here takes two passes: the rows before
    it, then the rest)."""
    out = torch.empty_like(v)
    spans = _spans(query_start_loc, seq_lens)
    run_tails = None
    if splits and ssm_state is not None and settings.tuning.gdn_snapshot_tail and use_triton(v) and all(
            spans[b][1] - rows <= RECURRENT_TAIL for b, rows, _ in splits):
        # (the rows after a snapshot, at most a page of them, through the recurrent kernel in one launch: a second
        #  chunked call per layer costs more host time than the kernel does)
        def run_tails(tails: list[tuple[int, int, int]]) -> None:
            from atlas.kernels.gated_delta_rule_triton import recurrent_decode

            rows, tail_slots, keep, counts = _cached(cache, ("tails", tuple(tails)), lambda: _upload(
                [a for _, a, _ in tails], [slots[b] for b, _, _ in tails], [1] * len(tails),
                [n for _, _, n in tails], device=v.device))
            recurrent_decode(q, k, v, g, beta, ssm_state, out, rows, tail_slots, keep, counts=counts)

    _in_two_phases(lambda spans: _delta_rule_spans(q, k, v, g, beta, ssm_state, spans, slots, chunk, out, cache),
                   spans, splits, ssm_state, slots, cache, run_tails)
    return out


RECURRENT_TAIL = 64  # the most rows after an in-step snapshot that go through the recurrent kernel


def _delta_rule_spans(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_state: torch.Tensor | None, spans: list[tuple[int, int, bool]], slots: Sequence[int] | None,
                      chunk: int, out: torch.Tensor, cache: dict | None = None) -> None:
    """gated_delta_rule_varlen over the sequences' (first row, rows, continues) spans (rows 0: skipped)."""
    decodes = [b for b, (_, n, _) in enumerate(spans) if n == 1] if ssm_state is not None else []
    if decodes:
        rows, idx, keep = _decode_indices(decodes, spans, slots, v.device, cache)
    if decodes and use_triton(v):
        from atlas.kernels.gated_delta_rule_triton import recurrent_decode

        recurrent_decode(q, k, v, g, beta, ssm_state, out, rows, idx, keep.to(torch.int32))
    elif decodes:
        state = _states_of(ssm_state, idx, keep)
        pick = [x.index_select(0, rows)[:, None] for x in (q, k, v, g, beta)]
        y, new = gated_delta_rule_recurrent(*pick, state=state)
        out.index_copy_(0, rows, y[:, 0])
        ssm_state.index_copy_(0, idx, new)
    done = set(decodes)
    longer = [b for b, (_, n, _) in enumerate(spans) if b not in done and n > 0]
    if longer and v.is_cuda and _prefill_through_fla():
        _chunked_fla(q, k, v, g, beta, ssm_state, spans, longer, slots, out, cache)
        return
    for group in _length_groups(longer, spans, chunk):
        # (the group padded to its longest with zero rows, g = 0 and beta = 0, which leave the state as it is)
        p = _padded(group, spans, slots, v.shape[0], v.device, cache)
        state = None
        if ssm_state is not None:
            state = _states_of(ssm_state, p.slots, p.keep)
        y, new = gated_delta_rule_chunked(*(_with_zero_row(x)[p.rows] for x in (q, k, v, g, beta)), state=state,
                                          chunk=chunk)
        p.scatter(out, y)
        if ssm_state is not None:
            ssm_state.index_copy_(0, p.slots, new)


# --------------------------------------------------------------------------------------------------
# A uniform step (every sequence q_len rows) from device tensors only: what the CUDA graphs replay
# --------------------------------------------------------------------------------------------------

def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's decay g = -exp(A_log) * softplus(a + dt_bias) (float32) and write strength
    beta = sigmoid(b) (b's dtype), from its raw a and b projections [T, Hv]."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def causal_conv1d_uniform(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                          keep: torch.Tensor, q_len: int, bias: torch.Tensor | None = None, silu: bool = True
                          ) -> torch.Tensor:
    """x [n * q_len, C] (n sequences of q_len rows each), weight [C, K] (and bias [C]), conv_state
    [slots, C, K - 1]; slots [n] and keep [n] (0: the sequence starts at position 0, from zeros) on the device ->
    silu(conv(x)) [n * q_len, C];
    each sequence's new state is written to its slot (on CUDA: one Triton launch). No host value is read: a CUDA
    graph can hold it."""
    n = slots.shape[0]
    if use_triton(x) and weight.stride(-1) == 1 and conv_state.stride(-1) == 1:
        from atlas.kernels.gated_delta_rule_triton import conv_uniform

        return conv_uniform(x if x.stride(-1) == 1 else x.contiguous(), weight, conv_state, slots,
                            keep.to(torch.int32), q_len, bias, silu)
    state = _states_of(conv_state, slots, keep)
    y, new = causal_conv1d_ref(x.view(n, q_len, -1).transpose(1, 2), weight, state, activation=silu, bias=bias)
    conv_state.index_copy_(0, slots, new.to(conv_state.dtype))
    return y.transpose(1, 2).contiguous().view(n * q_len, -1)  # (rows of unit column stride, whatever n)


def gated_delta_rule_uniform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
                             keep: torch.Tensor, q_len: int) -> torch.Tensor:
    """q, k [n * q_len, Hk, Dk], v [n * q_len, Hv, Dv], the raw a, b [n * q_len, Hv] and the layer's A_log, dt_bias
    [Hv] (`gates`), (n sequences of q_len rows each), ssm_state [slots, Hv, Dk, Dv] float32, slots and keep [n] on
    the device -> out [n * q_len, Hv, Dv]; each sequence's state advances by its rows token by token (on CUDA: one
    Triton launch, the gates computed in it). No host value is read."""
    n = slots.shape[0]
    out = torch.empty_like(v)
    if use_triton(v):
        from atlas.kernels.gated_delta_rule_triton import recurrent_decode

        rows = torch.arange(0, n * q_len, q_len, device=v.device)
        recurrent_decode(q, k, v, a, b, ssm_state, out, rows, slots, keep.to(torch.int32), q_len=q_len,
                         gate_params=(A_log, dt_bias))
        return out
    g, beta = gates(a, b, A_log, dt_bias)
    state = _states_of(ssm_state, slots, keep)
    y, new = gated_delta_rule_recurrent(*(x.view(n, q_len, *x.shape[1:]) for x in (q, k, v, g, beta)), state=state)
    ssm_state.index_copy_(0, slots, new)
    return y.reshape(out.shape)


# --------------------------------------------------------------------------------------------------
# A mixed step (sequences of any lengths) from device tensors only: what the mixed-step CUDA graphs replay
# --------------------------------------------------------------------------------------------------

@dataclass
class RecurrentRows:
    """A step's sequences as the linear-attention layers read them inside a mixed-step CUDA graph: static device
    buffers (runtime/mixed_graphs.MixedGraphStates fills them before each replay), int64, over S entries of which
    the step's sequences come first. An entry of no rows (a sequence slot the step does not use, and the padding
    sequence whose rows pad the step to its graph's size) touches no state.

    row_seq [T]: each row's entry; starts, counts [S]: an entry's first row and rows; slots [S] its state slot
    (the scratch slot where unused); keep [S]: 1 where it continues from its state, 0 from zeros (its first row is
    its position 0); snap_rows, snap_slots [S]: the state after its first snap_rows rows is also kept at snap_slots
    (a prefix-cache snapshot inside its rows; 0: none); conv_entries (starts, consumed, slots, keep, dest) [2S]:
    the convolution states to write, each entry's after all its rows (the first S) and its snapshot's (the last S;
    consumed -1: none); save_index [T] (speculative decoding, else None): where each row's inputs go in the layer's
    verify-input buffer viewed as [slots * rows, width] (a sequence of 2 .. rows rows may be verifying drafts; the
    other rows go to the scratch slot's)."""

    row_seq: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    slots: torch.Tensor
    keep: torch.Tensor
    snap_rows: torch.Tensor
    snap_slots: torch.Tensor
    conv_entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    save_index: torch.Tensor | None = None

    def host(self) -> list[tuple[int, int, int, bool, int, int]]:
        """(first row, rows, slot, continues, snapshot rows, snapshot slot) of each entry with rows (the CPU
        reference reads them; a GPU never does)."""
        lists = [t.tolist() for t in (self.starts, self.counts, self.slots, self.keep, self.snap_rows,
                                      self.snap_slots)]
        return [(a, n, s, bool(k), sr, ss) for a, n, s, k, sr, ss in zip(*lists, strict=True) if n > 0]


def causal_conv1d_rows(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, r: RecurrentRows
                       ) -> torch.Tensor:
    """x [T, C] (a mixed step's rows, padded), weight [C, K], conv_state [slots, C, K - 1] -> silu(conv(x)) [T, C]
    (rows of no entry: zeros on the CPU, unread values on CUDA); each entry's new state, and its snapshot's, written
    to their slots. On CUDA two Triton launches and no host value read."""
    if use_triton(x) and weight.stride(-1) == 1 and conv_state.stride(-1) == 1:
        from atlas.kernels.gated_delta_rule_triton import conv_states_into, conv_varlen

        x = x if x.stride(-1) == 1 else x.contiguous()
        out = conv_varlen(x, weight, conv_state, r.row_seq, r.starts, r.slots, r.keep)
        S = r.starts.shape[0]
        # (the snapshots first: one taken after fewer than K - 1 rows reads its slot's old inputs, which the
        #  sequence's own new state then overwrites)
        conv_states_into(x, conv_state, *(t[S:] for t in r.conv_entries))
        conv_states_into(x, conv_state, *(t[:S] for t in r.conv_entries))
        return out
    out = torch.zeros_like(x)
    writes = []
    for first, n, slot, keep, snap, snap_slot in r.host():
        state = conv_state[slot: slot + 1] if keep else None
        xs = x[first: first + n].t().unsqueeze(0)
        y, new = causal_conv1d_ref(xs, weight, state)
        out[first: first + n] = y[0].t()
        writes.append((slot, new[0]))
        if snap:
            writes.append((snap_slot, causal_conv1d_ref(xs[..., :snap], weight, state)[1][0]))
    for slot, new in writes:  # (every state read before any is written)
        conv_state[slot] = new.to(conv_state.dtype)
    return out


def gated_delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor, r: RecurrentRows
                          ) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], the raw a, b [T, Hv] of a mixed step's rows, ssm_state [slots, Hv, Dk, Dv]
    float32 -> out [T, Hv, Dv] (zeros in rows of no entry); each entry's state advances by its rows token by token
    and its snapshot is kept (on CUDA: one launch of the recurrent kernel, a row count per entry, the gates computed
    in it). Token by token where the eager step chunks a prompt: the same recurrence in another order of sums."""
    out = torch.zeros_like(v)
    if use_triton(v):
        from atlas.kernels.gated_delta_rule_triton import recurrent_decode

        recurrent_decode(q, k, v, a, b, ssm_state, out, r.starts, r.slots, r.keep, gate_params=(A_log, dt_bias),
                         counts=r.counts, snapshots=(r.snap_rows, r.snap_slots))
        return out
    g, beta = gates(a, b, A_log, dt_bias)
    for first, n, slot, keep, snap, snap_slot in r.host():
        state = ssm_state[slot: slot + 1] if keep else None
        pieces = [(0, snap), (snap, n)] if snap else [(0, n)]
        for lo, hi in pieces:
            rows = slice(first + lo, first + hi)
            y, state = gated_delta_rule_recurrent(*(t[rows].unsqueeze(0) for t in (q, k, v, g, beta)), state=state)
            out[rows] = y[0]
            if snap and hi == snap:
                ssm_state[snap_slot] = state[0]
        ssm_state[slot] = state[0]
    return out
