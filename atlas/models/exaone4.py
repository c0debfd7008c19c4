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
    """layer_types, else (a windowed model) from sliding_window_pattern as transformers' Exaone4Config derives it:
    an int N (default 4) windows every layer but each N-th; a string such as "LLLG" marks each layer of a period
    L (sliding) or G (global)."""
    raw, n = cfg.raw, cfg.num_hidden_layers
    types = raw.get("layer_types")
    if types is None and raw.get("sliding_window"):
        pattern = raw.get("sliding_window_pattern", 4)
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
            types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} sliding_window_pattern "
                                 f"{pattern!r} is neither a positive integer nor a string of L and G")
    types = types or ["full_attention"] * n
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
