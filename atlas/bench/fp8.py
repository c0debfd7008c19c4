"""`atlas bench fp8`: the FP8 linear layers' kernel candidates timed on a model's projection shapes (CUDA), to fill in
kernels/fp8_linear.py's table of tuned choices (GEMV_CONFIGS, W8A16_CONFIG, SMALL_M, BLOCK_LARGE_M, BLOCK_GEMM_TILE).

- `--part gemv` (decode, a few rows): every small-M candidate config ("sum": the CUDA-core FP8 GEMV, "dot": the W8A16
  tensor-core kernel, "f16": its float16 variant) at each row count, timed as a decode step pays it (kernels/gemv.py `graph_time_ms`: a CUDA
  graph over enough copies of the weight to exceed the L2 several times), against the bandwidth roofline (the FP8
  weight, its scales and the rows' bytes at the device's measured copy bandwidth) and against bf16 (cuBLAS and the
  bf16 GEMV's default config on the same shape in bf16); each config's result is also checked against the
  dequantized reference. gate|up also times the GEMV with SiLU as its epilogue against GEMV + activation kernel.
- `--part gemm` (prefill, big batches): at each M, torch.matmul in bf16, the W8A16 kernel (M up to 256), the
  Triton W8A8 GEMM at several tiles and cuBLASLt's block scaling (torch._scaled_mm, 1x128 activations x 128x128
  weights), each including its activation quantization; the fused quantization kernel against the PyTorch ops it
  replaces; the errors against w8a8_ref at the first M.

Each part stops starting new measurements at --deadline seconds and writes what it has (JSON after every shape),
with `suggest`: the table's entries as the measurements pick them. Shapes: Qwen3-8B's (q|k|v 6144x4096, o
4096x4096, gate|up 24576x4096, down 4096x12288) unless --shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from atlas.errors import AtlasError

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# A per-shape config goes into GEMV_SHAPE_CONFIGS when it beats the row count's common choice by this much.
SHAPE_MARGIN = 0.97
# Triton W8A8 GEMM tiles timed (BLOCK_M, BLOCK_N, warps, stages, GROUP_M); the first is the current default.
GEMM_TILES = ("m64n128w4s3g8", "m128n128w8s3g8", "m128n128w4s4g8", "m64n128w4s4g8", "m128n64w4s4g8",
              "m64n256w8s3g8")


def gemv_candidates(rows: int) -> list:
    """Small-M configs timed at `rows` rows: CUDA-core tiles whose [rows, BLOCK_N, columns] products stay around 8-16K
    float32 elements a program (registers), and tensor-core W8A16 tiles (rows padded to 16)."""
    from atlas.kernels.gemv import GemvConfig

    pad = 1 << (rows - 1).bit_length()
    tiles = [(2, 2048), (4, 1024), (4, 2048), (4, 4096), (8, 1024), (8, 2048), (16, 512), (16, 1024)]
    out = []
    for bn, cols in tiles:
        if pad * bn * cols > 16384 or cols // pad < 128:
            continue
        for warps in (4, 8):
            out.append(GemvConfig(bn, cols, warps, 3, "sum"))
        if rows == 1 and (bn, cols) in ((4, 2048), (8, 1024), (4, 4096)):
            out.append(GemvConfig(bn, cols, 4, 1, "sum"))
            out.append(GemvConfig(bn, cols, 8, 4, "sum"))
    if rows > 1:  # (the tiles above with the columns shared among the rows)
        for bn in (4, 8):
            cols = max(128, 2048 // pad)
            out += [GemvConfig(bn, cols, w, 3, "sum") for w in (4, 8) if GemvConfig(bn, cols, w, 3, "sum") not in out]
    # ("xs": the [rows, BLOCK_N, 128] float32 accumulator in registers, at most ~64 a thread)
    out += [GemvConfig(n, 128, w, s, "xs") for n in (8, 16, 32, 64) for w in (4, 8) for s in (3, 4)
            if pad * n * 128 <= 64 * 32 * w]
    out += [GemvConfig(n, k, w, s) for n, k, w, s in ((16, 128, 4, 4), (16, 128, 4, 6), (32, 128, 4, 4),
                                                      (16, 128, 8, 4), (64, 128, 4, 3))]
    out += [GemvConfig(n, k, w, s, "f16") for n, k, w, s in ((16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3),
                                                             (32, 128, 8, 4))]
    return out


def _random_fp8(n: int, k: int, device, block: tuple[int, int] | None):
    """Timing weights: FP8 values of a normal weight, scales of the right magnitude (block or per-row)."""
    import torch

    from atlas.kernels.fp8_linear import FP8

    w = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(FP8)
    if block is None:
        return w, torch.rand(n, device=device) * 1e-4 + 1e-4
    return w, torch.rand(-(-n // block[0]), -(-k // block[1]), device=device) * 1e-4 + 1e-4


def _run_small(cfg, x, w, s, block, act: int | None = None):
    from atlas.kernels import fp8_linear_triton as kt

    if cfg.kind == "xs":
        return kt.fp8_gemv_xs_triton(x, w, s, block, None, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                                     act=act)
    if cfg.kind == "sum":
        return kt.fp8_gemv_triton(x, w, s, block, None, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                                  act=act)
    return kt.fp8_w8a16_triton(x, w, s, block, None, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                               f16=cfg.kind == "f16")


def _write(path: str | None, report: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1, default=str))


def gemv_sweep(shapes: dict, rows_list: list[int], block, deadline: float, replays: int, out: str | None) -> dict:
    import torch

    from atlas.bench.common import copy_bandwidth, machine
    from atlas.kernels import gemv
    from atlas.kernels.fp8_linear import dequantize
    from atlas.kernels.fused_ops import act_and_mul
    from atlas.kernels.fused_ops_triton import ACT_SILU

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
    report: dict[str, Any] = {"machine": machine(), "copy_bandwidth_GBps": bandwidth and round(bandwidth / 1e9),
                              "block": block, "rows": {}, "skipped": [], "errors": []}
    # (row counts outermost: the compiles of a row count's configs happen on its first shape, and a deadline
    # loses the last row counts whole rather than shapes of every row count)
    for m in rows_list:
        for name, (n, k) in shapes.items():
            if time.monotonic() > deadline:
                report["skipped"].append(f"{name} rows={m}")
                continue
            copies = min(64, max(2, math.ceil(4 * l2 / (n * k))))
            pairs = [_random_fp8(n, k, device, block) for _ in range(copies)]
            w_bf = [torch.randn(n, k, device=device, dtype=torch.bfloat16)
                    for _ in range(min(64, max(2, math.ceil(4 * l2 / (2 * n * k)))))]
            scale_bytes = pairs[0][1].numel() * 4
            entry = report["rows"].setdefault(str(m), {}).setdefault(name, {"N": n, "K": k, "us": {}, "max_err": {}})
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            moved = n * k + scale_bytes + m * (n + k) * 2
            entry["roofline_us"] = round(1e6 * moved / bandwidth, 2) if bandwidth else None
            try:
                bf = gemv.measure(w_bf, [gemv.DEFAULT_CONFIG], rows=m, replays=replays) if m <= 1 else \
                    {"cublas": gemv.graph_time_ms(lambda w, x=x: torch.nn.functional.linear(x, w), w_bf, replays)}
                entry["bf16_cublas_us"] = round(1000 * bf["cublas"], 2)
                if gemv.DEFAULT_CONFIG in bf:
                    entry["bf16_gemv_us"] = round(1000 * bf[gemv.DEFAULT_CONFIG], 2)
            except Exception as e:  # noqa: BLE001 (a failed baseline leaves the rest)
                report["errors"].append(f"bf16 {name} rows={m}: {e}")
            w0, s0 = pairs[0]
            want = x.float() @ dequantize(w0, s0, block, torch.float32).T
            peak = float(want.abs().max())
            for cfg in gemv_candidates(m):
                if time.monotonic() > deadline:
                    report["skipped"].append(f"{name} rows={m} {cfg}")
                    break
                try:
                    got = _run_small(cfg, x, w0, s0, block).float()
                    entry["max_err"][str(cfg)] = round(float((got - want).abs().max()) / peak, 5)
                    t = gemv.graph_time_ms(lambda p, c=cfg, x=x: _run_small(c, x, p[0], p[1], block), pairs, replays)
                    entry["us"][str(cfg)] = round(1000 * t, 2)
                except Exception as e:  # noqa: BLE001 (a config that does not compile or run is reported)
                    report["errors"].append(f"{name} rows={m} {cfg}: {str(e).splitlines()[0][:200]}")
            sums = {c: t for c, t in entry["us"].items() if c.startswith(("sum", "xs"))}
            if name == "gate_up" and sums and time.monotonic() < deadline:
                from atlas.kernels.fp8_linear import parse_config

                best = parse_config(min(sums, key=sums.__getitem__))
                if best.block_n % 2 == 0:
                    try:
                        fused = gemv.graph_time_ms(lambda p, b=best, x=x: _run_small(b, x, p[0], p[1], block, ACT_SILU), pairs,
                                                   replays)
                        apart = gemv.graph_time_ms(lambda p, b=best, x=x: act_and_mul(
                            _run_small(b, x, p[0], p[1], block), "silu"), pairs, replays)
                        entry["silu_epilogue"] = {"config": str(best), "fused_us": round(1000 * fused, 2),
                                                  "gemv_then_act_us": round(1000 * apart, 2)}
                    except Exception as e:  # noqa: BLE001
                        report["errors"].append(f"gate_up silu epilogue rows={m}: {str(e).splitlines()[0][:200]}")
            if entry["us"]:
                best_cfg = min(entry["us"], key=entry["us"].__getitem__)
                entry["best"] = best_cfg
                entry["best_us"] = entry["us"][best_cfg]
                if entry.get("roofline_us"):
                    entry["best_of_roofline"] = round(entry["roofline_us"] / entry["best_us"], 3)
                if entry.get("bf16_cublas_us"):
                    entry["best_vs_bf16_cublas"] = round(entry["bf16_cublas_us"] / entry["best_us"], 3)
                print(f"fp8 gemv {name} ({n}x{k}) rows={m}: best {best_cfg} {entry['best_us']} us "
                      f"(roofline {entry.get('roofline_us')} us, bf16 cuBLAS {entry.get('bf16_cublas_us')} us, "
                      f"bf16 GEMV {entry.get('bf16_gemv_us')} us)", flush=True)
            _write(out, report | {"suggest": suggest_gemv(report)})
            del pairs, w_bf
        torch.cuda.empty_cache()
    report["suggest"] = suggest_gemv(report)
    _write(out, report)
    return report


def suggest_gemv(report: dict) -> dict:
    """GEMV_CONFIGS (per row count: the config with the least time summed over the shapes that every config ran on)
    and GEMV_SHAPE_CONFIGS (a shape whose own best beats that by SHAPE_MARGIN)."""
    configs: dict[int, str] = {}
    shape_configs: dict[str, str] = {}
    for m, by_shape in report.get("rows", {}).items():
        # (a config whose result is off the reference by more than 2^-6 of its peak is not chosen)
        valid = [(e, {c: t for c, t in e["us"].items() if e["max_err"].get(c, 0) <= 2 ** -6})
                 for e in by_shape.values() if e.get("us")]
        valid = [(e, t) for e, t in valid if t]
        if not valid:
            continue
        common = set.intersection(*(set(t) for _, t in valid))
        if not common:
            continue
        choice = min(common, key=lambda c: sum(t[c] for _, t in valid))
        configs[int(m)] = choice
        for e, t in valid:
            own = min(t, key=t.__getitem__)
            if t[own] < SHAPE_MARGIN * t[choice]:
                shape_configs[f"({m}, {e['N']}, {e['K']})"] = own
    return {"GEMV_CONFIGS": configs, "GEMV_SHAPE_CONFIGS": shape_configs}


def gemm_compare(shapes: dict, m_list: list[int], deadline: float, replays: int, out: str | None) -> dict:
    import torch

    from atlas.bench.common import machine
    from atlas.kernels import fp8_linear as f
    from atlas.kernels import fp8_linear_triton as kt
    from atlas.kernels.gemv import graph_time_ms

    device = torch.device("cuda")
    block = (128, 128)
    report: dict[str, Any] = {"machine": machine(), "torch": torch.__version__, "cuda": torch.version.cuda,
                              "M": {}, "skipped": [], "errors": []}
    # cuBLASLt block scaling, tried directly (its error, if any, is what the report needs)
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(100, 512, generator=g).to(device, torch.bfloat16)
        w, s = _random_fp8(256, 512, device, block)
        got = f.blockwise_scaled_mm(x, w, s).float()
        want = f.w8a8_ref(x, w, s, block).float()
        report["blockwise_probe"] = {"ok": True, "max_rel_err": float((got - want).abs().max() / want.abs().max())}
    except Exception as e:  # noqa: BLE001
        report["blockwise_probe"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    report["blockwise_available"] = f.blockwise_scaled_mm_available(device)
    print(f"blockwise scaled_mm: {report['blockwise_probe']}", flush=True)

    def variants(x, w, s, w_bf, m):
        v = {"bf16_matmul": lambda: torch.matmul(x, w_bf.t())}
        if m <= 256:
            c = f.parse_config(f.W8A16_CONFIG)
            v["w8a16"] = lambda: kt.fp8_w8a16_triton(x, w, s, block, None, c.block_n, c.block_k, c.num_warps,
                                                     c.num_stages)
            v["w8a16_f16"] = lambda: kt.fp8_w8a16_triton(x, w, s, block, None, c.block_n, c.block_k, c.num_warps,
                                                         c.num_stages, f16=True)
        for tile in GEMM_TILES:
            kw = f.parse_tile(tile)
            v[f"triton_w8a8_{tile}"] = lambda kw=kw: kt.fp8_block_gemm_triton(
                *kt.quantize_groups_triton(x, 128), w, s, block, None, x.dtype, **kw)
        if report["blockwise_available"] and f.blockwise_scaled_mm_fits(x, w, s, block):
            v["scaled_mm_blockwise"] = lambda: f.blockwise_scaled_mm(x, w, s)
        v["quant_groups_triton"] = lambda: kt.quantize_groups_triton(x, 128)
        v["quant_groups_torch"] = lambda: f.quantize_rows(x, 128)
        return v

    for m in m_list:
        for name, (n, k) in shapes.items():
            if time.monotonic() > deadline:
                report["skipped"].append(f"M={m} {name}")
                continue
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            pairs = [_random_fp8(n, k, device, block) for _ in range(2)]
            w_bf = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(2)]
            entry = report["M"].setdefault(str(m), {}).setdefault(name, {"N": n, "K": k, "us": {}, "TFLOPS": {},
                                                                         "max_rel_err": {}})
            w0, s0 = pairs[0]
            want = f.w8a8_ref(x, w0, s0, block).float() if m == m_list[0] else None
            for label in variants(x, w0, s0, w_bf[0], m):
                if time.monotonic() > deadline:
                    report["skipped"].append(f"M={m} {name} {label}")
                    break
                try:
                    if want is not None and not label.startswith(("quant", "bf16")):
                        got = variants(x, w0, s0, w_bf[0], m)[label]().float()
                        entry["max_rel_err"][label] = round(float((got - want).abs().max() / want.abs().max()), 5)
                    ws = [(p[0], p[1], b) for p, b in zip(pairs, w_bf, strict=True)]
                    t = graph_time_ms(lambda p, lb=label, x=x, m=m: variants(x, p[0], p[1], p[2], m)[lb](), ws, replays)
                    entry["us"][label] = round(1000 * t, 2)
                    if not label.startswith("quant"):
                        entry["TFLOPS"][label] = round(2 * m * n * k / (t / 1000) / 1e12, 1)
                except Exception as e:  # noqa: BLE001
                    report["errors"].append(f"M={m} {name} {label}: {str(e).splitlines()[0][:200]}")
            mm = {lb: t for lb, t in entry["us"].items() if not lb.startswith("quant")}
            if mm:
                best = min(mm, key=mm.__getitem__)
                print(f"fp8 gemm M={m} {name} ({n}x{k}): " + ", ".join(f"{lb} {t}" for lb, t in sorted(
                    mm.items(), key=lambda kv: kv[1])[:4]) + f" us (best {best})", flush=True)
            _write(out, report | {"suggest": suggest_gemm(report)})
            del pairs, w_bf
        torch.cuda.empty_cache()
    report["suggest"] = suggest_gemm(report)
    _write(out, report)
    return report


def suggest_gemm(report: dict) -> dict:
    """BLOCK_GEMM_TILE (the Triton tile with the least time summed over every M and shape it ran on), BLOCK_LARGE_M
    (cuBLASLt's block scaling if it beats that tile in total over the M above 256... or wherever both ran), and
    SMALL_M (the largest M measured at which W8A16 beats both W8A8 paths on the sum over the shapes)."""
    tile_totals: dict[str, float] = {}
    cells = [e for by_shape in report.get("M", {}).values() for e in by_shape.values()]
    tiles = [t for t in GEMM_TILES if all(f"triton_w8a8_{t}" in e["us"] for e in cells)] if cells else []
    for t in tiles:
        tile_totals[t] = sum(e["us"][f"triton_w8a8_{t}"] for e in cells)
    out: dict[str, Any] = {}
    if tile_totals:
        out["BLOCK_GEMM_TILE"] = min(tile_totals, key=tile_totals.__getitem__)
        tile_key = f"triton_w8a8_{out['BLOCK_GEMM_TILE']}"
        both = [e for e in cells if "scaled_mm_blockwise" in e["us"]]
        if both:
            cublas = sum(e["us"]["scaled_mm_blockwise"] for e in both)
            triton_total = sum(e["us"][tile_key] for e in both)
            out["BLOCK_LARGE_M"] = "scaled_mm" if cublas <= triton_total else "triton"
            out["blockwise_vs_triton_total_us"] = [round(cublas, 1), round(triton_total, 1)]
        else:
            out["BLOCK_LARGE_M"] = "triton"
        small = None
        for m, by_shape in sorted(report.get("M", {}).items(), key=lambda kv: int(kv[0])):
            es = [e for e in by_shape.values() if "w8a16" in e["us"]]
            if not es:
                continue
            w8a16 = sum(min(e["us"]["w8a16"], e["us"].get("w8a16_f16", math.inf)) for e in es)
            w8a8 = sum(min(e["us"].get("scaled_mm_blockwise", math.inf), e["us"].get(tile_key, math.inf)) for e in es)
            if w8a16 <= w8a8:
                small = int(m)
        if small is not None:
            out["SMALL_M"] = small
    both = [e for e in cells if "w8a16" in e["us"] and "w8a16_f16" in e["us"]]
    if both:
        from atlas.kernels.fp8_linear import W8A16_CONFIG

        plain = W8A16_CONFIG.split("-", 1)[1]
        f16 = sum(e["us"]["w8a16_f16"] for e in both) < sum(e["us"]["w8a16"] for e in both)
        out["W8A16_CONFIG"] = ("f16-" if f16 else "dot-") + plain
    return out


def summary(gemv_report: dict | None, gemm_report: dict | None) -> str:
    """The table block for kernels/fp8_linear.py as the runs found it best, and the headline numbers."""
    lines = ["# ---- paste into atlas/kernels/fp8_linear.py (the tuned choices) ----"]
    sg = (gemv_report or {}).get("suggest") or (suggest_gemv(gemv_report) if gemv_report else {})
    sm = (gemm_report or {}).get("suggest") or (suggest_gemm(gemm_report) if gemm_report else {})
    if sg.get("GEMV_CONFIGS"):
        lines.append("GEMV_CONFIGS: dict[int, str] = {" + ", ".join(
            f"{int(k)}: \"{v}\"" for k, v in sorted(sg["GEMV_CONFIGS"].items(), key=lambda kv: int(kv[0]))) + "}")
        lines.append("GEMV_SHAPE_CONFIGS: dict[tuple[int, int, int], str] = {" + ", ".join(
            f"{k}: \"{v}\"" for k, v in sg.get("GEMV_SHAPE_CONFIGS", {}).items()) + "}")
    for key in ("W8A16_CONFIG", "SMALL_M", "BLOCK_LARGE_M", "BLOCK_GEMM_TILE"):
        if key in sm:
            lines.append(f"{key} = {sm[key]!r}")
    lines.append("")
    for m, by_shape in (gemv_report or {}).get("rows", {}).items():
        total = sum(e.get("best_us", 0) for e in by_shape.values())
        roof = sum(e.get("roofline_us") or 0 for e in by_shape.values())
        bf = sum(e.get("bf16_cublas_us") or 0 for e in by_shape.values())
        bfg = sum(e.get("bf16_gemv_us") or 0 for e in by_shape.values())
        lines.append(f"gemv rows={m}: FP8 best {total:.1f} us a layer (4 shapes), roofline {roof:.1f} "
                     f"({roof / total if total else 0:.2f} of it), bf16 cuBLAS {bf:.1f}"
                     + (f", bf16 GEMV {bfg:.1f}" if bfg else "") + f"; speedup vs bf16 best "
                     f"{min(x for x in (bf, bfg) if x) / total if total and (bf or bfg) else 0:.2f}x")
        for e in by_shape.values():
            if e.get("silu_epilogue"):
                lines.append(f"  gate_up SiLU epilogue rows={m}: {e['silu_epilogue']}")
    if gemm_report:
        lines.append(f"blockwise scaled_mm probe: {gemm_report.get('blockwise_probe')}")
        for m, by_shape in gemm_report.get("M", {}).items():
            parts = []
            for label in ["bf16_matmul", "w8a16", "w8a16_f16", "scaled_mm_blockwise"] + [f"triton_w8a8_{t}" for t in GEMM_TILES]:
                vals = [e["us"].get(label) for e in by_shape.values()]
                if vals and all(v is not None for v in vals):
                    parts.append(f"{label} {sum(vals):.0f}")
            q = [e["us"].get("quant_groups_triton") for e in by_shape.values()]
            qt = [e["us"].get("quant_groups_torch") for e in by_shape.values()]
            if q and all(v is not None for v in q + qt):
                parts.append(f"quant triton {sum(q):.0f} vs torch {sum(qt):.0f}")
            lines.append(f"gemm M={m} (us summed over the 4 shapes): " + ", ".join(parts))
    for r in (gemv_report, gemm_report):
        for err in (r or {}).get("errors", [])[:10]:
            lines.append(f"error: {err}")
        if (r or {}).get("skipped"):
            lines.append(f"skipped (deadline): {len(r['skipped'])} measurements, first {r['skipped'][0]}")
    return "\n".join(lines) + "\n"


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise AtlasError(f"{what} takes numbers separated by commas, not {text!r}") from e


def cmd_fp8(args: argparse.Namespace) -> int:
    import torch

    from atlas.bench.gemv import parse_shapes
    from atlas.kernels import triton_available

    if args.part != "summary" and not (torch.cuda.is_available() and triton_available()):
        raise AtlasError("atlas bench fp8 times CUDA kernels: it needs a CUDA GPU and Triton")
    shapes = parse_shapes(args.shapes) if args.shapes else dict(QWEN3_8B)
    deadline = time.monotonic() + args.deadline
    if args.part == "gemv":
        block = None if args.layout == "channel" else (128, 128)
        report = gemv_sweep(shapes, _ints(args.rows, "--rows"), block, deadline, args.replays, args.output_json)
        print(summary(report, None), end="")
    elif args.part == "gemm":
        report = gemm_compare(shapes, _ints(args.m, "--m"), deadline, args.replays, args.output_json)
        print(summary(None, report), end="")
    else:  # summary of earlier JSON files
        gv, gm = (json.loads(Path(p).read_text()) if p and Path(p).exists() else None
                  for p in (args.gemv_json, args.gemm_json))
        text = summary(gv, gm)
        if args.output_json:
            Path(args.output_json).write_text(text)
        print(text, end="")
    return 0


def add_fp8_benchmark(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fp8", help="The FP8 linear layers' kernel candidates on a model's projections (CUDA).")
    p.add_argument("--part", choices=["gemv", "gemm", "summary"], default="gemv")
    p.add_argument("--shapes", default=None, help="NxK weight shapes (default: Qwen3-8B's four projections).")
    p.add_argument("--rows", default="1,2,4,8", help="gemv: rows of x.")
    p.add_argument("--m", default="256,2048,8192,64,16", help="gemm: rows of x, in the order measured (errors "
                   "against w8a8_ref at the first).")
    p.add_argument("--layout", choices=["block", "channel"], default="block", help="gemv: the weight scales.")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--deadline", type=float, default=80.0, help="Seconds after which no new measurement starts.")
    p.add_argument("--gemv-json", default=None, help="summary: the gemv part's JSON.")
    p.add_argument("--gemm-json", default=None, help="summary: the gemm part's JSON.")
    p.add_argument("--output-json", default=None, help="Where the part's JSON goes (summary: the text).")
    p.set_defaults(func=cmd_fp8)
