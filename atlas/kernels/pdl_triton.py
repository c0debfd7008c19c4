"""The Triton side of programmatic dependent launch (kernels/pdl.py): what a kernel does at its start."""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL stays off (pdl.enabled), so the branch below is never compiled
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished (its writes visible), then let the next one
    launch. Call before the first read or write of anything another kernel touches."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
