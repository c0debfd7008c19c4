"""Kernel-level profiles of decode steps with torch.profiler: kernels per step and per layer, device time
by kernel kind, and the host gap (wall time of a step minus its summed kernel time; `busy_ms_per_step`,
the time at least one kernel ran, differs from the sum only where streams overlap).

On CUDA the events are the device's kernels, memcpys and memsets. On a CPU there are no kernels; the
ATen operators that do work of their own stand in for them, so that the same code runs (and is tested) anywhere.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from atlas.bench.common import step_until_decoding

KINDS = ("matmul", "attention", "communication", "elementwise_reduction", "copy", "other")

# First match wins: an attention kernel may mention cutlass, a GEMM's template names its copy atoms, a
# copy kernel may be elementwise, a collective's kernel names its reduction.
_PATTERNS = [
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|sendrecv|one_shot"
                                 r"|two_shot|multimem|symm_mem", re.I)),
    ("attention", re.compile(r"attn|attention|flash|fmha|sdpa|mha_|_mha", re.I)),
    ("matmul", re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|matmul|\bmm\b|addmm|bmm|_mm_|_mm$|linear|splitk"
                          r"|wgmma|\bdot\b", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|\bcat\b|catarray", re.I)),
    ("elementwise_reduction", re.compile(
        r"elementwise|vectorized|reduce|reduction|norm|rms|rope|rotary|silu|gelu|act_and_mul|softmax|triton_poi"
        r"|triton_per|triton_red|arg_?max|arg_?min|index|gather|scatter|embedding|fill|where|cumsum|sort|topk"
        r"|sampl|sqrt|clamp|arange|compare|masked|remainder|fmod|bitwise|floor|ceil|zero_"
        r"|(?<![a-z])(max|min|sum|mean|add|mul|div|sub|exp|log|pow|neg|eq|ne|lt|le|gt|ge|abs|relu|sigmoid|tanh)(?![a-z])",
        re.I)),
]

# CPU stand-ins: operators that do no work of their own (views, no-op conversions, allocations). An
# operator stands in for a kernel when it is none of these and all its children are.
_CPU_NO_WORK = {
    "aten::" + n for n in (
        "empty", "empty_strided", "empty_like", "as_strided", "view", "_reshape_alias", "reshape", "t", "transpose",
        "permute", "expand", "expand_as", "slice", "select", "unsqueeze", "squeeze", "narrow", "split", "chunk",
        "split_with_sizes", "unbind", "view_as", "alias", "detach", "_unsafe_view", "unflatten", "flatten",
        "contiguous", "resolve_conj", "resolve_neg", "lift_fresh", "result_type", "to", "item", "_local_scalar_dense",
        "set_", "is_nonzero", "numpy_T", "dim", "size", "stride")}


def classify(name: str) -> str:
    for kind, pattern in _PATTERNS:
        if pattern.search(name):
            return kind
    return "other"


@dataclass
class DeviceEvent:
    name: str
    start_us: float
    duration_us: float


IDLE_MIN_US = 3.0  # shorter gaps between events are launch latency inside a graph


def device_events(prof: profile, device: torch.device) -> list[DeviceEvent]:
    """Kernels (CUDA) or working leaf operators (CPU) of a finished profile, in start order."""
    out = []
    for e in prof.events():
        if device.type == "cuda":
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
        elif (e.device_type != DeviceType.CPU or not e.name.startswith("aten::") or e.name in _CPU_NO_WORK
              or any(c.name not in _CPU_NO_WORK for c in e.cpu_children)):
            continue
        out.append(DeviceEvent(e.name, float(e.time_range.start), float(e.time_range.elapsed_us())))
    out.sort(key=lambda ev: ev.start_us)
    return out


def busy_us(events: list[DeviceEvent]) -> float:
    """Time covered by at least one event (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for ev in sorted(events, key=lambda e: e.start_us):
        stop = ev.start_us + ev.duration_us
        if stop > end:
            total += stop - max(ev.start_us, end)
            end = stop
    return total


def summarize(events: list[DeviceEvent], steps: int, num_layers: int, wall_s_per_step: float | None,
              device: torch.device, top: int = 15) -> dict[str, Any]:
    """Per-step figures of `events` that cover `steps` decode steps."""
    steps = max(steps, 1)
    by_kind = {k: {"kernels_per_step": 0.0, "ms_per_step": 0.0, "share": 0.0} for k in KINDS}
    by_name: dict[str, list[float]] = {}
    for ev in events:
        kind = by_kind[classify(ev.name)]
        kind["kernels_per_step"] += 1 / steps
        kind["ms_per_step"] += ev.duration_us / 1000 / steps
        entry = by_name.setdefault(ev.name, [0, 0.0])
        entry[0] += 1
        entry[1] += ev.duration_us
    kernel_ms = sum(k["ms_per_step"] for k in by_kind.values())
    for k in by_kind.values():
        k["share"] = k["ms_per_step"] / kernel_ms if kernel_ms else 0.0
    busy_ms = busy_us(events) / 1000 / steps
    wall_ms = None if wall_s_per_step is None else 1000 * wall_s_per_step
    kernels = len(events) / steps
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    # Where the device idles inside the profiled steps: gaps between one event's end and the next one's
    # start, summed per (kernel before, kernel after) pair (a step boundary, a host wait inside a step).
    idle: dict[tuple[str, str], list[float]] = {}
    end, last = None, ""
    for ev in events:
        if end is not None and ev.start_us - end > IDLE_MIN_US:
            entry = idle.setdefault((last[:60], ev.name[:60]), [0, 0.0])
            entry[0] += 1
            entry[1] += ev.start_us - end
        if end is None or ev.start_us + ev.duration_us >= end:
            end, last = ev.start_us + ev.duration_us, ev.name
    return {
        "device_events": ("CUDA kernels, memcpys and memsets" if device.type == "cuda"
                          else "CPU leaf ATen operators (standing in for kernels)"),
        "steps": steps,
        "kernels_per_step": kernels,
        "kernels_per_layer": kernels / max(num_layers, 1),
        "kernel_ms_per_step": kernel_ms,
        "busy_ms_per_step": busy_ms,
        "wall_ms_per_step": wall_ms,
        "host_gap_ms_per_step": None if wall_ms is None else wall_ms - kernel_ms,
        "by_kind": by_kind,
        "top_kernels": [{"name": name[:200], "kind": classify(name), "calls_per_step": n / steps,
                         "ms_per_step": us / 1000 / steps} for name, (n, us) in ranked],
        "idle_ms_per_step": sum(us for _, us in idle.values()) / 1000 / steps,
        "idle_gaps": [{"after": a, "before": b, "per_step": n / steps, "ms_per_step": us / 1000 / steps}
                      for (a, b), (n, us) in sorted(idle.items(), key=lambda kv: -kv[1][1])[:6]],
    }


def run_profiled(fn: Callable[[], Any], device: torch.device, table_rows: int = 40,
                 ranges: dict[str, list[float]] | None = None) -> tuple[list[DeviceEvent], float, str]:
    """Run fn under torch.profiler: (its device events, its wall seconds, the key_averages table). `ranges`,
    when given, gets the durations (us) of the host stages' ranges (host_stages) by stage."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if ranges is not None:
        for e in prof.events():
            if e.name.startswith(HOST_STAGE_PREFIX) and e.device_type == DeviceType.CPU:
                ranges.setdefault(e.name.removeprefix(HOST_STAGE_PREFIX), []).append(e.time_range.elapsed_us())
    averages = prof.key_averages()
    table = ""
    for key in (("self_device_time_total", "self_cuda_time_total") if device.type == "cuda"
                else ("self_cpu_time_total",)):
        try:
            table = averages.table(sort_by=key, row_limit=table_rows, max_name_column_width=90)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    return device_events(prof, device), wall, table


HOST_STAGE_PREFIX = "atlas::"


@contextlib.contextmanager
def host_stages(engine, times: dict[str, list[float]] | None = None,
                extra: Iterable[tuple[str, object, str]] = ()) -> Iterator[None]:
    """Profiler ranges around the engine's host-side stages while profiling (wrappers set on the instances,
    removed after): where a step's host time goes, beside the device's idle gaps. Nested stages overlap
    (launch includes prepare_inputs and the graph replays; update_from_output includes prepare_drafts).
    With `times`, no ranges: each call's perf_counter duration (us) is appended there by stage, and so is
    each wait for a CUDA event (`wait_for_device`), for a pass without the profiler's own overhead.
    `extra`: more (label, owner, method) stages; their owner's instance attributes are wrapped too (e.g. a
    callable the engine set on the runner)."""
    runner = engine.runner
    stages = [("complete_step", engine, "_complete_inflight"), ("schedule", engine.scheduler, "schedule"),
              ("update_from_output", engine.scheduler, "update_from_output"),
              ("prepare_drafts", engine.scheduler, "prepare_drafts"), ("launch", runner, "launch"),
              ("prepare_inputs", runner, "prepare_inputs"), ("process_outputs", engine.output_processor, "process")]
    if engine.proposer is not None:
        stages.append(("propose", engine.proposer, "propose"))
    stages += [(f"graph_replay_q{q}", graphs, "run") for q, graphs in runner.step_graphs.items()]
    if times is not None and engine.device.type == "cuda":
        stages.append(("wait_for_device", torch.cuda.Event, "synchronize"))
    extra = list(extra)
    patched = []
    for label, owner, method in stages + extra:
        fn = getattr(owner, method, None)
        if fn is None or (method in vars(owner) and not isinstance(owner, type)
                          and (label, owner, method) not in extra):
            continue
        if times is None:
            def wrapped(*args, _fn=fn, _name=HOST_STAGE_PREFIX + label, **kwargs):
                with record_function(_name):
                    return _fn(*args, **kwargs)
        else:
            def wrapped(*args, _fn=fn, _out=times.setdefault(label, []), **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    _out.append(1e6 * (time.perf_counter() - t0))
        original = vars(owner).get(method)  # (None: the class's method, found again once the wrapper goes)
        setattr(owner, method, wrapped)
        patched.append((owner, method, original))
    try:
        yield
    finally:
        for owner, method, original in patched:
            if original is not None:
                setattr(owner, method, original)  # (a class's own method, or the instance's attribute)
            else:
                delattr(owner, method)  # (the class's method again)


def _stage_table(before: dict[str, list[float]] | None, after: dict[str, list[float]], steps: int
                 ) -> dict[str, Any]:
    """By stage: with `before` (a prefill-only call's durations, whose calls are subtracted), calls a step
    times the median call (a decode step's); without (a window of decode steps alone), the whole time a step.
    The median call is given either way."""
    table = {}
    for name, durations in after.items():
        if not durations:
            continue
        median_ms = statistics.median(durations) / 1000
        if before is None:
            calls = len(durations) / max(steps, 1)
            per_step = sum(durations) / 1000 / max(steps, 1)
        else:
            calls = max(0, len(durations) - len(before.get(name, []))) / max(steps, 1)
            per_step = calls * median_ms
        table[name] = {"calls_per_step": calls, "median_ms_per_call": median_ms, "ms_per_step": per_step}
    return table


def profile_decode(call: Callable[[int], Callable[[], Any]], steps: int, num_layers: int, step_s: float | None,
                   device: torch.device, engine=None) -> tuple[dict[str, Any], str]:
    """Profile call(1)() (a prefill-only generate), then call(steps + 1)() (the same prefill and `steps`
    decode steps): the decode steps' kernels are those after as many kernels as the prefill-only call ran.
    With `engine`, also the host time of each of its stages (host_stages): calls a step (the prefill-only
    call's subtracted) times the median call (a decode step's), from the profiled run's ranges and from a
    second, unprofiled pass timed with perf_counter (the profiler slows every host op down). -> (summarize's
    figures with the prefill's kernel count and the profiled wall time a step, the table)."""
    before: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    with host_stages(engine) if engine is not None else contextlib.nullcontext():
        prefill_events, prefill_wall, _ = run_profiled(call(1), device, ranges=before)
        events, wall, table = run_profiled(call(steps + 1), device, ranges=after)
    summary = summarize(events[len(prefill_events):], steps, num_layers, step_s, device)
    summary["prefill_kernels"] = len(prefill_events)
    summary["profiled_wall_ms_per_step"] = 1000 * (wall - prefill_wall) / max(steps, 1)
    if after:
        summary["host_stages"] = _stage_table(before, after, steps)
    if engine is not None:
        timed_before: dict[str, list[float]] = {}
        timed_after: dict[str, list[float]] = {}
        with host_stages(engine, timed_before):
            call(1)()
        with host_stages(engine, timed_after):
            call(steps + 1)()
        summary["host_stages_unprofiled"] = _stage_table(timed_before, timed_after, steps)
    return summary, table


def profile_running(engine, add_requests: Callable[[], Any], steps: int, num_layers: int,
                    device: torch.device) -> tuple[dict[str, Any], str]:
    """Profile `steps` engine steps in which every request decodes: add_requests() queues them, the engine
    steps until none waits or prefills, then `steps` steps are profiled (kernels, the device's idle gaps,
    host stages from profiler ranges), `steps` more are timed with perf_counter wrappers alone (host stages
    without the profiler's overhead), and the rest run to the end. Unlike profile_decode, no prefill kernel
    is in the window, so the figures are those of pure decode steps (the requests need max_tokens of at
    least 2 * steps + 2, more with drafts accepted; a window that the requests' end cuts short counts the
    steps it ran). -> (summarize's figures with the profiled wall time a step, the table)."""
    add_requests()
    step_until_decoding(engine)
    engine.step(final_only=True)  # (the first step whose rows are all decodes is in flight: one more)
    ranges: dict[str, list[float]] = {}
    ran = [0]

    def run_steps() -> None:
        ran[0] = 0
        while ran[0] < steps and engine.has_unfinished():  # (speculative steps may finish the requests early)
            engine.step(final_only=True)
            ran[0] += 1

    with host_stages(engine):
        events, wall, table = run_profiled(run_steps, device, ranges=ranges)
    profiled = max(ran[0], 1)
    summary = summarize(events, profiled, num_layers, wall / profiled, device)
    summary["profiled_wall_ms_per_step"] = 1000 * wall / profiled
    summary["window"] = f"steady decode (every request past its prefill), {ran[0]} steps"
    summary["host_stages"] = _stage_table(None, ranges, profiled)
    timed: dict[str, list[float]] = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with host_stages(engine, timed):
        run_steps()
    if device.type == "cuda":
        torch.cuda.synchronize()
    summary["unprofiled_wall_ms_per_step"] = 1000 * (time.perf_counter() - t0) / max(ran[0], 1) if ran[0] else None
    summary["host_stages_unprofiled"] = _stage_table(None, timed, max(ran[0], 1))
    while engine.has_unfinished():
        engine.step(final_only=True)
    return summary, table


def format_summary(title: str, s: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f} ms"

    lines = [f"{title}: {s['kernels_per_step']:.1f} kernels/step ({s['kernels_per_layer']:.1f}/layer), "
             f"kernels {ms(s['kernel_ms_per_step'])}, busy {ms(s['busy_ms_per_step'])}, "
             f"wall {ms(s['wall_ms_per_step'])}, host gap {ms(s['host_gap_ms_per_step'])} per step"]
    if s.get("window"):
        lines.append(f"  window: {s['window']}; unprofiled wall {ms(s.get('unprofiled_wall_ms_per_step'))} a step")
    for kind, k in s["by_kind"].items():
        lines.append(f"  {kind:22s} {k['kernels_per_step']:8.1f} kernels/step  {k['ms_per_step']:8.3f} ms/step  "
                     f"{100 * k['share']:5.1f} %")
    for k in s["top_kernels"][:8]:
        lines.append(f"    {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<6.1f} {k['kind']:22s} {k['name'][:90]}")
    if s.get("idle_gaps"):
        lines.append(f"  device idle between events: {s['idle_ms_per_step']:.3f} ms/step, the largest:")
        for g in s["idle_gaps"]:
            lines.append(f"    {g['ms_per_step']:8.3f} ms  x{g['per_step']:<6.1f} after {g['after']}  before {g['before']}")
    for key, what in (("host_stages", "profiled"), ("host_stages_unprofiled", "unprofiled, perf_counter")):
        if not s.get(key):
            continue
        lines.append(f"  host time a step by stage ({what}; nested stages included in their callers'):")
        for name, h in sorted(s[key].items(), key=lambda kv: -kv[1]["ms_per_step"]):
            lines.append(f"    {h['ms_per_step']:8.3f} ms  x{h['calls_per_step']:<6.1f} {name} "
                         f"(median call {h['median_ms_per_call']:.3f} ms)")
    return "\n".join(lines)
