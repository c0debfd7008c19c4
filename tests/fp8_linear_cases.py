"""Random FP8 linear problems (kernels/fp8_linear_triton.py against kernels/fp8_linear.py's references), shared by
the interpreter test on CPU (float32 activations) and the CUDA tests (bf16, real 128 x 128 blocks).

Tolerances, as a fraction of the largest |reference| of the case (`TOL`):
- GEMV (one row) and W8A16 (a few rows) against the float64 product of x and the dequantized weight: the kernels
  multiply the same FP8 values by the same scales and sum in float32; in bf16 the result's rounding (2^-9
  relative) and the W8A16's rounding of each dequantized weight to bf16 (as the reference does) leave ~2^-7;
- the block W8A8 GEMM against w8a8_ref (the same quantized activations, summed in float32): only the summation
  order and the output rounding differ, ~2^-7 in bf16;
- and W8A8 against the unquantized-activation reference: FP8 activations carry ~2^-4 relative error each, which
  averages over K: the output's relative L2 error stays under W8A8_REL_L2.

Run as a script it checks the default device (CUDA in bf16, else CPU in float32 through Triton's interpreter when
TRITON_INTERPRET=1) and exits non-zero on a mismatch (`PART/PARTS`: every PARTS-th case from PART only):

    TRITON_INTERPRET=1 python tests/fp8_linear_cases.py [0/2]
"""

from __future__ import annotations

import sys

import torch
import triton

from atlas.kernels import settings

TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}
# FP8 x FP8 products summed by the GPU's tensor cores (the W8A8 GEMMs): Hopper's FP8 MMA keeps about 14 bits of the
# sum inside a K tile (the reason DeepSeek-V3 promotes partial sums), so float32 activations cannot hold 1e-5 there:
# measured on the H200, 1.3e-4 of the largest output at K = 96.
TOL_FP8_MMA = 2 ** -10
W8A8_REL_L2 = 0.05


