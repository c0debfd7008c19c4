"""RMSNorm, computed in float32 like the reference implementations, then cast back.

With a residual, the decoder layer's residual add is fused in: norm(x + residual) and the new residual
stream x + residual come out of one kernel on CUDA (kernels/fused_ops.py; its PyTorch reference runs
elsewhere). Under tensor parallelism a layer may hand the norm its row-parallel projection's partial
sum (`reduce=`): the all-reduce then runs first, in the same kernel as the add and norm when the
view's fast all-reduce fuses them (kernels/peer_all_reduce.py).

A norm may be told the layer its output goes to (`consumer=`): an FP8 layer may take it quantized by the norm's
kernel (the fp8_fused_quant knob); a one-row GEMV may compute the norm itself (the gemv_fused_norm knob): the norm
then returns a kernels/gemv.NormedRow, and its residual output is filled when that layer runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from atlas.kernels.fused_ops import add_rms_norm, rms_norm, scaled_rms_norm
from atlas.kernels.gemv import NormedRow
from atlas.layers.parallel import ModelParallel

if TYPE_CHECKING:
    from atlas.layers.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: ModelParallel | None = None,
                consumer: Linear | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual: (norm(x + residual), x + residual). With `reduce`, x is this rank's
        partial sum over reduce's tensor-parallel ranks, and the sum over them takes its place. consumer: the
        layer the norm's output goes to; where it takes its rows quantized (Linear.takes_quantized_rows: the
        fp8_fused_quant knob), the norm's kernel writes them as fp8_linear.QuantizedRows instead; where it takes
        the row with its norm (Linear.takes_normed_row), the norm is a NormedRow (module docstring)."""
        if consumer is not None and (reduce is None or reduce.tp_size == 1) and x.dim() == 2:
            if (self.weight.dtype == x.dtype and consumer.takes_quantized_rows(x.shape[0], x.dtype, x.device)
                    and x.shape[1] % 128 == 0):
                return self._quantized(x, residual)
            if consumer.takes_normed_row(x, self.weight):
                return normed_row(x, residual, self.weight, self.eps, None)
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


def normed_row(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
               offset: float | None, keep_out: bool = False):
    """A norm's result as a NormedRow (the consumer's GEMV computes it): the row, with a residual (row, the new
    residual stream it fills)."""
    row = NormedRow(x, residual, weight, eps, offset, keep_out)
    return row if residual is None else (row, row.residual_out)


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: ModelParallel | None = None,
                consumer=None, keep_out: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """consumer (a Linear, or a router with takes_normed_row): as RMSNorm's, the normed row alone; keep_out:
        its GEMV also stores the norm's output (NormedRow.materialize() gives it after), which another layer
        reads too."""
        if reduce is not None and reduce.tp_size > 1:
            x = reduce.all_reduce(x)
        elif consumer is not None and x.dim() == 2 and consumer.takes_normed_row(x, self.weight):
            return normed_row(x, residual, self.weight, self.eps, self.weight_offset, keep_out)
        return scaled_rms_norm(x, self.weight, self.eps, self.weight_offset, residual)


class Float32ScaledRMSNorm(ZeroCenteredRMSNorm):
    """RMSNorm whose weight scales in float32 before the one rounding to the activation dtype (gpt-oss: transformers
    keeps its norms in float32 and computes weight * normalised(x) there), where Llama's rounds first, then scales.
    Weight initialised to 1; otherwise ZeroCenteredRMSNorm (the same call forms)."""

    weight_offset = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.fill_(1.0)
