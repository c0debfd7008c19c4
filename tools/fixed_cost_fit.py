"""Split a decode step into the time its bytes take and a fixed part, from two `atlas bench latency` rows of one
architecture that read different bytes (bf16 and FP8 weights of one shape, in one run on one card).

The model: a step takes F + floor / e, where floor is the row's `decode_floor_ms` (its bytes at the copy rate
measured in that run), e the share of the copy rate the bytes are read at (taken equal in both rows), and F what does
not scale with the bytes: each kernel's launch, ramp and tail, attention, norms, the sampler. Two rows give F and e;
then the ratio the smaller row can reach against the larger at any F, and the F a target ratio needs:

    python tools/fixed_cost_fit.py BIG.json SMALL.json [--batch 1] [--kernels 290] [--target 1.75]

BIG.json is the row with more bytes (bf16), SMALL.json the one with fewer (FP8). --kernels (kernels a step, from
`--profile`'s summary) prints F per kernel.
"""

from __future__ import annotations

import argparse
import json
import sys


def row(path: str, batch: int) -> tuple[float, float]:
    """(ms a step, floor ms) of `path`'s row at `batch`."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        if r["batch_size"] == batch:
            return r["ms_per_step"], r["decode_floor_ms"]
    sys.exit(f"{path}: no row at batch {batch} (rows at {[r['batch_size'] for r in rows]})")


def fit(big: tuple[float, float], small: tuple[float, float]) -> tuple[float, float]:
    """(F ms, e) with t = F + floor / e through both rows."""
    (t_big, f_big), (t_small, f_small) = big, small
    if f_big <= f_small:
        raise ValueError("the first row must read more bytes than the second (a larger decode_floor_ms)")
    e = (f_big - f_small) / (t_big - t_small)
    return t_big - f_big / e, e


def ratio_at(fixed: float, e: float, f_big: float, f_small: float) -> float:
    """The big row's step over the small row's at fixed part `fixed` and byte rate e."""
    return (fixed + f_big / e) / (fixed + f_small / e)


def fixed_for(target: float, e: float, f_big: float, f_small: float) -> float:
    """The largest fixed part at which the ratio reaches `target`."""
    return (f_big / e - target * f_small / e) / (target - 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("big")
    parser.add_argument("small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kernels", type=float, default=None, help="kernels a step (prints F per kernel)")
    parser.add_argument("--target", type=float, default=None, help="a ratio big / small to reach")
    args = parser.parse_args(argv)
    big, small = row(args.big, args.batch), row(args.small, args.batch)
    fixed, e = fit(big, small)
    print(f"big: {big[0]:.3f} ms a step, floor {big[1]:.3f} ms; small: {small[0]:.3f} ms, floor {small[1]:.3f} ms; "
          f"ratio {big[0] / small[0]:.3f}")
    per_kernel = f" ({1000 * fixed / args.kernels:.2f} us a kernel at {args.kernels:g})" if args.kernels else ""
    print(f"fit: fixed part F = {fixed:.3f} ms{per_kernel}; bytes at {e:.3f} of the copy rate")
    print(f"the ratio with no fixed part: {big[1] / small[1]:.3f}; at F / 2: "
          f"{ratio_at(fixed / 2, e, big[1], small[1]):.3f}")
    if args.target:
        need = fixed_for(args.target, e, big[1], small[1])
        print(f"ratio {args.target:g} needs F <= {need:.3f} ms ({need / fixed:.2f} of today's)"
              if need > 0 else f"ratio {args.target:g} is above what the bytes allow")


if __name__ == "__main__":
    main()
