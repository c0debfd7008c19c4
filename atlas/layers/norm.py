"""RMSNorm, computed in float32 like the reference implementations, then cast back.

With a residual, the decoder layer's residual add is fused in: norm(x + residual) and the new residual
stream x + residual come out of one kernel on CUDA (kernels/fused_ops.py; its PyTorch reference runs
elsewhere). Under tensor parallelism a layer may hand the norm its row-parallel projection's partial
sum (`reduce=`): the all-reduce then runs first, in the same kernel as the add and norm when the
view's fast all-reduce fuses them (kernels/peer_all_reduce.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from atlas.kernels.fused_ops import add_rms_norm, rms_norm, scaled_rms_norm
from atlas.layers.parallel import ModelParallel

if TYPE_CHECKING:
    from atlas.layers.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: ModelParallel | None = None,
                quantize_for: Linear | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual: (norm(x + residual), x + residual). With `reduce`, x is this rank's
        partial sum over reduce's tensor-parallel ranks, and the sum over them takes its place. quantize_for: the
        layer the norm's output goes to; where it takes its rows quantized (Linear.takes_quantized_rows: the
        fp8_fused_quant knob), the norm's kernel writes them as fp8_linear.QuantizedRows instead."""
        if (quantize_for is not None and (reduce is None or reduce.tp_size == 1) and x.dim() == 2
                and self.weight.dtype == x.dtype and quantize_for.takes_quantized_rows(x.shape[0], x.dtype, x.device)
                and x.shape[1] % 128 == 0):
            return self._quantized(x, residual)
        if reduce is not None and reduce.tp_size > 1:
            fused = getattr(reduce.fast, "add_rms_norm", None)
            if residual is not None and fused is not None:
                out = fused(x, residual, self.weight, self.eps)
                if out is not None:
                    return out
            x = reduce.all_reduce(x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def _quantized(self, x: torch.Tensor, residual: torch.Tensor | None):
        """forward's result with the norm's rows as QuantizedRows, by one kernel on CUDA (kernels/fused_ops_triton.py;
        the PyTorch ops elsewhere)."""
        from atlas.kernels.fp8_linear import BLOCKWISE_ROWS_ALIGN, QuantizedRows, quantized_rows_ref

        if not x.is_cuda:
            out = self.forward(x, residual)
            return (quantized_rows_ref(out[0]), out[1]) if residual is not None else quantized_rows_ref(out)
        from atlas.kernels.fused_ops_triton import rms_norm_quant_triton

        x = x if x.stride(1) == 1 else x.contiguous()
        if residual is not None and residual.stride(1) != 1:
            residual = residual.contiguous()
        out = rms_norm_quant_triton(x, self.weight, self.eps, residual, pad_rows_to=BLOCKWISE_ROWS_ALIGN)
        rows = QuantizedRows(out[0], out[1], x.shape[0], x.dtype)
        return rows if residual is None else (rows, out[2])


class Float32RMSNorm(nn.Module):
    """RMSNorm whose weight stays float32 whatever the model dtype (DeepSeek-V4's norms): normalised and scaled in
    float32, rounded once to the activation dtype (transformers' DeepseekV4RMSNorm, same operations and order)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose checkpoint weight w scales by (1 + w) (Gemma 3, Qwen3-Next, Qwen3.5; zero-initialised):
    normalised and scaled in float32, then rounded once to the activation dtype (the reference models' order;
    Llama's RMSNorm rounds first, then scales). Plain PyTorch ops in that order, so that bf16 agrees too; the same
    call forms as RMSNorm (with a residual: (norm(x + residual), x + residual), the sum in the activation dtype)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    #: what the weight is offset by before it scales (1: the checkpoint's w scales by 1 + w)
    weight_offset = 1.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: ModelParallel | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if reduce is not None and reduce.tp_size > 1:
            x = reduce.all_reduce(x)
        return scaled_rms_norm(x, self.weight, self.eps, self.weight_offset, residual)


class Float32ScaledRMSNorm(ZeroCenteredRMSNorm):
    """RMSNorm whose weight scales in float32 before the one rounding to the activation dtype (gpt-oss: transformers
    keeps its norms in float32 and computes weight * normalised(x) there), where Llama's rounds first, then scales.
    Weight initialised to 1; otherwise ZeroCenteredRMSNorm (the same call forms)."""

    weight_offset = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.fill_(1.0)
