"""Programmatic dependent launch (PDL) for the decode path's Triton kernels.

A decode step at a few rows is hundreds of short kernels in a row, and between two of them the GPU drains
the first, then launches and ramps up the second: a few microseconds each time with the memory bus idle.
On compute capability 9.0+ a kernel launched with PDL may start while the one before it in the stream is
still running. Every kernel here that takes part does, at its start, `griddepcontrol.launch_dependents`
(the next kernel may launch now) and `griddepcontrol.wait` (it blocks until the previous kernel has finished
and its writes are visible): so it never reads or writes anything before its predecessor is done, and the
cost of launching it is paid while its predecessor runs. Values are unchanged.
Measured on an H200 (BENCHMARKS.md): a batch-1 decode step of an 8B model 1 % shorter, a 16-row verify step 6 %;
a chain of single-row decode layers without attention (norms, projections, activation) 3-5 % shorter through the
GEMV, 1-4 % through cuBLAS (whose kernels do not take part: a Triton kernel after one gains its launch). Loading
the GEMV's first weight tile before the wait was measured slower (the kernel's code doubles) and is not done.

On when the `pdl` tuning knob is (the default; kernels/settings.py), on CUDA devices of capability 9.0+ under
CUDA 12.4+, outside Triton's CPU interpreter and with a Triton that has the instructions; `launch_options(device)` gives the kernels'
`PDL` flag and launch keywords.
"""

from __future__ import annotations

import functools
import os

import torch

from atlas.kernels import settings


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` take part (see the module docstring; cached until the settings change)."""
    return (settings.tuning.pdl and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and _cuda_at_least(12, 4) and torch.cuda.get_device_capability(device) >= (9, 0) and _triton_has_pdl())


def _cuda_at_least(major: int, minor: int) -> bool:
    """Whether torch's CUDA runtime (hence the driver under it) is this recent. Capturing PDL launches in CUDA
    graphs came with 12.3; 12.4 is asked for (the H200 machine's 13.0 is what was measured)."""
    try:
        got = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


# The kernels' PDL flag when on (pdl_triton.pdl_begin): 2 lets the next kernel launch before waiting for the previous
# one (its programs can then be resident, launched, while this kernel runs), 1 after.
# Either way nothing is read before the wait. The pdl_trigger knob after-wait picks 1, for measuring.
TRIGGER_FIRST, WAIT_FIRST = 2, 1


@functools.cache
def trigger_flag() -> int:
    return TRIGGER_FIRST if settings.tuning.pdl_trigger == "first" else WAIT_FIRST


def launch_options(device: torch.device, moe: bool = False) -> dict:
    """Keyword arguments of a launch on `device`: the kernel's `PDL` flag (0 off, else TRIGGER_FIRST or WAIT_FIRST),
    and `launch_pdl` when on. moe: a router or routed-expert kernel, which the moe_pdl knob can leave out (a
    batch-1 MoE step was shorter with PDL off: BENCHMARKS.md 7.1; the knob tells whether these kernels are why)."""
    if not enabled(device) or (moe and not settings.tuning.moe_pdl):
        return {"PDL": 0}
    return {"PDL": trigger_flag(), "launch_pdl": True}
