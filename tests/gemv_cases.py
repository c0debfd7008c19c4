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
    n = [1, 37, 64, 100, 70, 48][seed % 6]  # (off the 4-, 8- and 16-row tiles; few programs for the interpreter)
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
    # (the first W tile loaded before the PDL wait: the same sums in the same order)
    early = gemv_triton(x, w, b, c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind, prefetch=True)
    assert torch.equal(early, gemv_triton(x, w, b, c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind,
                                          prefetch=False)), f"the prefetching GEMV sums otherwise ({c})"
    if c.kind == "dot":  # rows padded to one 16-row tile: a row computes alike alone and among the others
        for i in range(x.shape[0]):
            alone = gemv_triton(x[i: i + 1], w, b, c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind)
            assert torch.equal(alone[0], got[i]), f"row {i} of {x.shape[0]} differs from the row alone ({c})"
    return got.double(), ref


def run_act_case(case) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The "sum" GEMV with the gated activation as its epilogue (gemv_triton's act) against the reference, as
    (what, got, reference); it must also round exactly like the GEMV followed by the activation kernel."""
    from atlas.kernels.fused_ops import act_and_mul_ref
    from atlas.kernels.fused_ops_triton import ACT_GELU_TANH, ACT_SILU, act_and_mul_triton
    from atlas.kernels.gemv_triton import gemv_triton

    x, w, b, c = case["x"][:1], case["w"], case["bias"], case["config"]
    if c.kind != "sum" or w.shape[0] % 2:
        return []
    geometry = (c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind)
    out = []
    for code, name in ((ACT_SILU, "silu"), (ACT_GELU_TANH, "gelu_pytorch_tanh")):
        got = gemv_triton(x, w, b, *geometry, act=code)
        unfused = act_and_mul_triton(gemv_triton(x, w, b, *geometry), code)
        assert torch.equal(got, unfused), f"the {name} epilogue rounds otherwise than GEMV + activation ({c})"
        assert torch.equal(gemv_triton(x, w, b, *geometry, act=code, prefetch=True),
                           gemv_triton(x, w, b, *geometry, act=code, prefetch=False)), f"prefetch, {name} ({c})"
        out.append((name, got.double(), act_and_mul_ref(F.linear(x, w, b), name).double()))
    return out


def run_widening_case(case) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The "sum" GEMV of a bf16 / fp16 row against a float32 W (gemv.linear_widened, the float32 routers): the same
    float32 result, bit for bit, as the GEMV of the row cast to float32 first."""
    from atlas.kernels import gemv
    from atlas.kernels.gemv_triton import gemv_triton

    x, w, c = case["x"][:1], case["w"].float(), case["config"]
    if c.kind != "sum":
        return []
    geometry = (c.block_n, c.block_k, c.num_warps, c.num_stages, c.kind)
    out = []
    for narrow in (torch.bfloat16, torch.float16) if x.is_cuda else (torch.bfloat16,):  # (CI's time)
        xn = x.to(narrow)
        got = gemv_triton(xn, w, None, *geometry)
        assert got.dtype == torch.float32, got.dtype
        assert torch.equal(got, gemv_triton(xn.float(), w, None, *geometry)), f"widening {narrow} sums otherwise ({c})"
        if x.is_cuda:  # (linear_widened takes the GEMV where the registry gives the shape a "sum" config)
            gemv.record({(w.shape[0], w.shape[1], torch.float32): c}, "1")
            try:
                assert torch.equal(gemv.linear_widened(xn, w), got), f"linear_widened is not the GEMV ({c})"
            finally:
                gemv.reset()
        out.append((f"widened {narrow}", got.double(), xn.double() @ w.double().T))
    return out


def check(device: str, dtype: torch.dtype, seeds) -> list[str]:
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    failures = []
    for seed in seeds:
        case = random_case(seed, device, dtype)
        for what, got, ref in [("plain", *run_case(case)), *run_act_case(case), *run_widening_case(case)]:
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
