"""Activations. The gated MLP's gate and up projections are fused, so the activation splits them;
act(gate) * up is one kernel on CUDA (kernels/fused_ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from atlas.errors import UnsupportedModelError
from atlas.kernels.fused_ops import ACT_KINDS, act_and_mul


class GatedActivation(nn.Module):
    """act(gate) * up, where the input is [gate | up] along the last dimension."""

    def __init__(self, name: str):
        super().__init__()
        if name not in ACT_KINDS:
            raise UnsupportedModelError(
                f"hidden_act {name!r} is not supported; supported: {', '.join(sorted(ACT_KINDS))}")
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_mul(x, self.name)
