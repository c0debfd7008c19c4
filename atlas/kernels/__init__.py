"""Triton kernels, each with its PyTorch reference beside it (the path used off CUDA or without triton)."""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (said once: without it every CUDA kernel takes its PyTorch reference path)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("triton is not installed: on CUDA, attention, norms, rope, activations and grammar masks "
                       "use their slower PyTorch paths")
        return False
    return True
