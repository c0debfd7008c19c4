"""Random small-M GEMV problems (kernels/gemv_triton.py against x @ W^T), shared by the interpreter
test on CPU and the CUDA test.

Run as a script it checks the kernel on the default device (CUDA in bf16, else CPU in fp32 through
Triton's interpreter when TRITON_INTERPRET=1) and exits non-zero on a mismatch:

    TRITON_INTERPRET=1 python tests/gemv_cases.py 24
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def random_case(seed: int, device: str, dtype: torch.dtype) -> dict:
    from atlas.kernels.gemv import CONFIGS

    g = torch.Generator().manual_seed(7000 + seed)
    m = 1 + seed % 8
    n = [1, 37, 64, 100, 130, 256][seed % 6]
    k = [5, 300, 512, 1000, 128, 777, 2048][seed % 7]
    x = torch.randn(m, k, generator=g)
    if seed % 5 == 3:  # rows of a wider buffer
        x = torch.randn(m, k + 9, generator=g)[:, :k]
    w = torch.randn(n, k, generator=g) / k ** 0.5
    bias = torch.randn(n, generator=g) if seed % 2 else None
    return dict(x=x.to(device, dtype), w=w.to(device, dtype), bias=None if bias is None else bias.to(device, dtype),
                config=CONFIGS[seed % len(CONFIGS)])


def run_case(case) -> tuple[torch.Tensor, torch.Tensor]:
    from atlas.kernels.gemv_triton import gemv_triton

    x, w, b, c = case["x"], case["w"], case["bias"], case["config"]
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    got = gemv_triton(x, w, b, c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind)
    assert got.shape == ref.shape and got.dtype == x.dtype
    # The first weight tile loaded ahead (the PDL path's order, the default where PDL is on) or not: same bits.
    for weight_first in (True, False):
        other = gemv_triton(x, w, b, c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind,
                            weight_first=weight_first)
        assert torch.equal(other, got), f"weight_first={weight_first} changes the result ({c})"
    if c.kind == "dot":  # rows padded to one 16-row tile: a row computes alike alone and among the others
        for i in range(x.shape[0]):
            alone = gemv_triton(x[i: i + 1], w, b, c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind)
            assert torch.equal(alone[0], got[i]), f"row {i} of {x.shape[0]} differs from the row alone ({c})"
    return got.double(), ref


def run_fused_case(case) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The "sum" GEMV with a decode layer's neighbours fused (gemv_triton's norm, residual and act) against the
    unfused references: (what, got, reference) pairs. The residual stream it writes must be x + residual
    exactly, and the activation epilogue must round like the GEMV followed by the activation kernel (equal)."""
    from atlas.kernels.fused_ops import act_and_mul_ref, add_rms_norm_ref, rms_norm_ref
    from atlas.kernels.fused_ops_triton import ACT_SILU, act_and_mul_triton
    from atlas.kernels.gemv_triton import gemv_triton

    x, w, b, c = case["x"][:1], case["w"], case["bias"], case["config"]
    if c.kind != "sum":
        return []
    g = torch.Generator().manual_seed(int(x.shape[1]) * 31 + w.shape[0])
    residual = torch.randn(x.shape, generator=g).to(x.device, x.dtype)
    norm_w = (1 + 0.1 * torch.randn(x.shape[1], generator=g)).to(x.device, x.dtype)
    geometry = (c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind)
    out = []
    got = gemv_triton(x, w, b, *geometry, norm=(norm_w, 1e-6))
    out.append(("norm", got, F.linear(rms_norm_ref(x, norm_w, 1e-6), w, b)))
    got, new_residual = gemv_triton(x, w, b, *geometry, norm=(norm_w, 1e-6), residual=residual)
    normed, expected_residual = add_rms_norm_ref(x, residual, norm_w, 1e-6)
    assert torch.equal(new_residual, expected_residual), "the residual stream differs from x + residual"
    out.append(("add+norm", got, F.linear(normed, w, b)))
    if w.shape[0] % 2 == 0:
        got = gemv_triton(x, w, b, *geometry, act=ACT_SILU)
        unfused = act_and_mul_triton(gemv_triton(x, w, b, *geometry), ACT_SILU)
        assert torch.equal(got, unfused), "the activation epilogue rounds otherwise than GEMV + activation"
        out.append(("silu-and-mul", got, act_and_mul_ref(F.linear(x, w, b))))
    return [(what, got.double(), ref.double()) for what, got, ref in out]


def check(device: str, dtype: torch.dtype, seeds) -> list[str]:
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    failures = []
    for seed in seeds:
        case = random_case(seed, device, dtype)
        for what, got, ref in [("plain", *run_case(case)), *run_fused_case(case)]:
            err = ((got - ref).abs() / (1 + ref.abs())).max().item()
            if not err <= tol:
                failures.append(f"seed {seed} ({what}): max error {err:.3g} > {tol}")
    return failures


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    problems = check(device, dtype, range(n))
    print("\n".join(problems) or f"{n} GEMV cases agree ({device}, {dtype})")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
