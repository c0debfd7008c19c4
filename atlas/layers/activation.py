"""Activations. The gated MLP's gate and up projections are fused, so the activation splits them:
act(gate) * up, computed by the gate|up projection itself (layers/linear.py `act=`: the GEMV's epilogue on
CUDA for single rows, else kernels/fused_ops.act_and_mul)."""

from __future__ import annotations

from atlas.errors import UnsupportedModelError
from atlas.kernels.fused_ops import ACT_KINDS


def gated_activation(name: str) -> str:
    """The HF `hidden_act` name of a gated MLP, refused with the supported names if no kernel computes it."""
    if name not in ACT_KINDS:
        raise UnsupportedModelError(
            f"hidden_act {name!r} is not supported; supported: {', '.join(sorted(ACT_KINDS))}")
    return name
