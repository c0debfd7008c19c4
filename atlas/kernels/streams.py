"""The side stream that CUDA graph captures and kernel measurements run on."""

from __future__ import annotations

import torch

_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """One side stream a device for every capture and measurement: cuBLAS keeps a workspace (32 MiB on
    Hopper) for each stream it runs on, so a new stream a set of graphs would leave one behind each time,
    outside the memory plan."""
    device = torch.device("cuda", torch.cuda.current_device())
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]
