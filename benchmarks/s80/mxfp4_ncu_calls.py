"""The MXFP4 row-tiles kernels at gpt-oss-20b's shape called eagerly for Nsight Compute (`ncu`) to read their
hardware counters: `--calls` calls of gate|up then down, each on the next of 8 disjoint sets of 4 experts (no
weights in the L2 from one call to the next), in the row steps given (the moe_mxfp4_row_steps knob's form).
benchmarks/s80/next_mxfp4_ncu.sh runs it under ncu for a few configurations.

    python benchmarks/s80/mxfp4_ncu_calls.py --steps "gate_up:16:1:e4m3;down:16:1:e4m3" --calls 6
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mxfp4_forms_kernels import layer_calls  # noqa: E402

from atlas.kernels import settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="", help="moe_mxfp4_row_steps (empty: the defaults)")
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    device = torch.device("cuda")
    gate_up, down, sets = layer_calls(device)
    with settings.tuned(moe_mxfp4_row_steps=args.steps):
        for i in range(args.calls):
            ids = sets[i % len(sets)]
            gate_up(ids)
            down(ids)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
