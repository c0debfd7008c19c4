"""Apertus (swiss-ai/Apertus-8B and -70B; model_type `apertus`): Llama's attention with per-head q / k RMSNorms
before RoPE (Qwen3's), the block's norms named `attention_layernorm` and `feedforward_layernorm`, and a non-gated MLP
(`up_proj`, xIELU, `down_proj`).

xIELU has two learned scalars a layer, stored before their softplus (`act_fn.alpha_p`, `alpha_n`), and two constants
(`beta`, `eps`, in the checkpoint too):
    x > 0:  softplus(alpha_p) x^2 + beta x
    x <= 0: (expm1(min(x, eps)) - x) (beta + softplus(alpha_n)) + beta x
computed here in float32 (transformers computes it in the model dtype). FP8 checkpoints load dequantized;
--quantization fp8 and LoRA adapters are refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import UnsupportedModelError
from atlas.layers.linear import ColumnParallelLinear, RowParallelLinear
from atlas.models.base import renamed_weights
from atlas.models.llama import LlamaForCausalLM, LlamaModel, LlamaVariant


class Xielu(nn.Module):
    def __init__(self):
        super().__init__()
        # (parameters, so that the checkpoint's values load; the constants too)
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.beta = nn.Parameter(torch.zeros(()), requires_grad=False)
        self.eps = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        beta, eps = self.beta.float(), self.eps.float()
        alpha_p = nn.functional.softplus(self.alpha_p.float())
        alpha_n = beta + nn.functional.softplus(self.alpha_n.float())
        out = torch.where(h > 0, alpha_p * h * h + beta * h, (torch.expm1(torch.minimum(h, eps)) - h) * alpha_n + beta * h)
        return out.to(x.dtype)


class XieluMLP(nn.Module):
    """up_proj (column-parallel), xIELU, down_proj (row-parallel: one all-reduce; reduce=False: this rank's partial
    sum, the caller reduces)."""

    def __init__(self, hidden: int, intermediate: int, reduce: bool = True):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias=False)
        self.act_fn = Xielu()
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusForCausalLM(LlamaForCausalLM):
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()
    stacked_params = LlamaForCausalLM.stacked_params[:3]  # (q | k | v only: up_proj is not half of a gated pair)
    _RENAMES = ((".attention_layernorm.", ".input_layernorm."), (".feedforward_layernorm.", ".post_attention_layernorm."))

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        bias = bool(cfg.raw.get("attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                            sliding_windows=[None] * cfg.num_hidden_layers)

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        act = cfg.raw.get("hidden_act", "xielu")
        if act != "xielu":
            raise UnsupportedModelError(f"{cfg.architecture}: hidden_act {act!r} in {cfg.path / 'config.json'}; Atlas "
                                        "implements Apertus's xielu MLP")
        return LlamaModel(cfg, self.variant(cfg), max_positions,
                          mlp=lambda i: lambda reduce: XieluMLP(cfg.hidden_size, cfg.intermediate_size, reduce))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed_weights(weights, self._RENAMES))
