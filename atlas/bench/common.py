"""Helpers shared by the benchmarks: machine facts, device timing, engine flags, prompts and reports."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atlas.config import EngineConfig

if TYPE_CHECKING:
    import torch


def random_prompts(vocab_size: int, num: int, input_len: int, seed: int = 0) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab_size, (num, input_len), generator=g).tolist()


def machine() -> dict[str, Any]:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, bytes read + written (the decode roofline's ceiling)."""
    import torch
    if device.type != "cuda":
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    del x, y
    return 2 * (1 << 30) / seconds


def kernel_time_ms(fn, repeats: int = 20, graph: bool = True, calls: int = 10) -> float:
    """Median milliseconds of one fn() on the current CUDA device: replayed in a CUDA graph of `calls`
    calls (as a decode step runs a kernel: no launch cost), or eagerly one call at a time (graph=False,
    for what cannot be captured; its launches count)."""
    import torch
    fn()
    torch.cuda.synchronize()
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (warm-up on the capture stream, as torch.cuda.graphs asks)
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run, per = g.replay, calls
    else:
        run, per = fn, 1
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / per)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_until_decoding(engine) -> None:
    """Run engine steps until no request waits and every running one is past its prefill (or none is left):
    the steps after this are pure decode steps, which the benchmarks time and profile."""
    sched = engine.scheduler
    while engine.has_unfinished() and (sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                            for r in sched.running)):
        engine.step(final_only=True)


def release() -> None:
    """Give back the device memory of engines the caller has dropped (`del llm` first: a reference held
    here or by the caller keeps the whole engine, weights and KV pool, alive)."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    kwargs = {name: getattr(args, name) for name in EngineConfig.field_names()}
    kwargs.update(overrides)
    return kwargs


def write_report(path: str | None, title: str, rows: list[dict[str, Any]], meta: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> None:
    """Print `rows` as a table; with `path`, write JSON {title, meta, rows, **extra} there and the table
    beside it (.txt)."""
    cols = list(dict.fromkeys(c for r in rows for c in r))  # (every row's keys, in order of first appearance)
    widths = [max(len(str(c)), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    lines = [title, "  ".join(str(c).ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths, strict=True)) for r in rows]
    text = "\n".join(lines)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"title": title, "meta": meta, "rows": rows, **(extra or {})}, indent=2))
        Path(path).with_suffix(".txt").write_text(text + "\n")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)
