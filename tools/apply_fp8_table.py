"""Write the FP8 kernel choices that `atlas bench fp8` found best into atlas/kernels/fp8_linear.py's table (the
assignments GEMV_CONFIGS, GEMV_SHAPE_CONFIGS, W8A16_CONFIG, SMALL_M, BLOCK_LARGE_M, BLOCK_GEMM_TILE), in place of
pasting the summary's block by hand. Used by tools/gpu_fp8_tune.sh's APPLY=1 so that one GPU call can tune and
then measure the model with the new table; commit the file after reading the figures.

    python tools/apply_fp8_table.py --gemv-json fp8_gemv.json --gemm-json fp8_gemm.json [--file F]
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from atlas.bench.fp8 import suggest_gemm, suggest_gemv


def _dict_source(head: str, values: dict) -> str:
    """`head {k: v, ...}` on one line, or one entry a line when that is longer than the project's 110 columns."""
    one = f"{head} {values!r}"
    if len(one) <= 110 or not values:
        return one
    return head + " {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in values.items()) + "}"


def new_values(gemv: dict | None, gemm: dict | None) -> dict[str, str]:
    """Source text of each assignment to replace (name -> 'NAME: type = value' or 'NAME = value')."""
    out: dict[str, str] = {}
    sg = suggest_gemv(gemv) if gemv else {}
    if sg.get("GEMV_CONFIGS"):
        configs = {int(k): v for k, v in sg["GEMV_CONFIGS"].items()}
        out["GEMV_CONFIGS"] = _dict_source("GEMV_CONFIGS: dict[int, str] =", dict(sorted(configs.items())))
        shapes = {ast.literal_eval(k): v for k, v in sg.get("GEMV_SHAPE_CONFIGS", {}).items()}
        out["GEMV_SHAPE_CONFIGS"] = _dict_source("GEMV_SHAPE_CONFIGS: dict[tuple[int, int, int], str] =", shapes)
    sm = suggest_gemm(gemm) if gemm else {}
    for key in ("W8A16_CONFIG", "SMALL_M", "BLOCK_LARGE_M", "BLOCK_GEMM_TILE"):
        if key in sm:
            out[key] = f"{key} = {sm[key]!r}"
    return out


def apply(path: Path, values: dict[str, str]) -> list[str]:
    """Replace the module-level assignments named in values; the names replaced."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    spans = []
    for node in ast.parse(text).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in values:
            comment = lines[node.end_lineno - 1].split("#", 1)[1] if "#" in lines[node.end_lineno - 1] else None
            spans.append((node.lineno, node.end_lineno, target.id, comment))
    for start, end, name, comment in sorted(spans, reverse=True):
        # (a one-line assignment's trailing comment stays, above the new value)
        above = [f"#{comment}"] if comment and start == end else []
        lines[start - 1:end] = above + [values[name] + "\n"]
    path.write_text("".join(lines))
    return [name for _, _, name, _ in spans]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gemv-json")
    p.add_argument("--gemm-json")
    p.add_argument("--file", default=str(Path(__file__).resolve().parents[1] / "atlas/kernels/fp8_linear.py"))
    args = p.parse_args()
    load = lambda f: json.loads(Path(f).read_text()) if f and Path(f).exists() else None  # noqa: E731
    values = new_values(load(args.gemv_json), load(args.gemm_json))
    done = apply(Path(args.file), values)
    for name in done:
        print(values[name])
    missing = sorted(set(values) - set(done))
    if missing:
        raise SystemExit(f"not found in {args.file}: {missing}")


if __name__ == "__main__":
    main()
