"""Activations. The gated MLP's gate and up projections are fused, so the activation splits them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atlas.errors import UnsupportedModelError

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """act(gate) * up, where the input is [gate | up] along the last dimension."""

    def __init__(self, name: str):
        super().__init__()
        if name not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
        self.act = _ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
