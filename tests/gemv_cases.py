"""Random small-M GEMV problems (kernels/gemv_triton.py against x @ W^T), shared by the interpreter
test on CPU and the CUDA test.

Run as a script it checks the kernel on the default device (CUDA in bf16, else CPU in fp32 through
Triton's interpreter when TRITON_INTERPRET=1) and exits non-zero on a mismatch:

    TRITON_INTERPRET=1 python tests/gemv_cases.py 24
"""

from __future__ import annotations

import sys

import torch


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


def check(device: str, dtype: torch.dtype, seeds) -> list[str]:
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    failures = []
    for seed in seeds:
        got, ref = run_case(random_case(seed, device, dtype))
        err = ((got - ref).abs() / (1 + ref.abs())).max().item()
        if not err <= tol:
            failures.append(f"seed {seed}: max error {err:.3g} > {tol}")
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
