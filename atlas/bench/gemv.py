"""`atlas bench gemv`: the small-M GEMV's configs against cuBLAS on a model's projection shapes, each
timed as a decode step pays it (kernels/gemv.py `graph_time_ms`: one CUDA graph over enough copies of the
weight to exceed the L2 several times), with the bandwidth each reaches as a fraction of the device's
copy bandwidth measured in the same run.

The grid is wider than the handful of configs that `--tuning gemv=auto` times at load: it is how those are
chosen. Shapes come from a model's config.json (merged q|k|v, o, merged gate|up, down, LM head) or from
--shapes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from atlas.bench.common import copy_bandwidth, machine, write_report
from atlas.errors import AtlasError

# Narrow, long tiles on the CUDA cores: (block_n, block_k) with 1-8K elements a tile, 4 or 8 warps, with
# and without software pipelining of the loads.
_SUM_TILES = ((1, 1024), (1, 2048), (2, 512), (2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 512),
              (8, 1024))
# tl.dot tiles (rows padded to 16): (block_n, block_k, warps, stages).
_DOT = ((16, 128, 4, 6), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 6), (32, 256, 4, 4), (16, 256, 8, 4),
        (64, 128, 4, 4))


def config_grid() -> list:
    from atlas.kernels.gemv import GemvConfig

    grid = [GemvConfig(n, k, w, s) for n, k, w, s in _DOT]
    grid += [GemvConfig(n, k, w, s, "sum") for n, k in _SUM_TILES for w in (4, 8) for s in (1, 3)]
    return grid


def model_shapes(config_path: Path) -> dict[str, tuple[int, int]]:
    """The decode projections of a dense GQA model, by name: (N, K) of each weight."""
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise AtlasError(f"cannot read {config_path}: {e}; pass a model folder with a config.json, or --shapes") from e
    try:
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    except KeyError as e:
        raise AtlasError(f"{config_path} has no {e}: pass --shapes NxK,... for this model") from e
    return {"q|k|v": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate|up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (vocab, hidden)}


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    shapes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            n, k = (int(v) for v in part.lower().split("x"))
        except ValueError as e:
            raise AtlasError(f"--shapes takes NxK pairs separated by commas (e.g. 6144x4096), not {part!r}") from e
        if n < 1 or k < 1:
            raise AtlasError(f"--shapes: {part!r} must be positive")
        shapes[f"{n}x{k}"] = (n, k)
    if not shapes:
        raise AtlasError("--shapes is empty")
    return shapes


def cmd_gemv(args: argparse.Namespace) -> int:
    import torch

    from atlas.kernels import triton_available
    from atlas.kernels.gemv import measure

    if args.shapes:
        shapes = parse_shapes(args.shapes)
    elif args.model:
        shapes = model_shapes(Path(args.model) / "config.json")
    else:
        raise AtlasError("atlas bench gemv needs --model (a folder with config.json) or --shapes NxK,...")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError as e:
        raise AtlasError(f"--rows takes numbers separated by commas, not {args.rows!r}") from e
    if any(not 1 <= r <= 16 for r in rows_list):
        raise AtlasError("--rows: each between 1 and 16 (the GEMV's range)")
    if not torch.cuda.is_available() or not triton_available():
        raise AtlasError("atlas bench gemv times CUDA kernels: it needs a CUDA GPU and Triton")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
    grid = config_grid()
    rows: list[dict[str, Any]] = []
    best: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        size = n * k * dtype.itemsize
        copies = min(64, max(2, math.ceil(4 * l2 / size)))
        weights = [torch.randn(n, k, device=device).to(dtype) for _ in range(copies)]
        for m in rows_list:
            times = measure(weights, grid, rows=m, replays=args.replays)
            cublas = times["cublas"]
            ranked = sorted(times.items(), key=lambda kv: kv[1])
            for kernel, ms in ranked[: args.top] + ([] if any(k == "cublas" for k, _ in ranked[: args.top])
                                                    else [("cublas", cublas)]):
                moved = size + m * (n + k) * dtype.itemsize
                rows.append({"shape": name, "N": n, "K": k, "rows": m, "kernel": str(kernel),
                             "us": round(1000 * ms, 2), "x_cublas": round(ms / cublas, 3),
                             "TB/s": round(moved / (ms / 1000) / 1e12, 2),
                             "of_copy_bw": round(moved / (ms / 1000) / bandwidth, 3) if bandwidth else None})
            gemv_best = min((kv for kv in ranked if kv[0] != "cublas"), key=lambda kv: kv[1])
            best[f"{name} rows={m}"] = {"config": str(gemv_best[0]), "us": round(1000 * gemv_best[1], 2),
                                        "cublas_us": round(1000 * cublas, 2),
                                        "all_us": {str(c): round(1000 * t, 2) for c, t in times.items()}}
            print(f"{name} ({n}x{k}) rows={m}: best GEMV {gemv_best[0]} {1000 * gemv_best[1]:.1f} us, "
                  f"cuBLAS {1000 * cublas:.1f} us", flush=True)
        del weights
        torch.cuda.empty_cache()
    meta = {"machine": machine(), "dtype": args.dtype, "copy_bandwidth_GBps": bandwidth and round(bandwidth / 1e9),
            "configs": len(grid), "replays": args.replays}
    write_report(args.output_json, f"small-M GEMV against cuBLAS (the {args.top} fastest of {len(grid)} configs "
                 "a shape, and cuBLAS)", rows, meta, {"best": best})
    return 0


def add_gemv_benchmark(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gemv", help="The small-M GEMV's configs against cuBLAS on a model's projections (CUDA).")
    p.add_argument("--model", default=None, help="Folder with the model's config.json (its projection shapes).")
    p.add_argument("--shapes", default=None, help="NxK weight shapes instead of --model, e.g. 6144x4096,4096x4096.")
    p.add_argument("--rows", default="1", help="Rows of x (batch), comma-separated, 1-16.")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--replays", type=int, default=7, help="Graph replays a kernel (the median is kept).")
    p.add_argument("--top", type=int, default=5, help="Configs reported a shape (the fastest).")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_gemv)
