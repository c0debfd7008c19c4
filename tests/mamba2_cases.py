"""Random decode, verify and eager steps of Mamba-2's scan and its biased convolution: the Triton kernels
(kernels/mamba2_triton.py, and the convolution kernels of kernels/gated_delta_rule_triton.py with a bias) against the
PyTorch reference (kernels/mamba2.ssd_recurrent, gated_delta_rule.causal_conv1d_ref), shared by the interpreter test
on CPU and the CUDA tests. Even seeds: one row a sequence (decode steps); odd seeds: three consecutive rows a sequence
(the verify steps the CUDA graphs replay).

Run as a script it checks them on the default device (CUDA, else CPU through Triton's interpreter when
TRITON_INTERPRET=1) and exits non-zero on a mismatch:

    TRITON_INTERPRET=1 python tests/mamba2_cases.py 4
    TRITON_INTERPRET=1 python tests/mamba2_cases.py 2 --short-conv    # LFM2's convolution (no silu)
    TRITON_INTERPRET=1 python tests/mamba2_cases.py 2 --mamba1        # Jamba's selective scan
"""

from __future__ import annotations

import contextlib
import sys

import torch

from atlas.kernels import gated_delta_rule as gdr
from atlas.kernels import mamba2

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # (the inputs' rounding; states and outputs are float32)


def _shapes(seed: int) -> tuple[int, int, int, int]:
    """(heads, groups, head dim, state size): off the powers of two on some seeds; the last Granite 4.0-H's head
    and state sizes."""
    return [(4, 2, 8, 16), (6, 1, 24, 40), (8, 4, 64, 128), (16, 1, 64, 128)][seed % 4]


