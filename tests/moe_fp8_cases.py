"""FP8 routed experts (kernels/moe_triton.py reading float8_e4m3fn weights with block scales) against the dequantizing
reference: the same kernels' references (kernels/moe.py) on the dequantized weights (layers/moe.dequantize_experts:
FP8 x scale in float32, rounded to the activation dtype), and FusedExperts.forward_triton against forward_grouped
(which dequantizes and runs the reference math) at 1-30 tokens, fused pairs on and off. Shared by the interpreter
test on CPU (float32, small shapes) and the CUDA test (bf16, DeepSeek-V3-like shapes: 128x128 blocks).

    TRITON_INTERPRET=1 python tests/moe_fp8_cases.py          # CPU, the interpreter
    python tests/moe_fp8_cases.py v3                          # CUDA, bf16, hidden 7168, intermediate 2048

The interpreter's tl.dot cannot take an FP8 operand: the kernels convert each tile to the activation dtype first (as
they do on the GPU), so the interpreter runs them in float32.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # (of the largest output: the output's own rounding)
FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Shape:
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    block: tuple[int, int] | None  # (None: a scale per row)


SMALL_ROWS = Shape(experts=8, hidden=44, intermediate=32, top_k=2, block=None)
SMALL = Shape(experts=8, hidden=44, intermediate=32, top_k=2, block=(16, 8))  # (44: partial scale blocks)
# The kernels' other scale loads: blocks wider than the grouped kernel's 128-column tile (one scale a row and tile), and
# blocks whose width neither divides nor is divided by a tile's (a scale per element).
SMALL_WIDE = Shape(experts=8, hidden=44, intermediate=32, top_k=2, block=(8, 256))
SMALL_ODD = Shape(experts=8, hidden=44, intermediate=32, top_k=2, block=(16, 12))
V3 = Shape(experts=16, hidden=7168, intermediate=2048, top_k=8, block=(128, 128))  # (DeepSeek-V3's experts, 16 of them)


def _fp8_weight(g: torch.Generator, shape: tuple[int, ...], block: tuple[int, int], device: str):
    """Random FP8 values [E, N, K] and float32 block scales [E, ceil(N / bn), ceil(K / bk)] (block None: [E, N]) of
    a weight of unit variance scaled by 1 / sqrt(K), each block's (row's) scale its own."""
    e, n, k = shape
    bn, bk = block if block is not None else (1, k)
    q = (torch.randn(shape, generator=g, device=device) * 64).clamp(-448, 448).to(FP8)
    scale = torch.rand(e, -(-n // bn), -(-k // bk), generator=g, device=device) * (1.5 / 64 / k ** 0.5)
    scale = scale + 0.5 / 64 / k ** 0.5
    return q, scale if block is not None else scale.view(e, n)


def fp8_experts(seed: int, device: str, shape: Shape):
    """A FusedExperts built as an FP8 checkpoint's (inside `quantizing` of a block scheme), random FP8 weights."""
    from atlas.layers.linear import Fp8Scheme, quantizing
    from atlas.layers.moe import FusedExperts

    g = torch.Generator(device).manual_seed(700 + seed)  # (drawn where they run: V3's experts are large)
    scheme = (Fp8Scheme("block", shape.block, "dynamic", "weight_scale_inv") if shape.block is not None
              else Fp8Scheme("channel", None, "dynamic", "weight_scale"))
    with torch.device(device), quantizing(scheme):
        experts = FusedExperts(shape.experts, shape.hidden, shape.intermediate, "silu")
    assert experts.fp8 is not None and experts.w13.dtype == FP8
    with torch.no_grad():
        for w, s in ((experts.w13, experts.scale_of(experts.w13)), (experts.w2, experts.scale_of(experts.w2))):
            q, scale = _fp8_weight(g, tuple(w.shape), shape.block, device)
            w.copy_(q)
            s.copy_(scale)
    return experts, g