def random_fp8(n: int, k: int, block: tuple[int, int] | None, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight quantized as a checkpoint would be: FP8 values over the whole range, with their scales."""
    from atlas.kernels.fp8_linear import FP8_MAX

    w = torch.randn(n, k, generator=g) / k ** 0.5
    if block is None:
        scale = w.abs().amax(dim=1) / FP8_MAX
        return (w / scale[:, None]).to(torch.float8_e4m3fn), scale
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    tiles = padded.view(rows, bn, cols, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k]
    return q.contiguous().to(torch.float8_e4m3fn), scale


def cases(device: str, dtype: torch.dtype, large: bool) -> list[dict]:
    """(kind, M, N, K, block) problems: odd shapes at small sizes (interpreter), model shapes on CUDA."""
    if large:  # an 8B model's q|k|v, o, gate|up and down at TP=1, 128 x 128 blocks and per channel
        shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
        blocks = [(128, 128), None]
        rows = [1, 2, 4, 7, 16, 64, 65, 256, 1000]
    else:
        shapes = [(48, 96), (37, 100)]
        blocks = [(16, 16), (32, 64), None]
        rows = [1, 3, 70]
    out = []
    g = torch.Generator().manual_seed(1234)
    for i, (n, k) in enumerate(shapes):
        for block in blocks:
            if block is not None and large and (n % block[0] or k % block[1]):
                continue
            w, s = random_fp8(n, k, block, g)
            bias = torch.randn(n, generator=g) if i % 2 else None
            for m in rows:
                x = torch.randn(m, k, generator=g)
                out.append(dict(x=x.to(device, dtype), w=w.to(device), scale=s.to(device), block=block,
                                bias=None if bias is None else bias.to(device, dtype), first_shape=i == 0))
    return out


def run_case(case) -> list[str]:
    """The failures of one case (empty: it passes)."""
    from atlas.kernels import fp8_linear as f
    from atlas.kernels import fp8_linear_triton as kt

    x, w, s, block, bias = case["x"], case["w"], case["scale"], case["block"], case["bias"]
    m = x.shape[0]
    tol = TOL[x.dtype]
    exact = x.double() @ (w.double() * f.expand_scale(s, tuple(w.shape), block).double()).T
    if bias is not None:
        exact = exact + bias.double()
    peak = float(exact.abs().max())
    failures = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor, limit: float) -> None:
        assert got.shape == want.shape and got.dtype == x.dtype, (what, got.shape, got.dtype)
        err = float((got.double() - want.double()).abs().max())
        if not err <= limit * peak:
            failures.append(f"{what} M={m} N={w.shape[0]} K={w.shape[1]} block={block}: max error {err:.3g} > "
                            f"{limit} x {peak:.3g}")

    if m <= kt.GEMV_MAX_ROWS:
        # (small tiles in the interpreter; on CUDA the default tile's elements shared among the rows)
        cols = 64 if x.device.type == "cpu" else max(128, kt.GEMV_COLS // triton.next_power_of_2(m))
        y = kt.fp8_gemv_triton(x, w, s, block, bias, cols=cols)
        check("gemv", y, exact, tol)
        from atlas.kernels.fused_ops import act_and_mul_ref
        from atlas.kernels.fused_ops_triton import ACT_SILU

        if w.shape[0] % 2 == 0 and (bias is None or not x.is_cuda):
            # gate|up with SiLU as the epilogue: as the unfused GEMV then the activation
            fused = kt.fp8_gemv_triton(x, w, s, block, bias, cols=cols, act=ACT_SILU)
            want = act_and_mul_ref(y.float()).to(x.dtype)
            err = float((fused.double() - want.double()).abs().max())
            if not err <= tol * max(1.0, float(want.abs().max())):
                failures.append(f"gemv+silu M={m} N={w.shape[0]} block={block}: max error {err:.3g}")
        if m <= kt.ROW_TILES_MAX_ROWS:  # the row-tiles GEMV: 1, 2 and 4 W rows a program; K tiles that divide K
            # and that do not; the SiLU epilogue at one row
            tiles = ((1, 32), (2, 64), (4, 16)) if m == 1 else ((2, 64),)  # (the interpreter's time: one for more rows)
            # (the first step's weights loaded before the PDL wait: the same sums in the same order; in the
            # interpreter at one tile and the first shape, the prefetch's code being the same for every tile and shape)
            for bn, rt_cols in tiles if x.device.type == "cpu" else ((4, 2048), (2, 4096)):
                prefetch = x.is_cuda or (bn == 4 and case["first_shape"])
                if kt.fp8_gemv_row_tiles_fits(block, bn):
                    got = kt.fp8_gemv_row_tiles_triton(x, w, s, block, bias, bn, rt_cols, prefetch=False)
                    check(f"gemv rt n{bn}k{rt_cols}", got, exact, tol)
                    if prefetch and not torch.equal(
                            kt.fp8_gemv_row_tiles_triton(x, w, s, block, bias, bn, rt_cols, prefetch=True), got):
                        failures.append(f"gemv rt n{bn}k{rt_cols} M={m} N={w.shape[0]} block={block}: prefetch "
                                        f"differs")
                if m == 1 and w.shape[0] % 2 == 0 and (bias is None or not x.is_cuda) and bn > 1 and \
                        kt.fp8_gemv_row_tiles_fits(block, bn, ACT_SILU):
                    fused = kt.fp8_gemv_row_tiles_triton(x, w, s, block, bias, bn, rt_cols, act=ACT_SILU)
                    if prefetch and not torch.equal(kt.fp8_gemv_row_tiles_triton(
                            x, w, s, block, bias, bn, rt_cols, act=ACT_SILU, prefetch=True), fused):
                        failures.append(f"gemv rt n{bn}+silu N={w.shape[0]} block={block}: prefetch differs")
                    want = act_and_mul_ref(got.float())  # (the unfused GEMV above, then the activation)
                    err = float((fused.double() - want.to(x.dtype).double()).abs().max())
                    if not err <= tol * max(1.0, float(want.abs().max())):
                        failures.append(f"gemv rt n{bn}+silu N={w.shape[0]} block={block}: max error {err:.3g}")
        # the "xs" GEMV, with the widest tile the scale blocks hold (the interpreter: small ones)
        bn = 16 if block is None else min(16 if x.device.type == "cpu" else 64, block[0])
        bk = 128 if block is None else min(128, block[1])
        if kt.fp8_gemv_xs_fits(w, block, bn, bk):
            check("gemv xs", kt.fp8_gemv_xs_triton(x, w, s, block, bias, bn, bk), exact, tol)
        if w.shape[0] % 2 == 0 and (bias is None or not x.is_cuda) and kt.fp8_gemv_xs_fits(w, block, bn, bk, ACT_SILU):
            fused = kt.fp8_gemv_xs_triton(x, w, s, block, bias, bn, bk, act=ACT_SILU)
            want = act_and_mul_ref(kt.fp8_gemv_xs_triton(x, w, s, block, bias, bn, bk).float()).to(x.dtype)
            err = float((fused.double() - want.double()).abs().max())
            if not err <= tol * max(1.0, float(want.abs().max())):
                failures.append(f"gemv xs+silu M={m} N={w.shape[0]} block={block}: max error {err:.3g}")
    if m <= f.SMALL_M or x.dtype == torch.float32:
        check("w8a16", kt.fp8_w8a16_triton(x, w, s, block, bias), exact, tol)
        if block is not None:  # (two scale blocks' tiles a step)
            check("w8a16 two blocks a step", kt.fp8_w8a16_triton(x, w, s, block, bias, block_k=2 * block[1]), exact,
                  tol)
        if x.dtype != torch.float32:  # (float16 products: the weights exact, x rounded to float16)
            check("w8a16 f16", kt.fp8_w8a16_triton(x, w, s, block, bias, f16=True), exact, tol)
            if block is not None:  # (the f16 tiles 32 rows by 4 blocks a step, as the 16-64-row configs take them)
                check("w8a16 f16 four blocks a step", kt.fp8_w8a16_triton(
                    x, w, s, block, bias, block_n=32, block_k=4 * block[1], num_warps=8, num_stages=3, f16=True),
                    exact, tol)
        else:  # (the interpreter: the float16 variant takes bf16 rows only)
            xb = x.to(torch.bfloat16)
            want = xb.double() @ (w.double() * f.expand_scale(s, tuple(w.shape), block).double()).T
            want = want + bias.to(torch.bfloat16).double() if bias is not None else want
            got = kt.fp8_w8a16_triton(xb, w, s, block, bias.to(torch.bfloat16) if bias is not None else None,
                                      f16=True)
            err = float((got.double() - want).abs().max())
            if not (got.dtype == torch.bfloat16 and err <= TOL[torch.bfloat16] * float(want.abs().max())):
                failures.append(f"w8a16 f16 (bf16 rows) M={m} N={w.shape[0]} block={block}: max error {err:.3g}")
    if block is not None and m > 1 and (block[1] >= 32 or not x.is_cuda):  # (FP8 tl.dot: K tiles of 32+)
        q, qs = f.quantize_rows(x, block[1])
        geometry = dict(block_m=32, block_n=32) if x.device.type == "cpu" else {}
        got = kt.fp8_block_gemm_triton(q, qs, w, s, block, bias, x.dtype, **geometry)
        mma_tol = max(tol, TOL_FP8_MMA) if x.is_cuda else tol
        check("block w8a8", got, f.w8a8_ref(x, w, s, block, bias), mma_tol)
        rel = float((got.double() - exact).norm() / exact.norm())
        if not rel < W8A8_REL_L2:
            failures.append(f"block w8a8 M={m} block={block}: relative L2 error {rel:.3g} against the unquantized "
                            f"activations")
    if x.is_cuda and block is None and m > f.SMALL_M and f._scaled_mm_fits(x, w, None):
        got = f.fp8_linear(x, w, s, None, bias)  # (torch._scaled_mm, row-wise scales; other shapes dequantize)
        check("scaled_mm", got, f.w8a8_ref(x, w, s, None, bias), max(tol, TOL_FP8_MMA))
    if block is not None and m > 1 and f.blockwise_scaled_mm_fits(x, w, s, block):  # (cuBLASLt block scaling)
        check("blockwise scaled_mm", f.blockwise_scaled_mm(x, w, s, bias), f.w8a8_ref(x, w, s, block, bias),
              max(tol, TOL_FP8_MMA))
    failures += quantize_failures(x, block)
    # The dispatcher: whatever path it takes is within the W8A8 error of the reference (and so with SiLU fused).
    got = f.fp8_linear(x, w, s, block, bias)
    rel = float((got.double() - exact).norm() / exact.norm())
    if not rel < W8A8_REL_L2:
        failures.append(f"fp8_linear M={m} block={block}: relative L2 error {rel:.3g}")
    if w.shape[0] % 2 == 0:
        from atlas.kernels.fused_ops import act_and_mul_ref

        want = act_and_mul_ref(exact)
        got = f.fp8_linear(x, w, s, block, bias, act="silu")
        rel = float((got.double() - want).norm() / want.norm())
        if not (got.shape == want.shape and rel < W8A8_REL_L2):
            failures.append(f"fp8_linear+silu M={m} block={block}: relative L2 error {rel:.3g}")
    return failures


def quantize_failures(x: torch.Tensor, block) -> list[str]:
    """The one-kernel activation quantizers against quantize_rows: the same FP8 values and scales, to the bit."""
    from atlas.kernels import fp8_linear as f
    from atlas.kernels import fp8_linear_triton as kt

    failures = []

    def same(what, got, want):
        (gq, gs), (wq, ws) = got, want
        if gq.shape != wq.shape:
            failures.append(f"{what}: shape {tuple(gq.shape)}, not {tuple(wq.shape)}")
            return
        gq, wq = gq.float(), wq.float()
        differ = gq != wq
        if not x.is_cuda:  # Triton's interpreter rounds float32 to FP8 without carrying a rounded-up mantissa into
            # the exponent: a value that rounds up to a power of two comes out as half of it, and it rounds in the
            # subnormals (below 2^-6) otherwise by a step of 2^-9 (the GPU converts right: exact equality there)
            power = wq.abs() == torch.exp2(torch.floor(torch.log2(wq.abs().clamp(min=2 ** -9))))
            differ &= ~(power & (gq == wq / 2))
            differ &= ~((wq.abs() < 2 ** -6) & ((gq - wq).abs() <= 2 ** -9))
        if differ.any() or not torch.equal(gs.float(), ws.float()):
            bad = int(differ.sum())
            failures.append(f"{what} M={x.shape[0]} K={x.shape[1]}: {bad} FP8 values differ, scales equal: "
                            f"{gs.shape == ws.shape and torch.equal(gs.float(), ws.float())}")

    if block is not None:
        group = block[1]
        same(f"quantize groups of {group}", kt.quantize_groups_triton(x, group), f.quantize_rows(x, group))
        if x.dtype in (torch.bfloat16, torch.float16):  # (the fp8_quant_fma knob's division, for the dtypes it is for)
            with settings.tuned(fp8_quant_fma=True):
                same(f"quantize groups of {group}, reciprocal form", kt.quantize_groups_triton(x, group),
                     f.quantize_rows(x, group))
        q, s = kt.quantize_groups_triton(x, group, pad_rows_to=4, m_major=True)
        m = x.shape[0]
        if not (s.stride(0) == 1 and q.shape[0] % 4 == 0 and not q[m:].float().any()):
            failures.append(f"quantize groups padded M-major M={m}: layout {tuple(s.shape)} {s.stride()}")
        same("quantize groups padded M-major", (q[:m], s[:m]), f.quantize_rows(x, group))
    else:
        same("quantize rows", kt.quantize_rows_triton(x), f.quantize_rows(x))
        amax = float(x.abs().amax()) / 2
        same("quantize rows capped", kt.quantize_rows_triton(x, scale_ub=amax), f.quantize_rows(x, scale_ub=amax))
        static = torch.tensor(float(x.abs().amax()) / 300, device=x.device)
        same("quantize rows static", kt.quantize_rows_triton(x, static), f.quantize_rows(x, None, static))
    return failures


def fused_quant_failures(device: str) -> list[str]:
    """The kernels that write their output as QuantizedRows (the fp8_fused_quant knob): the RMSNorm (with and
    without the residual add) and the gated activation, each against the unfused kernel followed by
    quantize_groups_triton in cuBLASLt's layout (scales M-major, rows padded to 4): the same FP8 values, scales and
    residual, bit for bit; row counts off the padding, hidden sizes of one to four groups (three: not a power of two),
    gate|up widths that end inside a program's block."""
    from atlas.kernels import fp8_linear_triton as kt
    from atlas.kernels import fused_ops_triton as fo
    from atlas.kernels.fp8_linear import BLOCKWISE_ROWS_ALIGN
    from atlas.kernels.fused_ops import triton_act_code

    g = torch.Generator().manual_seed(11)
    failures = []

    def same(what, got, want):
        (q, s), (q_ref, s_ref) = got, want
        if not (q.shape == q_ref.shape and s.shape == s_ref.shape and s.stride() == s_ref.stride()
                and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)):
            failures.append(f"{what}: the fused kernel's FP8 rows differ from the unfused kernels'")

    def quantized(y):
        return kt.quantize_groups_triton(y, 128, pad_rows_to=BLOCKWISE_ROWS_ALIGN, m_major=True)

    cases = ((1, 256, True, False), (5, 512, True, True), (7, 128, False, True), (9, 384, True, False))
    for rows, hidden, with_residual, fma in cases:  # (fma: the fp8_quant_fma knob, in the fused and unfused kernels)
        x = (3 * torch.randn(rows, hidden, generator=g)).to(device, torch.bfloat16)
        r = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, torch.bfloat16)
        what = f"rms_norm quant {rows} x {hidden} residual {with_residual} fma {fma}"
        with settings.tuned(fp8_quant_fma=fma):
            if with_residual:
                q, s, total = fo.rms_norm_quant_triton(x, w, 1e-6, residual=r)
                y, want_total = fo.rms_norm_triton(x, w, 1e-6, residual=r)
                if not torch.equal(total, want_total):
                    failures.append(f"{what}: the residual differs")
            else:
                q, s = fo.rms_norm_quant_triton(x, w, 1e-6)
                y = fo.rms_norm_triton(x, w, 1e-6)
            fused = q, s
        same(what, fused, quantized(y))  # (the unfused quantizer divides as the IEEE division)
        if fma:
            with settings.tuned(fp8_quant_fma=True):
                reciprocal = quantized(y)
            same(f"quantize groups of 128, reciprocal form, {rows} x {hidden}", reciprocal, quantized(y))
    for rows, inter, act, fma in ((1, 128, "silu", True), (6, 384, "gelu_pytorch_tanh", False), (3, 1536, "silu", True)):
        x = (2 * torch.randn(rows, 2 * inter, generator=g)).to(device, torch.bfloat16)
        code = triton_act_code(act)
        with settings.tuned(fp8_quant_fma=fma):
            fused = fo.act_and_mul_quant_triton(x, code)
        same(f"act_and_mul quant {rows} x {inter} {act} fma {fma}", fused, quantized(fo.act_and_mul_triton(x, code)))
    return failures


def check_all(device: str, dtype: torch.dtype, large: bool, part: int = 0, parts: int = 1) -> list[str]:
    """The failures of every case, or of part `part` of `parts` (the cases whose index is part modulo parts; the fused
    quantization's in part 0): the interpreter test runs the parts in processes of their own, side by side."""
    failures = fused_quant_failures(device) if part == 0 else []
    for i, case in enumerate(cases(device, dtype, large)):
        if i % parts == part:
            failures += run_case(case)
    return failures


if __name__ == "__main__":
    on_cuda = torch.cuda.is_available()
    part, parts = (int(v) for v in sys.argv[1].split("/")) if len(sys.argv) > 1 else (0, 1)
    problems = check_all("cuda" if on_cuda else "cpu", torch.bfloat16 if on_cuda else torch.float32, on_cuda, part,
                         parts)
    for p in problems:
        print(p)
    print(f"{len(problems)} failure(s)")
    sys.exit(1 if problems else 0)