def check_decode(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """Sequences scattered among other rows of a step, slots out of order, one sequence starting from zeros over a
    slot that holds another sequence's state; x, B and C read as views of one convolution output (row stride the
    conv width), as the layer passes them."""
    from atlas.kernels.mamba2_triton import ssd_decode

    g = torch.Generator().manual_seed(7000 + seed)
    H, G, P, N = _shapes(seed)
    q_len, n = (1 if seed % 2 == 0 else 3), 5
    total = n * q_len + 4
    xbc = torch.randn(total, H * P + 2 * G * N, generator=g).to(dtype)
    x = xbc[:, : H * P].view(total, H, P)
    B = xbc[:, H * P: H * P + G * N].view(total, G, N)
    C = xbc[:, H * P + G * N:].view(total, G, N)
    dt = torch.nn.functional.softplus(torch.randn(total, H, generator=g))
    A = -torch.rand(H, generator=g) - 0.05
    state = torch.randn(7, H, N, P, generator=g)
    rows = torch.randperm(total // q_len, generator=g)[:n] * q_len
    slots = torch.randperm(7, generator=g)[:n]
    keep = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)
    expected_state, expected = state.clone(), {}
    for i in range(n):
        r, s = int(rows[i]), int(slots[i])
        span = slice(r, r + q_len)
        y, new = mamba2.ssd_recurrent(x[span][None], dt[span][None], A, B[span][None], C[span][None],
                                      state=state[s][None] if keep[i] else None)
        expected_state[s] = new[0]
        for t in range(q_len):
            expected[r + t] = y[0, t]
    dev = torch.device(device)
    out = torch.zeros(total, H, P, device=dev)
    pool = state.to(dev, copy=True)
    xbc_d = xbc.to(dev)
    ssd_decode(xbc_d[:, : H * P].view(total, H, P), dt.to(dev), A.to(dev),
               xbc_d[:, H * P: H * P + G * N].view(total, G, N), xbc_d[:, H * P + G * N:].view(total, G, N), pool, out,
               rows.to(dev), slots.to(dev), keep.to(dev), q_len=q_len)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(pool.cpu(), expected_state, rtol=tol, atol=tol)
    for r, y in expected.items():
        torch.testing.assert_close(out[r].cpu(), y, rtol=tol, atol=tol)
    untouched = [r for r in range(total) if r not in expected]
    assert not out[untouched].any(), "rows of no sequence were written"


@contextlib.contextmanager
def _triton_on_cpu(device: str):
    """In the interpreter: the Triton paths of the step functions on CPU tensors."""
    saved = gdr.use_triton, mamba2.use_triton
    if device == "cpu":
        gdr.use_triton = mamba2.use_triton = lambda t: True
    try:
        yield
    finally:
        gdr.use_triton, mamba2.use_triton = saved


def check_steps(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """A layer's eager step (the biased convolution over prompts of 1 to 30 rows among decodes, some continuing from
    their slot and some from their position 0 over leftovers, a prefix-cache snapshot inside one; then the scan, its
    decodes through the kernel) and a uniform step (decode or verify rows of four sequences, one from position 0)
    through the Triton paths, against the same calls on the PyTorch paths."""
    g = torch.Generator().manual_seed(8000 + seed)
    H, G, P, N = _shapes(seed % 3)
    K = 4 if seed % 2 == 0 else 3
    width = H * P + 2 * G * N
    lens_now = [1, 17, 1, 30, 2][: 3 + seed % 3]
    lens_before = [9, 0, 4, 0, 6][: len(lens_now)]
    qsl = [0]
    for m in lens_now:
        qsl.append(qsl[-1] + m)
    T = qsl[-1]
    seq_lens = [a + b for a, b in zip(lens_before, lens_now, strict=True)]
    slots = [2, 5, 0, 7, 3][: len(lens_now)]
    splits = [(1, 8, 9)]  # (sequence 1's state after 8 of its 17 rows, into snapshot slot 9)
    xbc = torch.randn(T, width, generator=g).to(dtype)
    w = (torch.randn(width, K, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(width, generator=g) * 0.3).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(T, H, generator=g))
    A = -torch.rand(H, generator=g) - 0.05
    conv_pool = torch.randn(10, width, K - 1, generator=g).to(dtype)
    ssm_pool = torch.randn(10, H, N, P, generator=g)

    def eager(dev, triton: bool):
        conv, ssm = conv_pool.to(dev, copy=True), ssm_pool.to(dev, copy=True)
        with _triton_on_cpu(device) if triton else contextlib.nullcontext():
            y = gdr.causal_conv1d_varlen(xbc.to(dev), w.to(dev), conv, qsl, seq_lens, slots, splits=splits,
                                         bias=bias.to(dev))
            x, B, C = y[:, : H * P].view(T, H, P), y[:, H * P: H * P + G * N].view(T, G, N), y[:, H * P + G * N:].view(
                T, G, N)
            out = mamba2.ssd_varlen(x, dt.to(dev), A.to(dev), B, C, ssm, qsl, seq_lens, slots, chunk=8,
                                    splits=splits)
        return y.cpu(), out.cpu(), conv.cpu(), ssm.cpu()  # (copies on CUDA; on the CPU each call's own tensors)

    tol = TOLERANCE[dtype]
    want = eager("cpu", False)
    got = eager(torch.device(device), True)
    for name, a, b in zip(("conv output", "scan output", "conv states", "scan states"), got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol * 5, atol=tol * 5, msg=lambda m, n=name: f"{n}: {m}")

    q_len, n = (1 if seed % 2 == 0 else 3), 4
    rows = n * q_len
    u_slots, u_keep = torch.tensor([6, 1, 4, 8]), torch.tensor([True, True, False, True])

    def uniform(dev, triton: bool):
        conv, ssm = conv_pool.to(dev, copy=True), ssm_pool.to(dev, copy=True)
        with _triton_on_cpu(device) if triton else contextlib.nullcontext():
            y = gdr.causal_conv1d_uniform(xbc[:rows].to(dev), w.to(dev), conv, u_slots.to(dev), u_keep.to(dev),
                                          q_len, bias=bias.to(dev))
            x, B, C = (y[:, : H * P].view(rows, H, P), y[:, H * P: H * P + G * N].view(rows, G, N),
                       y[:, H * P + G * N:].view(rows, G, N))
            out = mamba2.ssd_uniform(x, dt[:rows].to(dev), A.to(dev), B, C, ssm, u_slots.to(dev), u_keep.to(dev),
                                     q_len)
        return y.cpu(), out.cpu(), conv.cpu(), ssm.cpu()

    want, got = uniform("cpu", False), uniform(torch.device(device), True)
    for name, a, b in zip(("uniform conv output", "uniform scan output", "uniform conv states",
                           "uniform scan states"), got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol * 5, atol=tol * 5, msg=lambda m, n=name: f"{n}: {m}")


def check_short_conv(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """LFM2's short convolution (no silu, a bias every other seed) through the Triton kernels against the PyTorch
    path: an eager step (prompts among decodes, a snapshot inside one) and a uniform one (decode or verify rows)."""
    g = torch.Generator().manual_seed(9000 + seed)
    C, K = [48, 200][seed % 2], [3, 4][seed % 2]
    lens_now, lens_before, slots = [1, 17, 1, 9], [9, 0, 4, 3], [2, 5, 0, 7]
    qsl = [0]
    for m in lens_now:
        qsl.append(qsl[-1] + m)
    seq_lens = [a + b for a, b in zip(lens_before, lens_now, strict=True)]
    x = torch.randn(qsl[-1], C, generator=g).to(dtype)
    w = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(C, generator=g) * 0.3).to(dtype) if seed % 2 else None
    pool = torch.randn(10, C, K - 1, generator=g).to(dtype)
    q_len = 1 if seed % 2 == 0 else 3
    u_slots, u_keep = torch.tensor([6, 1, 4, 8]), torch.tensor([True, True, False, True])

    def run(dev, triton: bool):
        b = None if bias is None else bias.to(dev)
        eager_pool, uniform_pool = pool.to(dev, copy=True), pool.to(dev, copy=True)
        with _triton_on_cpu(device) if triton else contextlib.nullcontext():
            y = gdr.causal_conv1d_varlen(x.to(dev), w.to(dev), eager_pool, qsl, seq_lens, slots, splits=[(1, 8, 9)],
                                         bias=b, silu=False)
            u = gdr.causal_conv1d_uniform(x[: 4 * q_len].to(dev), w.to(dev), uniform_pool, u_slots.to(dev),
                                          u_keep.to(dev), q_len, bias=b, silu=False)
        return y.cpu(), eager_pool.cpu(), u.cpu(), uniform_pool.cpu()

    tol = TOLERANCE[dtype]
    for name, a, b in zip(("eager output", "eager states", "uniform output", "uniform states"),
                          run(torch.device(device), True), run("cpu", False), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def check_mamba1(seed: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """Jamba's selective scan (Mamba version 1): the Triton kernel over an eager step (prompts of 1 to 17 rows among
    decodes, one from its position 0 over a slot's leftovers, a snapshot inside one) and a uniform step (decode or
    verify rows), against the PyTorch path; channels and state sizes off the powers of two on odd seeds."""
    from atlas.kernels import mamba1

    g = torch.Generator().manual_seed(10000 + seed)
    D, N = [(64, 16), (72, 12)][seed % 2]
    lens_now, lens_before, slots = [1, 17, 1, 5], [9, 0, 4, 3], [2, 5, 0, 7]
    qsl = [0]
    for m in lens_now:
        qsl.append(qsl[-1] + m)
    T = qsl[-1]
    seq_lens = [a + b for a, b in zip(lens_before, lens_now, strict=True)]
    x = torch.randn(T, D, generator=g).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(T, D, generator=g))
    A = -torch.rand(D, N, generator=g) - 0.05
    B, C = (torch.randn(T, N, generator=g).to(dtype) for _ in range(2))
    pool = torch.randn(10, D, N, generator=g)
    q_len = 1 if seed % 2 == 0 else 3
    u_slots, u_keep = torch.tensor([6, 1, 4, 8]), torch.tensor([True, True, False, True])
    saved = mamba1.use_triton

    def run(dev, triton: bool):
        eager, uniform = pool.to(dev, copy=True), pool.to(dev, copy=True)
        if triton and device == "cpu":
            mamba1.use_triton = lambda t: True
        try:
            y = mamba1.scan_varlen(x.to(dev), dt.to(dev), A.to(dev), B.to(dev), C.to(dev), eager, qsl, seq_lens, slots,
                                   splits=[(1, 8, 9)])
            u = mamba1.scan_uniform(*(t[: 4 * q_len].to(dev) for t in (x, dt)), A.to(dev),
                                    *(t[: 4 * q_len].to(dev) for t in (B, C)), uniform, u_slots.to(dev),
                                    u_keep.to(dev), q_len)
        finally:
            mamba1.use_triton = saved
        return y.cpu(), eager.cpu(), u.cpu(), uniform.cpu()

    tol = TOLERANCE[dtype]
    for name, a, b in zip(("eager output", "eager states", "uniform output", "uniform states"),
                          run(torch.device(device), True), run("cpu", False), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, n=name: f"mamba1 {n}: {m}")


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "--mamba1" in sys.argv:
        for seed in range(count):
            check_mamba1(seed, device)
            if device == "cuda":
                check_mamba1(seed, device, torch.bfloat16)
        print(f"{count} mamba1 cases match on {device}")
        sys.exit(0)
    if "--short-conv" in sys.argv:
        for seed in range(count):
            check_short_conv(seed, device)
            if device == "cuda":
                check_short_conv(seed, device, torch.bfloat16)
        print(f"{count} short convolution cases match on {device}")
        sys.exit(0)
    for seed in range(count):
        check_decode(seed, device)
        check_steps(seed, device)
        if device == "cuda":
            check_decode(seed, device, torch.bfloat16)
            check_steps(seed, device, torch.bfloat16)
    print(f"{count} mamba2 cases match on {device}")
