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

if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed in range(count):
        check(seed, device)
    print(f"{count} gated delta rule decode cases match on {device}")
