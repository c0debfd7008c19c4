"""Random problems for MLA's absorbed products (kernels/mla_absorb_triton.py), shared by the tests (Triton's CPU
interpreter in CI, the GPU in the CUDA test).

Run as a script (`python tests/mla_absorb_cases.py [N]`) it checks both kernels against the batched matmul on the
default device (float32, bfloat16, float16) and exits non-zero on a mismatch. Tolerance: the kernels sum in
float32 in another order than the reference, so each element is within an ulp of the dtype (and 2e-5 relative in
float32) of the product computed in float64 and rounded once, as the reference is.
"""

from __future__ import annotations

import os
import sys

import torch


def case(seed: int, device: str, dtype: torch.dtype) -> dict:
    """The layer's own views: q_nope a strided slice of q [T, H * (P + R)]; W_UK and W_UV views of kv_b_proj's
    weight [H * (P + V), L]; o_latent [T, H, L] contiguous or a head-major transpose. (V2-Lite's 16 and V3's 128
    heads on the GPU only: Triton's interpreter takes minutes over them.)"""
    g = torch.Generator().manual_seed(seed)
    heads = [16, 3, 1, 20, 128][seed % 5] if device != "cpu" else [2, 3, 1, 2][seed % 4]
    nope, rope, v, latent = [(128, 64, 128, 512), (16, 8, 24, 32), (32, 16, 16, 96), (64, 8, 48, 200)][seed % 4]
    rows = [1, 2, 4, 5, 16, 7][seed % 6]
    q = torch.randn(rows, heads * (nope + rope), generator=g).to(dtype)
    q_nope = q.view(rows, heads, nope + rope)[..., :nope]
    w = (torch.randn(heads * (nope + v), latent, generator=g) * 0.1).to(dtype).view(heads, nope + v, latent)
    o = torch.randn(heads, rows, latent, generator=g).to(dtype)
    o_latent = o.transpose(0, 1) if seed % 2 else o.transpose(0, 1).contiguous()
    return dict(q_nope=q_nope.to(device), w_uk=w[:, :nope].to(device), o_latent=o_latent.to(device),
                w_uv=w[:, nope:].to(device))


def _within_an_ulp(got: torch.Tensor, exact: torch.Tensor, noise: torch.Tensor, dtype: torch.dtype) -> str | None:
    """got within an ulp of exact rounded to dtype, plus float32's summation noise over the terms' magnitudes
    (noise: the product of the operands' absolute values)."""
    if got.dtype != dtype or got.shape != exact.shape:
        return f"got {tuple(got.shape)} {got.dtype}, expected {tuple(exact.shape)} {dtype}"
    rounded = exact.to(dtype)
    ulp = (torch.nextafter(rounded, torch.tensor(float("inf"), dtype=dtype)).double() - rounded.double()).abs()
    bound = (0.0 if dtype == torch.float32 else 1.01) * ulp + 4e-6 * noise + (rounded.double() - exact).abs()
    bad = (got.double() - exact).abs() > bound
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        return f"{int(bad.sum())} of {bad.numel()} off (first: {float(got.flatten()[i])} vs {float(exact.flatten()[i])})"
    return None


def check(device: str, seeds) -> list[str]:
    from atlas.kernels.mla_absorb import absorb_query_ref, expand_values_ref
    from atlas.kernels.mla_absorb_triton import absorb_query_triton, expand_values_triton

    problems = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for seed in seeds:
            c = case(seed, device, dtype)
            x, w, o, wv = (c[k].double() for k in ("q_nope", "w_uk", "o_latent", "w_uv"))
            exact_q, noise_q = absorb_query_ref(x, w), absorb_query_ref(x.abs(), w.abs())
            exact_v, noise_v = expand_values_ref(o, wv), expand_values_ref(o.abs(), wv.abs())
            for name, got, exact, noise in (
                    ("absorb_query", absorb_query_triton(c["q_nope"], c["w_uk"]), exact_q, noise_q),
                    ("expand_values", expand_values_triton(c["o_latent"], c["w_uv"]), exact_v, noise_v)):
                problem = _within_an_ulp(got, exact, noise, dtype)
                if problem:
                    shape = tuple(c["q_nope"].shape) + (c["w_uk"].shape[2], c["w_uv"].shape[1])
                    problems.append(f"{name} {dtype} seed {seed} (T, H, P, L, V = {shape}): {problem}")
    return problems


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    found = check(dev, range(n))
    print("\n".join(found) or f"{n} cases agree ({dev})")
    sys.exit(1 if found else 0)
