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
    """Let the next kernel launch and wait until the previous kernel in the stream has finished (its writes
    visible), in the order PDL says (pdl.TRIGGER_FIRST: 2, pdl.WAIT_FIRST: 1). Call before the first read or
    write of anything another kernel touches."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()
