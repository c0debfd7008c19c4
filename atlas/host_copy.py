"""Host values onto the device without waiting for the device.

Step inputs, sampling parameters and drafter inputs are queued right behind work in flight; a plain
copy from pageable memory would wait for that work to finish. On CUDA they go through pinned staging
memory as non-blocking copies; elsewhere the host tensor is the device tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device_tensor(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on the device (pinned staging and a non-blocking copy on CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list (or tensor) as `dtype` on the device (`to_device_tensor`)."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return to_device_tensor(t, device)
