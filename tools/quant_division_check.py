"""Whether the FP8 activation quantizers' reciprocal form of the division (fused_ops_triton.divide_by_scale with FMA,
the fp8_quant_fma knob) gives the IEEE division's FP8 values, over every input it can meet: every finite value x of
the activation dtype (bf16 or fp16) against every scale s = RN(max(amax, 1e-12) / 448) of a positive finite amax of
that dtype with amax >= |x| (a group's scale is its largest |x| over 448). For each pair: r = RN(1 / s), q0 = RN(x r),
q = fma(fma(-q0, s, x), r, q0) (q0 where q0 is 0, keeping x's sign), with each fused multiply-add rounded once
(emulated exactly in float64 with an error-free sum); compared with RN(x / s) after the quantizer's clamp to +-448
and rounding to float8_e4m3fn, and as float32 quotients where |x / s| >= 2^-12. About 10^9 pairs a dtype, ~1 min
each on one core; --stride N takes every Nth amax (the CI test's sample).

    python tools/quant_division_check.py [--dtype bfloat16,float16] [--stride 1]
"""

from __future__ import annotations

import argparse
import time

import torch

FP8_MAX = 448.0


def _rn32_of_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 RN(a + b) of float64 a, b (each exact), as one fused multiply-add rounds its exact result: the
    float64 sum and its error (TwoSum), then the float32 rounding, which the error changes only where the float64
    sum is a float32 midpoint."""
    hi = a + b
    bb = hi - a
    lo = (a - (hi - bb)) + (b - bb)
    f = hi.float()
    up = torch.nextafter(f, torch.full_like(f, float("inf")))
    down = torch.nextafter(f, torch.full_like(f, float("-inf")))
    f = torch.where((hi == (f.double() + up.double()) / 2) & (lo > 0), up, f)
    return torch.where((hi == (f.double() + down.double()) / 2) & (lo < 0), down, f)


def reciprocal_form(x: torch.Tensor, s: torch.Tensor, corrected: bool = True) -> torch.Tensor:
    """divide_by_scale's FMA form of x / s (float32 x, float32 scalar s); corrected=False: the bare product x * RN(1 /
    s), which is not the division's (the check's own check)."""
    r = torch.tensor(1.0, dtype=torch.float32) / s
    q0 = x * r
    if not corrected:
        return q0
    e = _rn32_of_sum(x.double(), -(q0.double() * s.double()))
    q = _rn32_of_sum(q0.double(), e.double() * r.double())
    return torch.where(q0 == 0, q0, q)


def check(dtype: torch.dtype, stride: int = 1, corrected: bool = True) -> dict:
    """{pairs, fp8_differ, quotient_differ} for the dtype, every stride-th amax."""
    values = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).float()
    values = values[torch.isfinite(values)].unique()
    amaxes = values[values > 0][::stride]
    pairs = fp8_differ = quotient_differ = 0
    for amax in amaxes.tolist():
        s = torch.tensor(max(amax, 1e-12), dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32)
        x = values[torch.searchsorted(values, torch.tensor(-amax)):torch.searchsorted(values, torch.tensor(amax),
                                                                                      right=True)]
        exact = x / s
        got = reciprocal_form(x, s, corrected)
        want8 = exact.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        got8 = got.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        pairs += x.numel()
        fp8_differ += int((got8 != want8).sum())
        quotient_differ += int(((got != exact) & (exact.abs() >= 2.0 ** -12)).sum())
    return dict(pairs=pairs, fp8_differ=fp8_differ, quotient_differ=quotient_differ)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16,float16")
    ap.add_argument("--stride", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.dtype.split(","):
        start = time.time()
        result = check(getattr(torch, name), args.stride)
        print(f"{name}: {result['pairs']:,} pairs, FP8 values differing {result['fp8_differ']}, quotients >= 2^-12 "
              f"differing {result['quotient_differ']} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
