"""RMSNorm, computed in float32 like the reference implementations, then cast back.

With a residual, the decoder layer's residual add is fused in: norm(x + residual) and the new residual
stream x + residual come out of one kernel on CUDA (kernels/fused_ops.py; its PyTorch reference runs
elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from atlas.kernels.fused_ops import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
