"""EXAONE 4.0 (Exaone4ForCausalLM): OLMo 2's block shape (each branch's output normalized before the residual add, no
norm before either; models/olmo2.PostNormDecoderLayer) with Llama's norms and attention, q / k normalized per head
(as Qwen3's) before RoPE. A hybrid model (config.json sets sliding_window) windows the layers `layer_types` marks
sliding_attention and gives its full-attention layers no RoPE (identity rotation tables: cos 1, sin 0); a model
without a window takes RoPE on every layer."""

from __future__ import annotations

from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError
from atlas.models.llama import LlamaForCausalLM, LlamaModel, LlamaVariant
from atlas.models.olmo2 import PostNormDecoderLayer


def _layer_types(cfg: ModelConfig) -> list[str]:
    types = cfg.raw.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
    if len(types) != cfg.num_hidden_layers:
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} has {len(types)} layer_types for "
                             f"{cfg.num_hidden_layers} layers")
    return types


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4.0 (module docstring). LoRA adapters and FP8 checkpoints are refused for this family."""

    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        window = cfg.raw.get("sliding_window")
        windows = [window if window and t == "sliding_attention" else None for t in _layer_types(cfg)]
        return LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, sliding_windows=windows)

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        model = LlamaModel(cfg, self.variant(cfg), max_positions, layer=PostNormDecoderLayer)
        if cfg.raw.get("sliding_window"):  # (hybrid: the global layers without RoPE)
            types, identity = _layer_types(cfg), None
            for layer in model.layers:
                if types[layer.self_attn.layer_idx] == "sliding_attention":
                    continue
                identity = identity or layer.self_attn.rotary.identity()
                layer.self_attn.rotary = identity
        return model