def _routing(g: torch.Generator, tokens: int, shape: Shape, device: str, dtype: torch.dtype):
    scores = torch.rand(tokens, shape.experts - 1, generator=g, device=device)  # (the last expert gets no token)
    if tokens >= 9:
        scores[:, 0] += 1.0  # (every token chooses expert 0: several chunks of 16 rows at 30)
    weights, ids = scores.topk(shape.top_k, dim=-1)
    x = torch.randn(tokens, shape.hidden, generator=g, device=device).to(dtype)
    return x, weights.softmax(-1).to(device), ids.to(device)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def check_kernels(device: str, dtype: torch.dtype, shape: Shape, seeds=range(4)) -> list[str]:
    """moe_pairs_matmul and moe_grouped_matmul with FP8 w13 / w2 against pairs_ref / grouped_ref of the dequantized
    weights; moe_pairs_gate_up_act and moe_pairs_down_combine against the unfused pairs path of the dequantized
    weights."""
    from atlas.kernels.fused_ops import act_and_mul
    from atlas.kernels.fused_ops_triton import ACT_SILU
    from atlas.kernels.moe import grouped_ref, pairs_ref
    from atlas.kernels.moe_triton import (
        moe_grouped_matmul,
        moe_pairs_down_combine,
        moe_pairs_gate_up_act,
        moe_pairs_matmul,
    )
    from atlas.layers.moe import dequantize_experts

    tol, failures = TOLERANCE[dtype], []
    for seed in seeds:
        experts, g = fp8_experts(seed, device, shape)
        block = shape.block
        pairs = [(w, experts.scale_of(w)) for w in (experts.w13, experts.w2)]
        for name, (w, s) in zip(("w13", "w2"), pairs, strict=True):
            deq = dequantize_experts(w, s, block, dtype)
            tokens = 1 + seed % 4
            x, weights, ids = _routing(g, tokens, shape, device, dtype)
            if name == "w2":
                x = torch.randn(tokens * shape.top_k, shape.intermediate, generator=g, device=device).to(dtype)
            topk = shape.top_k if name == "w13" else 1
            got = moe_pairs_matmul(x, w, ids, topk, scale=s, block=block)
            err = _err(got, pairs_ref(x, deq, ids, topk))
            if got.dtype != dtype or not err <= tol:
                failures.append(f"{dtype} seed {seed} pairs {name}: {got.dtype}, max error {err:.3g} > {tol}")
            counts = torch.randint(0, 6, (shape.experts,), generator=g, device=device)
            counts[seed % shape.experts] = 0
            counts[(seed + 1) % shape.experts] = 20 + seed  # (two chunks of 16)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            rows = torch.randn(int(counts.sum()), w.shape[2], generator=g, device=device).to(dtype)
            got = moe_grouped_matmul(rows, w, offsets, scale=s, block=block)
            err = _err(got, grouped_ref(rows, deq, offsets))
            if got.dtype != dtype or not err <= tol:
                failures.append(f"{dtype} seed {seed} grouped {name}: {got.dtype}, max error {err:.3g} > {tol}")
        # the fused pairs kernels against the unfused ones on the dequantized weights
        s13, s2 = experts.scale_of(experts.w13), experts.scale_of(experts.w2)
        w13 = dequantize_experts(experts.w13, s13, block, dtype)
        w2 = dequantize_experts(experts.w2, s2, block, dtype)
        x, weights, ids = _routing(g, 1 + seed % 4, shape, device, dtype)
        weights[0, -1] = 0.0  # (a pair of weight 0: skipped, its h row zeros)
        want_h = act_and_mul(pairs_ref(x, w13, ids, shape.top_k).to(dtype), "silu")
        want_h[shape.top_k - 1] = 0
        for row_tiles in (False, True):  # (the pairs kernel; the FP8 row-tiles GEMV where the blocks fit it)
            h = moe_pairs_gate_up_act(x, experts.w13, ids, weights, ACT_SILU, scale=s13, block=block,
                                      row_tiles=row_tiles)
            err = _err(h, want_h)
            if not (err <= tol and h.shape == want_h.shape and not h[shape.top_k - 1].any()):
                failures.append(f"{dtype} seed {seed} gate|up+act (row tiles {row_tiles}): max error {err:.3g} > "
                                f"{tol}")
        per_pair = pairs_ref(want_h, w2, ids, 1).view(*ids.shape, -1)
        for rows in (False, True):  # (one expert after another; a token's choices in one tile)
            y = moe_pairs_down_combine(want_h, experts.w2, ids, weights, scale=s2, block=block, rows=rows)
            err = _err(y, (per_pair * weights.unsqueeze(-1)).sum(1))
            if not err <= tol:
                failures.append(f"{dtype} seed {seed} down+combine (rows {rows}): max error {err:.3g} > {tol}")
    return failures


def forward_failures(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, tol: float,
                     name: str) -> list[str]:
    """A quantized FusedExperts' forward_triton against its forward_grouped (dequantize, then the reference math),
    and on CUDA that forward takes the Triton path -> failures (also moe_mxfp4_cases.py's)."""
    got = experts.forward_triton(x, weights, ids)
    err = _err(got, experts.forward_grouped(x, weights, ids))
    failures = []
    if got.dtype != x.dtype or got.shape != x.shape or not err <= tol:
        failures.append(f"{name}: {got.dtype} {tuple(got.shape)}, max error {err:.3g} > {tol}")
    if x.is_cuda and not torch.equal(experts(x, weights, ids), got):
        failures.append(f"{name}: forward did not take the Triton path")
    return failures


def check_forward(device: str, dtype: torch.dtype, shape: Shape, tokens=(1, 3, 4, 5, 9, 30)) -> list[str]:
    """FusedExperts.forward_triton (fused pairs on and off, the FP8 row tiles, grouped) against forward_grouped
    (dequantize, then the reference math) -> failures. On CUDA also that forward takes the Triton path at every token
    count."""
    from atlas.kernels import settings

    tol, failures = TOLERANCE[dtype], []
    for fused, row_tiles in ((True, False), (True, True), (False, False)):
        with settings.tuned(moe_fused_pairs=fused, moe_row_tiles=row_tiles):
            for i, t in enumerate(tokens if not row_tiles else tokens[:2]):
                experts, g = fp8_experts(i, device, shape)
                x, weights, ids = _routing(g, t, shape, device, dtype)
                failures += forward_failures(experts, x, weights, ids, tol, f"{dtype} FP8 experts, {t} tokens, "
                                             f"fused pairs {fused}, row tiles {row_tiles}")
    return failures


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = V3 if sys.argv[1:] == ["v3"] else SMALL
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = [shape] if device == "cuda" else [shape, SMALL_ROWS, SMALL_WIDE, SMALL_ODD]
    problems = []
    with torch.no_grad():
        for s in shapes:
            # (the other scale layouts: one seed and one forward size each, for CI's time)
            # (the CPU: 1 and 3 tokens of the pairs kernels, then 1, 4 (pairs) and 5, 30 (grouped) through forward)
            cpu = device == "cpu"
            problems += check_kernels(device, dtype, s, (0, 2) if s is SMALL and cpu else range(4) if s is SMALL
                                      else range(1)) + check_forward(
                device, dtype, s, ((1, 4, 5, 30) if cpu else (1, 3, 4, 5, 9, 30)) if s is SMALL
                else (1, 9) if s is SMALL_ROWS else (1,))
    print("\n".join(problems))
    print(f"FP8 MoE cases ({device}, {dtype}, {shapes}): {len(problems)} failure(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
