"""MXFP4 routed experts (kernels/moe_triton.py reading gpt-oss's packed FP4 E2M1 weights with E8M0 scales) against the
dequantizing reference: the same kernels' references (kernels/moe.py) on the weights models/quantization.
dequantize_mxfp4 gives in the activation dtype. Each kernel (pairs, fused gate|up+act, down+combine with and without
biases, grouped) at 1, 4 and 11 tokens (1 and 11 on the CPU), at its default tiles and at small ones that leave partial N and K tiles.
Shared by the interpreter test on CPU (float32, small shapes) and the CUDA test (bf16, gpt-oss-20b's expert shapes).

    TRITON_INTERPRET=1 python tests/moe_mxfp4_cases.py        # CPU, the interpreter
    python tests/moe_mxfp4_cases.py gpt-oss-20b               # CUDA, bf16, 32 experts, hidden 2880, intermediate 2880

Weights: random bytes (every code, both nibbles) as [E, N, K / 32, 16] (the checkpoint's layout) viewed as the
kernels' [E, N, K / 2]; scales drawn from 120..130 (2^-7 .. 2^3), where every value is exact in bf16 and float32.

Then layers/moe.py's FusedExperts in its MXFP4 form with gpt-oss's biases and clamped SwiGLU: forward_triton
(the fused and the unfused pairs paths, and the grouped path) against forward_grouped (check_forward).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from moe_fp8_cases import _err, forward_failures

from atlas.kernels import settings
from atlas.layers.moe import MOE_PAIRS_MAX_TOKENS

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # (of the largest output: the output's own rounding)


@dataclasses.dataclass(frozen=True)
class Shape:
    experts: int
    hidden: int  # (K of gate|up, N of down: a multiple of 32)
    intermediate: int  # (K of down: a multiple of 32)
    top_k: int
    tiles: tuple[dict, ...]  # (keyword arguments of each wrapper: block_n / block_k; {} the defaults)
    seeds: int
    default_tiles_upto: int  # (the most tokens run at the default tiles: the interpreter's 4-column pairs are slow)


# hidden 160 = 5 runs of 32: block_k 64 leaves a partial K tile, block_n 64 a partial N tile of down (N = 160) and of
# gate|up's outputs (I = 96, 64 a tile at block_n 128); the default pairs tile (4 x 256 here) a partial K tile too.
SMALL = Shape(experts=8, hidden=160, intermediate=96, top_k=2, seeds=1, default_tiles_upto=1,
              tiles=({}, dict(block_n=64, block_k=64), dict(block_n=128, block_k=32)))
# gpt-oss-20b's experts: K = 2880 is one whole and one partial pairs tile (2048) and 22.5 grouped ones (128).
GPT_OSS_20B = Shape(experts=32, hidden=2880, intermediate=2880, top_k=4, seeds=2, default_tiles_upto=64,
                    tiles=({}, dict(block_n=64, block_k=256)))
TOKENS = (1, 4, 11)


def mxfp4_weight(g: torch.Generator, experts: int, rows: int, cols: int, device: str):
    """Random MXFP4 blocks uint8 [E, rows, cols / 32, 16] and scales uint8 [E, rows, cols / 32] (120..130)."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, device=device, dtype=torch.uint8)
    scales = torch.randint(120, 131, (experts, rows, cols // 32), generator=g, device=device).to(torch.uint8)
    return blocks, scales


# The row-tiles checks' knob values ({}: the defaults, the pairs decode and 4 gate|up columns a program;
# moe_mxfp4_row_runs 0: 16 at SMALL's widths; moe_mxfp4_row_steps: each kernel's own step, stages and decode, 128 runs
# on 8 warps and software pipelining included: stages run on the GPU only)
ROW_TILE_KNOBS = (dict(moe_mxfp4_row_runs=64), {}, dict(moe_mxfp4_row_runs=32), dict(moe_mxfp4_decode="words"),
                  dict(moe_mxfp4_decode="e4m3"), dict(moe_mxfp4_row_steps="gate_up:128:2:e4m3;down:16:3:words"),
                  dict(moe_mxfp4_row_steps="gate_up:16:3:words;down:128:2:e4m3"), dict(moe_mxfp4_down_choices=False),
                  dict(moe_mxfp4_decode="bits", moe_mxfp4_gate_up_cols=0),
                  dict(moe_mxfp4_decode="bits", moe_mxfp4_down_choices=False), dict(moe_mxfp4_gate_up_cols=8),
                  dict(moe_mxfp4_gate_up_cols=0), dict(moe_mxfp4_decode="words-fma"),
                  dict(moe_mxfp4_row_steps="gate_up:0:1:words-fma:8;down:0:1:pairs-fma:4"),
                  dict(moe_mxfp4_row_steps="gate_up:0:2:pairs-fma;down:0:2:words-fma:4", moe_mxfp4_gate_up_cols=8))
# (the interpreter, CI's time: every step width, decode form and kernel still, eight calls a kernel where CUDA takes
# twelve)
INTERPRETER_ROW_TILE_KNOBS = ({}, dict(moe_mxfp4_row_runs=64, moe_mxfp4_decode="words"),
                              dict(moe_mxfp4_row_runs=32, moe_mxfp4_decode="e4m3"), *ROW_TILE_KNOBS[-10:-6],
                              ROW_TILE_KNOBS[-4], dict(moe_mxfp4_row_steps="gate_up:0:1:pairs-fma;down:0:1:pairs-fma:4"))
# (words-fma in both kernels: check_forward's forms)


def _routing(g: torch.Generator, tokens: int, shape: Shape, device: str, dtype: torch.dtype):
    scores = torch.rand(tokens, shape.experts - 1, generator=g, device=device)  # (the last expert gets no token)
    if tokens >= 5:
        scores[:, 0] += 1.0  # (every token chooses expert 0)
    weights, ids = scores.topk(shape.top_k, dim=-1)
    x = _activations(g, tokens, shape.hidden, device, dtype)
    return x, weights.softmax(-1).to(device), ids.to(device)


def _activations(g: torch.Generator, rows: int, cols: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Random rows scaled so the products stay near unit size (the weights' values reach 6 x 2^3)."""
    return (torch.randn(rows, cols, generator=g, device=device) / (8 * cols ** 0.5)).to(dtype)


def check_kernels(device: str, dtype: torch.dtype, shape: Shape) -> list[str]:
    """Every expert kernel with MXFP4 w13 / w2 against the references on the dequantized weights -> failures."""
    from atlas.kernels.fused_ops import act_and_mul
    from atlas.kernels.fused_ops_triton import ACT_SILU
    from atlas.kernels.moe import grouped_ref, pairs_ref
    from atlas.kernels.moe_triton import (
        MXFP4_FOLD_MAX_SCALE,
        moe_grouped_matmul,
        moe_pairs_down_combine,
        moe_pairs_gate_up_act,
        moe_pairs_matmul,
    )
    from atlas.models.quantization import dequantize_mxfp4

    tol, failures = TOLERANCE[dtype], []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = _err(got, want)
        if got.dtype != dtype or got.shape != want.shape or not err <= tol:
            failures.append(f"{dtype} {name}: {got.dtype} {tuple(got.shape)}, max error {err:.3g} > {tol}")

    e, hid, inter, k = shape.experts, shape.hidden, shape.intermediate, shape.top_k
    for seed in range(shape.seeds):
        g = torch.Generator(device).manual_seed(900 + seed)
        b13, s13 = mxfp4_weight(g, e, 2 * inter, hid, device)
        b2, s2 = mxfp4_weight(g, e, hid, inter, device)
        w13, w2 = (dequantize_mxfp4(b, s, dtype, device) for b, s in ((b13, s13), (b2, s2)))
        p13, p2 = b13.view(e, 2 * inter, hid // 2), b2.view(e, hid, inter // 2)  # (the kernels' packed view)
        bias = torch.randn(e, hid, generator=g, device=device).to(dtype)
        for tokens in TOKENS if device == "cuda" else (1, 5):  # (the CPU's interpreter: CI's time)
            x, weights, ids = _routing(g, tokens, shape, device, dtype)
            weights[0, -1] = 0.0  # (a pair of weight 0: the fused kernels skip it, its h row zeros)
            h_in = _activations(g, tokens * k, inter, device, dtype)
            counts = torch.randint(0, 6, (e,), generator=g, device=device)
            counts[seed % e] = 0
            counts[(seed + 1) % e] = 20 + tokens  # (two chunks of 16)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            rows13 = _activations(g, int(counts.sum()), hid, device, dtype)
            rows2 = _activations(g, int(counts.sum()), inter, device, dtype)
            want_h = act_and_mul(pairs_ref(x, w13, ids, k).to(dtype), "silu")
            want_h[k - 1] = 0
            per_pair = pairs_ref(want_h, w2, ids, 1).view(tokens, k, -1)
            # (past default_tiles_upto the interpreter's default 4-column pairs tiles are slow; past one token on
            #  the CPU, one other tile config is enough)
            tiled = shape.tiles if tokens <= shape.default_tiles_upto else shape.tiles[1:]
            for tiles in tiled if device == "cuda" or tokens == 1 else tiled[:1]:
                tag = f"seed {seed}, {tokens} token(s), tiles {tiles or 'default'}:"
                check(f"{tag} pairs w13", moe_pairs_matmul(x, p13, ids, k, scale=s13, **tiles),
                      pairs_ref(x, w13, ids, k))
                check(f"{tag} pairs w2", moe_pairs_matmul(h_in, p2, ids, 1, scale=s2, **tiles),
                      pairs_ref(h_in, w2, ids, 1))
                gu_tiles = dict(tiles, block_n=2 * tiles["block_n"]) if "block_n" in tiles else tiles
                check(f"{tag} gate|up+act", moe_pairs_gate_up_act(x, p13, ids, weights, ACT_SILU, scale=s13,
                                                                  **gu_tiles), want_h)
                if not tiles:  # (the row tiles, the moe_mxfp4_row_tiles knob: bf16 activations, the interpreter too;
                    # at each step size of the moe_mxfp4_row_runs knob, 0 the one that pads least)
                    xb, w13b = x.to(torch.bfloat16), dequantize_mxfp4(b13, s13, torch.bfloat16, device)
                    want_hb = act_and_mul(pairs_ref(xb, w13b, ids, k).to(torch.bfloat16), "silu")
                    want_hb[k - 1] = 0
                    for knobs in ROW_TILE_KNOBS if device == "cuda" else INTERPRETER_ROW_TILE_KNOBS:
                        with settings.tuned(**knobs):
                            got = moe_pairs_gate_up_act(xb, p13, ids, weights, ACT_SILU, scale=s13, row_tiles=True)
                        err = _err(got, want_hb)
                        if not (got.dtype == torch.bfloat16 and err <= TOLERANCE[torch.bfloat16]
                                and not got[k - 1].any()):
                            failures.append(f"{tag} gate|up+act in row tiles (bf16, {knobs or 'defaults'}): max "
                                            f"error {err:.3g}")
                check(f"{tag} down+combine", moe_pairs_down_combine(want_h, p2, ids, weights, scale=s2, **tiles),
                      (per_pair * weights.unsqueeze(-1)).sum(1))
                with_bias = (per_pair + bias[ids].float()) * weights.unsqueeze(-1)
                check(f"{tag} down+combine+bias", moe_pairs_down_combine(want_h, p2, ids, weights, bias, scale=s2,
                                                                         **tiles), with_bias.sum(1))
                if not tiles:  # (the row tiles: bf16 h, in the interpreter too)
                    hb, w2b = want_h.to(torch.bfloat16), dequantize_mxfp4(b2, s2, torch.bfloat16, device)
                    per_pair_b = pairs_ref(hb, w2b, ids, 1).view(tokens, k, -1)
                    want_b = ((per_pair_b + bias[ids].float()) * weights.unsqueeze(-1)).sum(1)
                    for knobs in ROW_TILE_KNOBS if device == "cuda" else INTERPRETER_ROW_TILE_KNOBS:
                        with settings.tuned(**knobs):
                            got = moe_pairs_down_combine(hb, p2, ids, weights, bias.to(torch.bfloat16), scale=s2,
                                                         row_tiles=True)
                        err = _err(got, want_b)
                        if not (got.dtype == torch.bfloat16 and got.shape == want_b.shape
                                and err <= TOLERANCE[torch.bfloat16]):
                            failures.append(f"{tag} down+combine+bias in row tiles (bf16, {knobs or 'defaults'}): "
                                            f"max error {err:.3g}")
                        if device == "cuda" and not knobs:  # (the L2 prefetch of another weight: a hint only)
                            again = moe_pairs_down_combine(hb, p2, ids, weights, bias.to(torch.bfloat16), scale=s2,
                                                           row_tiles=True, prefetch=p13)
                            if not torch.equal(again, got):
                                failures.append(f"{tag} down+combine+bias in row tiles with an L2 prefetch: "
                                                f"not bit for bit the same")
                check(f"{tag} down+combine+bias (rows)", moe_pairs_down_combine(
                    want_h, p2, ids, weights, bias, scale=s2, rows=True,
                    **{key: v for key, v in tiles.items() if key == "block_n"}), with_bias.sum(1))
                if tokens == TOKENS[0] or device == "cuda":  # (the grouped rows do not depend on the token count)
                    gr_tiles = dict(tiles, block_n=max(16, tiles["block_n"])) if "block_n" in tiles else tiles
                    check(f"{tag} grouped w13", moe_grouped_matmul(rows13, p13, offsets, scale=s13, **gr_tiles),
                          grouped_ref(rows13, w13, offsets))
                    check(f"{tag} grouped w2", moe_grouped_matmul(rows2, p2, offsets, scale=s2, **gr_tiles),
                          grouped_ref(rows2, w2, offsets))
                    # the expert biases added by the kernel: its product then the gathered bias rows' add, bit for bit
                    row_experts = torch.repeat_interleave(torch.arange(e, device=device), counts)
                    plain = moe_grouped_matmul(rows2, p2, offsets, scale=s2, **gr_tiles)
                    got = moe_grouped_matmul(rows2, p2, offsets, scale=s2, bias=bias, **gr_tiles)
                    if not torch.equal(got, plain + bias.index_select(0, row_experts)):
                        failures.append(f"{tag} grouped w2 with the expert biases: differs from the product then "
                                        f"the add")
                    if device == "cuda" or not tiles:  # (the bf16 pairs decode, moe_mxfp4_dot_pairs: on CUDA the
                        # float32 decode's bf16 weights and tensor-core products, bit for bit; in the interpreter, whose
                        # bf16 grouped products are wrong, its float32 products against the reference)
                        for name, rows, packed, sc, ref_w in (("w13", rows13, p13, s13, (b13, s13)),
                                                              ("w2", rows2, p2, s2, (b2, s2))):
                            rows = rows.to(torch.bfloat16)
                            with settings.tuned(moe_mxfp4_dot_pairs=True):
                                got = moe_grouped_matmul(rows, packed, offsets, scale=sc, **gr_tiles)
                                # (folded, under scales clamped to MXFP4_FOLD_MAX_SCALE: the unfolded bits)
                                low = sc.clamp(max=MXFP4_FOLD_MAX_SCALE)
                                folded = moe_grouped_matmul(rows, packed, offsets, scale=low, fold=True, **gr_tiles)
                                unfolded = moe_grouped_matmul(rows, packed, offsets, scale=low, **gr_tiles)
                            if not torch.equal(folded, unfolded):
                                failures.append(f"{tag} grouped {name} in folded bf16 pairs: "
                                                f"{int((folded != unfolded).sum())} value(s) differ from unfolded")
                            if device == "cuda":
                                want = moe_grouped_matmul(rows, packed, offsets, scale=sc, **gr_tiles)
                                if not torch.equal(got, want):
                                    failures.append(f"{tag} grouped {name} in bf16 pairs: {int((got != want).sum())} "
                                                    f"value(s) differ from the float32 decode")
                            else:
                                want = grouped_ref(rows, dequantize_mxfp4(*ref_w, torch.bfloat16, device), offsets)
                                err = _err(got, want)
                                if not (got.dtype == torch.bfloat16 and err <= TOLERANCE[torch.bfloat16]):
                                    failures.append(f"{tag} grouped {name} in bf16 pairs: max error {err:.3g}")
    return failures


def check_decoding(device: str) -> list[str]:
    """Every byte (both nibbles, all 16 codes each) under scales from 2^-127 (code 0, a float32 subnormal: CPU only)
    to 2^123, read through the pairs kernel by one-hot rows (y = W^T, one product a sum), equals dequantize_mxfp4's
    float32 weights exactly; through the grouped kernel's bf16 pairs (scales from 2^-125), its bf16 weights, also
    with the scales' fold (scale codes up to MXFP4_FOLD_MAX_SCALE)."""
    from atlas.kernels.moe_triton import MXFP4_FOLD_MAX_SCALE, moe_grouped_matmul, moe_pairs_matmul
    from atlas.models.quantization import dequantize_mxfp4

    # (one run of 32 a row, 16 bytes: rows 16 j .. 16 j + 15 hold every byte value once, under scale code j, so
    #  each byte meets every code; one tile of 128 rows a token, 32 one-hot tokens: few interpreter programs)
    codes = [0, 1, 100, 126, 127, 128, 200, 250] if device == "cpu" else [1, 100, 126, 127, 128, 200, 250]
    rows, cols = 16 * len(codes), 32
    blocks = torch.arange(256, device=device).repeat(len(codes)).to(torch.uint8).view(1, rows, 1, 16)
    scales = torch.tensor(codes, device=device).repeat_interleave(16).view(1, rows, 1).to(torch.uint8)
    want = dequantize_mxfp4(blocks, scales, torch.float32, device)[0].T
    eye = torch.eye(cols, device=device)
    got = moe_pairs_matmul(eye, blocks.view(1, rows, cols // 2), torch.zeros(cols, 1, dtype=torch.int64,
                                                                             device=device), 1, scale=scales,
                           block_n=128, block_k=32)
    failures = [] if torch.equal(got, want) else [f"MXFP4 decoding: {int((got != want).sum())} weight(s) differ"]
    # the grouped kernel's bf16 pairs (moe_mxfp4_dot_pairs) on bf16 one-hot rows: its first product takes the code
    # 0.5 as a bf16 subnormal (2^-127 before its 2^126), which must not flush; scales from 2^-125, whose weights are
    # normal (the interpreter's float32 products flush subnormal ones)
    codes = [2, 3, 100, 126, 127, 128, 200, 250]
    rows = 16 * len(codes)
    blocks = torch.arange(256, device=device).repeat(len(codes)).to(torch.uint8).view(1, rows, 1, 16)
    scales = torch.tensor(codes, device=device).repeat_interleave(16).view(1, rows, 1).to(torch.uint8)
    want = dequantize_mxfp4(blocks, scales, torch.bfloat16, device)[0].T
    with settings.tuned(moe_mxfp4_dot_pairs=True):
        got = moe_grouped_matmul(torch.eye(cols, device=device, dtype=torch.bfloat16), blocks.view(1, rows, cols // 2),
                                 torch.tensor([0, cols], device=device), scale=scales, block_n=128, block_k=32)
    if not torch.equal(got, want):
        failures.append(f"MXFP4 decoding in bf16 pairs: {int((got != want).sum())} weight(s) differ")
    # folded (fold: every scale code at most MXFP4_FOLD_MAX_SCALE, one multiply by 2^(s - 1) a pair): the same weights
    folded = scales.clamp(max=MXFP4_FOLD_MAX_SCALE)
    want = dequantize_mxfp4(blocks, folded, torch.bfloat16, device)[0].T
    with settings.tuned(moe_mxfp4_dot_pairs=True):
        got = moe_grouped_matmul(torch.eye(cols, device=device, dtype=torch.bfloat16), blocks.view(1, rows, cols // 2),
                                 torch.tensor([0, cols], device=device), scale=folded, block_n=128, block_k=32,
                                 fold=True)
    if not torch.equal(got, want):
        failures.append(f"MXFP4 decoding in folded bf16 pairs: {int((got != want).sum())} weight(s) differ")
    return failures


def check_refusals(device: str) -> list[str]:
    """A block_k that splits a run of 32 columns, and scales of the wrong shape, are refused."""
    from atlas.kernels.moe_triton import moe_pairs_matmul

    g = torch.Generator(device).manual_seed(1)
    blocks, scales = mxfp4_weight(g, 2, 8, 64, device)
    x, ids = torch.randn(1, 64, device=device), torch.zeros(1, 1, dtype=torch.int64, device=device)
    failures = []
    for name, kwargs in (("block_k 16", dict(scale=scales, block_k=16)), ("scales [E, N, 1]", dict(scale=scales[..., :1])),
                         ("no scales", {})):
        try:
            moe_pairs_matmul(x, blocks.view(2, 8, 32), ids, 1, **kwargs)
        except AssertionError:
            continue
        failures.append(f"MXFP4 weights with {name} were not refused")
    return failures


# FusedExperts' MXFP4 form with gpt-oss's biases and clamped SwiGLU (forward_triton against forward_grouped):
# 32 wide both ways (one run of 32 a row; check_kernels' shapes have several), small enough for the interpreter's
# 4-column pairs tiles.
FORWARD = Shape(experts=4, hidden=32, intermediate=32, top_k=2, seeds=1, default_tiles_upto=0, tiles=({},))
SWIGLU = (1.702, 1.5)  # (alpha; a limit small enough that both clamps bind)


def mxfp4_experts(g: torch.Generator, shape: Shape, device: str, dtype: torch.dtype):
    """A FusedExperts in the MXFP4 form (gpt-oss's: biases, clamped SwiGLU), random codes, scales and
    biases; built as the model builds it, in the activations' dtype (its biases' dtype)."""
    from atlas.layers.moe import FusedExperts
    from atlas.models.loader import constructing

    with constructing(torch.device(device), dtype):
        experts = FusedExperts(shape.experts, shape.hidden, shape.intermediate, "silu", bias=True,
                               swiglu=SWIGLU, mxfp4=True)
    e, hid, inter = shape.experts, shape.hidden, shape.intermediate
    with torch.no_grad():
        for w, s, rows, cols in ((experts.w13, experts.w13_scales, 2 * inter, hid),
                                 (experts.w2, experts.w2_scales, hid, inter)):
            blocks, scales = mxfp4_weight(g, e, rows, cols, device)
            w.copy_(blocks.view(e, rows, cols // 2))
            s.copy_(scales)
        experts.b13.copy_(torch.randn(experts.b13.shape, generator=g, device=device))
        experts.b2.copy_(torch.randn(experts.b2.shape, generator=g, device=device))
    assert experts.b13.dtype == experts.b2.dtype == dtype
    return experts


def check_forward(device: str, dtype: torch.dtype, shape: Shape, tokens=(1, 4, 9)) -> list[str]:
    """FusedExperts.forward_triton (with the fused-pairs knob: the fused gate|up kernel with the bias and the
    clamped SwiGLU as its epilogue, then down+combine with the down bias; without it the unfused pairs; the
    grouped path above MOE_PAIRS_MAX_TOKENS) against forward_grouped (dequantize_mxfp4's weights, then the
    reference math), biases and clamped SwiGLU included -> failures. On CUDA also that forward takes the
    Triton path (at every token count)."""
    tol, failures = TOLERANCE[dtype], []
    # (the MXFP4 row tiles take bf16 activations: bf16 there, in the interpreter too)
    for fused, row_tiles, decode in ((True, False, "bits"), (False, False, "bits"), (True, True, "bits"),
                                     (True, True, "words"), (True, True, "e4m3"), (True, True, "pairs"),
                                     (True, True, "words-fma")):
        with settings.tuned(moe_fused_pairs=fused, moe_mxfp4_row_tiles=row_tiles, moe_mxfp4_decode=decode):
            dtype = torch.bfloat16 if row_tiles else dtype
            tol = TOLERANCE[dtype]
            for t in tokens if not fused else [t for t in tokens if t <= 4]:  # (above: grouped either way)
                g = torch.Generator(device).manual_seed(950 + t)
                experts = mxfp4_experts(g, shape, device, dtype)
                x, weights, ids = _routing(g, t, shape, device, dtype)
                x = x * 64  # (gate|up products of a few units: both clamps of the SwiGLU bind)
                w13, _ = experts.dequantized(dtype)
                h = w13[ids[0]].float() @ x[0].float() + experts.b13[ids[0]].float()  # (token 0's choices)
                i = shape.intermediate
                if not ((h[:, :i] > SWIGLU[1]).any() and (h[:, i:].abs() > SWIGLU[1]).any()):
                    failures.append(f"{dtype} MXFP4 FusedExperts, {t} tokens: the SwiGLU clamps do not bind")
                failures += forward_failures(experts, x, weights, ids, tol, f"{dtype} MXFP4 FusedExperts (biases, "
                                             f"clamped SwiGLU), {t} tokens, fused pairs {fused}, row tiles "
                                             f"{row_tiles}, decode {decode}")
    failures += check_forward_folded(device, shape, [t for t in tokens if t > MOE_PAIRS_MAX_TOKENS])
    return failures


def check_forward_folded(device: str, shape: Shape, tokens) -> list[str]:
    """The grouped path in bf16 with the scales' fold (the moe_mxfp4_fold knob; note_mxfp4_scales after loading: every
    scale code at most MXFP4_FOLD_MAX_SCALE) against forward_grouped, and on CUDA bit for bit the unfolded output;
    scale codes above it (mxfp4_weight's reach 130) keep it off."""
    from atlas.kernels.moe_triton import MXFP4_FOLD_MAX_SCALE
    from atlas.layers.moe import note_mxfp4_scales

    failures, dtype = [], torch.bfloat16
    for t in tokens:
        g = torch.Generator(device).manual_seed(970 + t)
        experts = mxfp4_experts(g, shape, device, dtype)
        if note_mxfp4_scales(experts) or experts.mxfp4_fold:
            failures.append(f"MXFP4 FusedExperts, {t} tokens: scale codes up to "
                            f"{int(experts.w13_scales.max())} fold")
        with torch.no_grad():
            experts.w13_scales.clamp_(max=MXFP4_FOLD_MAX_SCALE)
            experts.w2_scales.clamp_(max=MXFP4_FOLD_MAX_SCALE)
        if note_mxfp4_scales(experts) != 1 or not experts.mxfp4_fold:
            failures.append(f"MXFP4 FusedExperts, {t} tokens: scale codes within {MXFP4_FOLD_MAX_SCALE} do not fold")
        x, weights, ids = _routing(g, t, shape, device, dtype)
        with settings.tuned(moe_mxfp4_fold=True):
            failures += forward_failures(experts, x * 64, weights, ids, TOLERANCE[dtype],
                                         f"{dtype} MXFP4 FusedExperts, {t} tokens, the scales folded")
            folded = experts.forward_triton(x * 64, weights, ids)
        with settings.tuned(moe_mxfp4_fold=False):
            unfolded = experts.forward_triton(x * 64, weights, ids)
        if x.is_cuda and not torch.equal(folded, unfolded):
            failures.append(f"MXFP4 FusedExperts, {t} tokens: the scales' fold changes the output")
    return failures


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = GPT_OSS_20B if sys.argv[1:] == ["gpt-oss-20b"] else SMALL
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.no_grad():
        problems = check_decoding(device) + check_kernels(device, dtype, shape) + check_refusals(device)
        problems += check_forward(device, dtype, *((shape,) if device == "cuda" else (FORWARD, (1, 9))))
    print("\n".join(problems))
    print(f"MXFP4 MoE cases ({device}, {dtype}, {shape}): {len(problems)} failure(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
