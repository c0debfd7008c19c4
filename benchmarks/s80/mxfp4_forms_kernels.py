"""Issue 41: why the MXFP4 row tiles' word decodes, which issue fewer instructions a weight when compiled on the CPU
(benchmarks/s79/mxfp4_decode_probe.py, local Triton), made gpt-oss-20b's batch-1 step slower on an H100 (session 80:
bits 2.43 ms, words 3.08, e4m3 3.01). Times the two row-tiles kernels alone at gpt-oss-20b's shape (one token, 4 of
32 experts, 2,880 x 2,880) in each decode form, step size (moe_mxfp4_row_runs) and stage count, each in a CUDA graph
over 8 disjoint sets of 4 experts (265 MB of gate|up weights: the L2 holds none of them from one call to the next, as
in a model's 24 layers), against the copy bandwidth measured in the same run; each output against the bits form's at
the default step; and the loop each compiled to with the device's own Triton (instructions a thread a step, the top
opcodes, registers).

    python benchmarks/s80/mxfp4_forms_kernels.py --out forms.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from atlas.bench.common import copy_bandwidth, kernel_time_ms, machine  # noqa: E402
from atlas.kernels import moe_triton as mt  # noqa: E402
from atlas.kernels import settings  # noqa: E402
from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU  # noqa: E402

E, HIDDEN, INTER, TOPK, SETS = 32, 2880, 2880, 4, 8
KERNELS = {"gate_up": mt._mxfp4_gate_up_row_tiles_kernel, "down": mt._mxfp4_down_row_tiles_kernel}


def compiled(kernel) -> dict:
    """The compiled kernels in `kernel`'s JIT caches, by cache key."""
    return {key: c for cache in kernel.device_caches.values() for key, c in cache[0].items()}


def loop_mix(new: list) -> list[dict]:
    """For each newly compiled kernel: its loop's length (instructions a thread a step), top opcodes, registers."""
    import sass_loop_mix as s

    out = []
    for c in new:
        try:
            loop = s.loop_of(c.asm["sass"])
        except Exception as exc:  # (no disassembler: recorded)
            out.append({"error": repr(exc)[:200]})
            continue
        out.append({"loop": len(loop), "registers": c.n_regs, "spills": c.n_spills,
                    "mix": collections.Counter(s.opcode(i) for i in loop).most_common(12)})
    return out


def layer_calls(device: torch.device):
    """gpt-oss-20b's MXFP4 experts of one layer (random codes, scales near 2^-5, biases), one token's x and its 4
    choices' h: (gate_up(ids, stages), down(ids, stages), 8 disjoint sets of 4 expert ids [1, 4])."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, HIDDEN, generator=gen).to(device, torch.bfloat16)
    w13 = torch.randint(0, 256, (E, 2 * INTER, HIDDEN // 2), dtype=torch.uint8, generator=gen).to(device)
    s13 = torch.randint(118, 124, (E, 2 * INTER, HIDDEN // 32), dtype=torch.uint8, generator=gen).to(device)
    w2 = torch.randint(0, 256, (E, HIDDEN, INTER // 2), dtype=torch.uint8, generator=gen).to(device)
    s2 = torch.randint(118, 124, (E, HIDDEN, INTER // 32), dtype=torch.uint8, generator=gen).to(device)
    b13 = torch.randn(E, 2 * INTER, generator=gen).to(device, torch.bfloat16)
    b2 = torch.randn(E, HIDDEN, generator=gen).to(device, torch.bfloat16)
    order = torch.randperm(E, generator=gen)
    sets = [order[i * TOPK:(i + 1) * TOPK].view(1, TOPK).to(device, torch.int32) for i in range(SETS)]
    rw = torch.softmax(torch.randn(1, TOPK, generator=gen), -1).to(device)
    h = torch.randn(TOPK, INTER, generator=gen).to(device, torch.bfloat16)

    def gate_up(ids, stages=None):
        return mt._mxfp4_gate_up_row_tiles(x, w13, ids, rw, ACT_CLAMPED_SWIGLU, s13, b13, 1.702, 7.0,
                                           mt.ROW_TILES_BLOCK_N, num_stages=stages)

    def down(ids, stages=None):
        return mt._mxfp4_down_row_tiles(h, w2, ids, rw, b2, s2, num_stages=stages)

    return gate_up, down, sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--decodes", default="bits,words,e4m3")
    ap.add_argument("--runs", default="16,32,64")
    ap.add_argument("--stages", default="1,2")
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    gate_up, down, sets = layer_calls(device)
    per_weight = 0.5 + 1 / 32
    bytes_up, bytes_down = TOPK * 2 * INTER * HIDDEN * per_weight, TOPK * HIDDEN * INTER * per_weight

    with settings.tuned(moe_mxfp4_decode="bits", moe_mxfp4_row_runs=0):
        ref_up, ref_down = gate_up(sets[0], 1).float(), down(sets[0], 1).float()
    rows = []
    for decode in args.decodes.split(","):
        for runs in [int(r) for r in args.runs.split(",")]:
            for stages in [int(s) for s in args.stages.split(",")]:
                row = dict(decode=decode, runs=runs, stages=stages)
                before = {n: set(compiled(k)) for n, k in KERNELS.items()}
                try:
                    with settings.tuned(moe_mxfp4_decode=decode, moe_mxfp4_row_runs=runs):
                        up_ms = kernel_time_ms(lambda st=stages: [gate_up(ids, st) for ids in sets]) / SETS
                        down_ms = kernel_time_ms(lambda st=stages: [down(ids, st) for ids in sets]) / SETS
                        got_up, got_down = gate_up(sets[0], stages).float(), down(sets[0], stages).float()
                except Exception as exc:  # (a config that does not compile: recorded, the sweep goes on)
                    row["error"] = repr(exc)[:300]
                else:
                    row.update(gate_up_us=up_ms * 1e3, gate_up_of_copy=bytes_up / bandwidth / (up_ms * 1e-3),
                               down_us=down_ms * 1e3, down_of_copy=bytes_down / bandwidth / (down_ms * 1e-3),
                               gate_up_max_diff=(got_up - ref_up).abs().max().item(),
                               down_max_diff=(got_down - ref_down).abs().max().item(),
                               gate_up_max=ref_up.abs().max().item(), down_max=ref_down.abs().max().item())
                for name, kernel in KERNELS.items():
                    now = compiled(kernel)
                    row[f"{name}_sass"] = loop_mix([c for key, c in now.items() if key not in before[name]])
                print(json.dumps(row), flush=True)
                rows.append(row)
    import triton

    args.out.write_text(json.dumps(dict(machine=machine(), triton=triton.__version__,
                                        copy_bandwidth_gbs=bandwidth / 1e9, rows=rows), indent=1))


if __name__ == "__main__":
    main()
