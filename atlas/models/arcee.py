"""Arcee AFM (arcee-ai/AFM-4.5B; model_type `arcee`): Llama's layers with a non-gated MLP (`up_proj`, squared ReLU,
`down_proj`: Nemotron-H's MLP layer), biases where `attention_bias` / `mlp_bias` say. FP8 checkpoints load
dequantized; --quantization fp8 and LoRA adapters are refused (the Llama paths for both assume a gated MLP).
"""

from __future__ import annotations

from torch import nn

from atlas.config import ModelConfig
from atlas.errors import UnsupportedModelError
from atlas.models.llama import LlamaForCausalLM, LlamaModel
from atlas.models.nemotron_h import SquaredReluMLP


class ArceeForCausalLM(LlamaForCausalLM):
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()
    stacked_params = LlamaForCausalLM.stacked_params[:3]  # (q | k | v only: up_proj is not half of a gated pair)

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        act = cfg.raw.get("hidden_act", "relu2")
        if act != "relu2":
            raise UnsupportedModelError(f"{cfg.architecture}: hidden_act {act!r} in {cfg.path / 'config.json'}; Atlas "
                                        "implements Arcee's relu2 MLP")
        bias = bool(cfg.raw.get("mlp_bias", False))
        return LlamaModel(cfg, self.variant(cfg), max_positions,
                          mlp=lambda i: lambda reduce: SquaredReluMLP(cfg.hidden_size, cfg.intermediate_size, bias,
                                                                      reduce))
