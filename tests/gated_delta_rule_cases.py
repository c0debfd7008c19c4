"""Random decode steps of the gated delta rule: the Triton kernel (kernels/gated_delta_rule_triton.py) against the
PyTorch reference (kernels/gated_delta_rule.py, gated_delta_rule_recurrent one sequence at a time), shared by the
interpreter test on CPU and the CUDA tests. Even seeds: one row a sequence (decode steps); odd seeds: three
consecutive rows a sequence (the verify steps the CUDA graphs replay).

Run as a script it checks them on the default device (CUDA, else CPU through Triton's interpreter when
TRITON_INTERPRET=1) and exits non-zero on a mismatch:

    TRITON_INTERPRET=1 python tests/gated_delta_rule_cases.py 6
"""

from __future__ import annotations

import sys

import torch

from atlas.kernels import gated_delta_rule as gdr
from atlas.kernels import settings
from atlas.kernels.gated_delta_rule import gated_delta_rule_recurrent

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # (the output's rounding; states are float32)


def check(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """Sequences scattered among other rows of a step, slots out of order, one sequence starting from zeros over a
    slot that holds another sequence's state; head shapes off the powers of two on seeds 1 and 3 (mod 4)."""
    from atlas.kernels.gated_delta_rule_triton import recurrent_decode

    g = torch.Generator().manual_seed(4000 + seed)
    hk, ratio = [(1, 1), (2, 2), (2, 4)][seed % 3] if seed < 6 else (16, 2)  # (the last: Qwen3.5-9B's heads)
    dk, dv = [(16, 16), (24, 40), (128, 128), (64, 96)][seed % 4]
    q_len = 1 if seed % 2 == 0 else 3
    hv, n = hk * ratio, 5
    total = n * q_len + 4
    q, k = (torch.randn(total, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(total, hv, dv, generator=g)
    decay = -torch.rand(total, hv, generator=g)
    beta = torch.rand(total, hv, generator=g)
    state = torch.randn(7, hv, dk, dv, generator=g)
    # (each sequence's first row: blocks of q_len consecutive rows, n of them in a shuffled order, the others no
    #  sequence's)
    rows = torch.randperm(total // q_len, generator=g)[:n] * q_len
    slots = torch.randperm(7, generator=g)[:n]
    keep = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)
    expected_state = state.clone()
    expected_out = {}
    for i in range(n):
        r, s = int(rows[i]), int(slots[i])
        init = state[s][None] if keep[i] else None
        span = slice(r, r + q_len)
        pick = [t[span][None].to(dtype) for t in (q, k, v)] + [t[span][None] for t in (decay, beta)]
        o, new = gated_delta_rule_recurrent(*pick, state=init)
        expected_state[s] = new[0]
        for t in range(q_len):
            expected_out[r + t] = o[0, t]
    dev = torch.device(device)
    out = torch.zeros(total, hv, dv, dtype=dtype, device=dev)
    pool = state.to(dev)
    recurrent_decode(q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), decay.to(dev), beta.to(dev), pool, out,
                     rows.to(dev), slots.to(dev), keep.to(dev), q_len=q_len)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(pool.cpu(), expected_state, rtol=tol, atol=tol)
    for r, o in expected_out.items():
        torch.testing.assert_close(out[r].cpu().float(), o.float(), rtol=tol, atol=tol)
    untouched = [r for r in range(total) if r not in expected_out]
    assert not out[untouched].any(), "rows of no sequence were written"


def check_step_kernels(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """The other kernels of a Gated DeltaNet step replayed from a CUDA graph, against their references: the short
    convolution over slots (q_len 1 or 3, kernel width 3 or 4, a sequence at its position 0, a padding sequence on
    a shared scratch slot), the recurrent kernel computing its decay and write strength from the raw projections,
    the gated RMSNorm and the zero-centred RMSNorm with its residual add."""
    from atlas.kernels.fused_ops import scaled_rms_norm_ref
    from atlas.kernels.fused_ops_triton import rms_norm_triton
    from atlas.kernels.gated_delta_rule_triton import conv_uniform, recurrent_decode

    g = torch.Generator().manual_seed(5000 + seed)
    dev = torch.device(device)
    q_len, width = (1, 4) if seed % 2 == 0 else (3, 3)
    channels, n = [40, 96, 200][seed % 3], 4
    x = torch.randn(n * q_len, channels, generator=g).to(dtype)
    w = torch.randn(channels, width, generator=g).to(dtype)
    pool = torch.randn(6, channels, width - 1, generator=g).to(dtype)
    slots, keep = torch.tensor([3, 0, 5, 5]), torch.tensor([True, False, True, False])
    ref_pool = pool.clone()
    ref = gdr.causal_conv1d_uniform(x, w, ref_pool, slots, keep, q_len)  # (CPU tensors: the reference path)
    got_pool = pool.to(dev)
    got = conv_uniform(x.to(dev), w.to(dev), got_pool, slots.to(dev), keep.to(dev, torch.int32), q_len)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_pool.cpu()[[0, 3]].float(), ref_pool[[0, 3]].float(), rtol=0, atol=0)

    hk, hv, d = 2, 4, 16
    rows = n * q_len
    q, k = (torch.randn(rows, hk, d, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(rows, hv, d, generator=g).to(dtype)
    a, b = (torch.randn(rows, hv, generator=g).to(dtype) for _ in range(2))
    a[0, 0] = 30.0  # (softplus's linear branch)
    A_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g).to(dtype)
    state = torch.randn(6, hv, d, d, generator=g)
    ref_state = state.clone()
    decay, beta = gdr.gates(a, b, A_log, dt_bias)
    ref_out = torch.empty_like(v)
    for i, (slot, kept) in enumerate(zip(slots[:3].tolist(), keep[:3].tolist(), strict=True)):
        span = slice(i * q_len, (i + 1) * q_len)
        o, new = gated_delta_rule_recurrent(*(t[span][None] for t in (q, k, v, decay, beta)),
                                            state=state[slot][None] if kept else None)
        ref_out[span], ref_state[slot] = o[0], new[0]
    got_state, got_out = state.to(dev), torch.zeros(rows, hv, d, dtype=dtype, device=dev)
    recurrent_decode(*(t.to(dev) for t in (q, k, v, a, b)), got_state, got_out,
                     torch.arange(0, 3 * q_len, q_len, device=dev), slots[:3].to(dev),
                     keep[:3].to(dev, torch.int32), q_len=q_len, gate_params=(A_log.to(dev), dt_bias.to(dev)))
    torch.testing.assert_close(got_state.cpu(), ref_state, rtol=tol, atol=tol)
    torch.testing.assert_close(got_out.cpu()[: 3 * q_len].float(), ref_out[: 3 * q_len].float(), rtol=tol, atol=tol)

    o, z = (torch.randn(rows * hv, d, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(d, generator=g).to(dtype)
    got = rms_norm_triton(o.to(dev), weight.to(dev), 1e-6, gate=z.to(dev))
    torch.testing.assert_close(got.cpu().float(), gdr.rms_norm_gated_ref(o, z, weight, 1e-6).float(), rtol=tol,
                               atol=tol)
    h, res = (torch.randn(rows, channels, generator=g).to(dtype) for _ in range(2))
    wz = (torch.randn(channels, generator=g) * 0.1).to(dtype)
    got, total = rms_norm_triton(h.to(dev), wz.to(dev), 1e-6, residual=res.to(dev), weight_offset=1.0)
    ref, ref_total = scaled_rms_norm_ref(h, wz, 1e-6, 1.0, residual=res)
    torch.testing.assert_close(total.cpu(), ref_total, rtol=0, atol=0)
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)


def check_conv_varlen(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """The short convolution of an eager step through the Triton kernels (kernels/gated_delta_rule._conv_through_
    triton) against the reference path (CPU tensors): prompts of 1 to 70 rows among decodes, some continuing from
    their slot's state and some from their position 0 over a slot holding leftovers, prefix-cache snapshots after 1 or
    2 and after 17 rows of a sequence (before and after its K - 1 inputs), and the same step without a state kept."""
    g = torch.Generator().manual_seed(6000 + seed)
    dev = torch.device(device)
    width, channels = (4, 40) if seed % 2 == 0 else (3, 200)
    lens_now = [1, 17, 1, 70, 2, 5][: 3 + seed % 4]
    qsl = [0]
    for n in lens_now:
        qsl.append(qsl[-1] + n)
    continues = [(b + seed) % 3 != 0 for b in range(len(lens_now))]
    seq_lens = [n + (7 if c else 0) for n, c in zip(lens_now, continues, strict=True)]
    slots = torch.randperm(10, generator=g)[: len(lens_now)].tolist()
    spare = [s for s in range(10) if s not in slots]
    # (at most one snapshot a sequence in a step, as the scheduler cuts: engine/scheduler.py)
    splits = [(b, r, spare[i]) for i, (b, r) in enumerate([(1, 1 + seed % 2), (3, 17), (5, 2)]) if b < len(lens_now)]
    x = torch.randn(qsl[-1], channels, generator=g).to(dtype)
    w = torch.randn(channels, width, generator=g).to(dtype)
    pool = torch.randn(10, channels, width - 1, generator=g).to(dtype)
    spans = gdr._spans(qsl, seq_lens)
    for kept in (True, False):
        ref_pool = pool.clone()
        ref = gdr.causal_conv1d_varlen(x, w, ref_pool if kept else None, qsl, seq_lens, slots,
                                       splits=splits if kept else ())
        got_pool = pool.to(dev)
        got = gdr._conv_through_triton(x.to(dev), w.to(dev), got_pool if kept else None, spans, slots,
                                       splits if kept else (), {})
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(got_pool.cpu(), ref_pool, rtol=0, atol=0)  # (states are copies of inputs)


def check_snapshot_tails(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """An eager step of the delta rule with prefix-cache snapshots inside prompts (kernels/gated_delta_rule.
    gated_delta_rule_varlen's splits), where the rows after each snapshot go through the recurrent kernel
    (`--tuning gdn_snapshot_tail`) with a row
    count per sequence, against the reference path (CPU tensors, both passes chunked): decodes, a continuing chunk
    and fresh prompts, tails of 1 to 40 rows; the snapshot slots and the sequences' slots must hold the reference's
    states. On the CPU the Triton kernels run in the interpreter."""
    g = torch.Generator().manual_seed(7000 + seed)
    hk, ratio, d = [(1, 2, 16), (2, 2, 32)][seed % 2]
    hv = hk * ratio
    lens_now = [1, 50, 1, 23, 70][: 3 + seed % 3]
    qsl = [0]
    for n in lens_now:
        qsl.append(qsl[-1] + n)
    seq_lens = [n + (9 if b % 2 == 0 else 0) for b, n in enumerate(lens_now)]
    slots = [4, 1, 6, 0, 3][: len(lens_now)]
    tails = {1: 10, 3: 1 + seed % 2, 4: 40}
    splits = [(b, lens_now[b] - t, 7 + i) for i, (b, t) in enumerate(tails.items()) if b < len(lens_now)]
    T = qsl[-1]
    q, k = (torch.randn(T, hk, d, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(T, hv, d, generator=g).to(dtype)
    decay, beta = -torch.rand(T, hv, generator=g), torch.rand(T, hv, generator=g)
    pool = torch.randn(10, hv, d, d, generator=g)
    ref_pool = pool.clone()
    ref = gdr.gated_delta_rule_varlen(q, k, v, decay, beta, ref_pool, qsl, seq_lens, slots, splits=splits)
    dev = torch.device(device)
    got_pool = pool.to(dev)
    use_triton = gdr.use_triton
    if dev.type == "cpu":  # (the interpreter: the Triton kernels on CPU tensors)
        gdr.use_triton = lambda x: True
    try:
        with settings.tuned(gdn_snapshot_tail=True):
            got = gdr.gated_delta_rule_varlen(*(t.to(dev) for t in (q, k, v, decay, beta)), got_pool, qsl, seq_lens,
                                              slots, splits=splits, cache={})
    finally:
        gdr.use_triton = use_triton
    tol = TOLERANCE[dtype] * 5  # (two chunked forms against one chunked form and a recurrence over the tail)
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)
    touched = slots + [slot for _, _, slot in splits]
    torch.testing.assert_close(got_pool.cpu()[touched], ref_pool[touched], rtol=tol, atol=tol)


def check_mixed_rows(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """A mixed step of the CUDA graphs' static buffers (kernels/gated_delta_rule.RecurrentRows): sequences of 1 to
    19 rows, continuing and fresh, a prefix-cache snapshot inside two of them (one of a continuing sequence after a
    single row, before the convolution's K - 1: its state holds inputs from before the step, which the sequence's
    own new state overwrites), unused entries and a padding entry with
    rows but no count; the Triton path (the convolution over every row, the states written straight into the pools
    in two launches, the recurrent kernel with row counts and snapshots) against the reference (CPU tensors, token
    by token): outputs of the sequences' rows and every slot of both pools."""
    from atlas.kernels.gated_delta_rule import RecurrentRows, causal_conv1d_rows, gated_delta_rule_rows

    g = torch.Generator().manual_seed(7500 + seed)
    hk, ratio, d, K = [(1, 2, 16, 4), (2, 2, 32, 3)][seed % 2]
    hv, C = hk * ratio, 2 * hk * d + hk * ratio * d
    lens_now = [1, 19, 1, 7, 12][: 3 + seed % 3]
    keep = [1, 0, 1, 1, 0][: len(lens_now)]
    slots = [4, 1, 6, 0, 3][: len(lens_now)]
    snaps = {1: (5, 8), 3: (1, 9)} if len(lens_now) > 3 else {1: (5, 8)}  # (entry: rows before it, its slot)
    S, scratch, pad_rows = 7, 10, 5  # (entries: the sequences, unused ones, the padding entry last)
    n = len(lens_now)
    starts = [sum(lens_now[:i]) for i in range(n)]
    rows = sum(lens_now)
    T = rows + pad_rows
    entry = lambda values, fill: values + [fill] * (S - n)  # noqa: E731
    e_starts = entry(starts, 0)
    e_starts[S - 1] = rows
    counts, e_slots, e_keep = entry(lens_now, 0), entry(slots, scratch), entry(keep, 0)
    snap_rows = [snaps.get(i, (0, 0))[0] for i in range(S)]
    snap_slots = [snaps[i][1] if i in snaps else scratch for i in range(S)]
    consumed = [c if i < n else -1 for i, c in enumerate(counts)] + [r if r else -1 for r in snap_rows]
    row_seq = [i for i in range(n) for _ in range(lens_now[i])] + [S - 1] * pad_rows
    lists = [row_seq, e_starts, counts, e_slots, e_keep, snap_rows, snap_slots]
    conv_lists = [e_starts * 2, consumed, e_slots * 2, e_keep * 2, e_slots + snap_slots]

    def rows_on(dev) -> RecurrentRows:
        return RecurrentRows(*(torch.tensor(x, device=dev) for x in lists),
                             conv_entries=tuple(torch.tensor(x, device=dev) for x in conv_lists))

    x = torch.randn(T, C, generator=g).to(dtype)
    w = torch.randn(C, K, generator=g) * 0.5
    q, k = (torch.randn(T, hk, d, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(T, hv, d, generator=g).to(dtype)
    a, b = (torch.randn(T, hv, generator=g).to(dtype) for _ in range(2))
    A_log, dt_bias = torch.rand(hv, generator=g), torch.rand(hv, generator=g)
    conv_pool = torch.randn(11, C, K - 1, generator=g).to(dtype)
    ssm_pool = torch.randn(11, hv, d, d, generator=g)
    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    ref_y = causal_conv1d_rows(x, w, ref_conv, rows_on("cpu"))
    ref_o = gated_delta_rule_rows(q, k, v, a, b, A_log, dt_bias, ref_ssm, rows_on("cpu"))
    dev = torch.device(device)
    got_conv, got_ssm = conv_pool.to(dev), ssm_pool.to(dev)
    use_triton = gdr.use_triton
    if dev.type == "cpu":  # (the interpreter: the Triton kernels on CPU tensors)
        gdr.use_triton = lambda t: True
    try:
        r = rows_on(dev)
        got_y = causal_conv1d_rows(x.to(dev), w.to(dev), got_conv, r)
        got_o = gated_delta_rule_rows(*(t.to(dev) for t in (q, k, v, a, b, A_log, dt_bias)), got_ssm, r)
    finally:
        gdr.use_triton = use_triton
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_y.cpu()[:rows].float(), ref_y[:rows].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_conv.cpu(), ref_conv, rtol=0, atol=0)  # (states are copies of inputs)
    torch.testing.assert_close(got_o.cpu()[:rows].float(), ref_o[:rows].float(), rtol=tol * 5, atol=tol * 5)
    torch.testing.assert_close(got_ssm.cpu(), ref_ssm, rtol=tol * 5, atol=tol * 5)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed in range(count):
        check(seed, device)
        check_step_kernels(seed, device)
        check_conv_varlen(seed, device)
        check_snapshot_tails(seed, device)
        check_mixed_rows(seed, device)
    print(f"{count} gated delta rule decode cases match on {device}")
