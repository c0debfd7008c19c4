"""GLM-4 dense (Glm4ForCausalLM: GLM-4-9B / 32B-0414, GLM-Z1; GlmForCausalLM: the first GLM-4, glm-4-9b-chat-hf,
whose block has Llama's two norms): Llama's attention (q / k / v biases, no o bias) and
SwiGLU MLP in a block with four norms (transformers' Glm4DecoderLayer): input_layernorm before attention,
post_self_attn_layernorm on its output before the residual add, post_attention_layernorm before the MLP,
post_mlp_layernorm on its output before the residual add. RoPE on interleaved pairs of the first
partial_rotary_factor of each head (GLM's). The checkpoint's gate|up is one tensor, split here into the pieces the
loader shards by.

The block keeps the Llama layers' protocol (LlamaDecoderLayer.forward: the branch output and the stream before it,
summed by whoever reads them next), so the model's forward, pipeline stages and hidden-state capture are Llama's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear import loaded_shape
from atlas.layers.norm import RMSNorm
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, LlamaVariant


class Glm4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, variant: LlamaVariant, layer_idx: int, rotary: RotaryEmbedding,
                 mlp: Callable[[bool], nn.Module] | None = None):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = LlamaAttention(cfg, variant, layer_idx, rotary)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.raw.get("hidden_act", "silu"), False)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.output_partial = False
        self.attn_input = self.mlp_input = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata, x_partial: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous block's normed MLP output, the stream before it) -> this block's (LlamaDecoderLayer's
        protocol; for the first block x is the embedding and residual None)."""
        stream = x if residual is None else x + residual
        attn = self.self_attn(positions, self.input_layernorm(stream), kv_cache, meta)
        stream = stream + self.post_self_attn_layernorm(attn)
        return self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(stream))), stream


class Glm4ForCausalLM(LlamaForCausalLM):
    """GLM-4 dense (module docstring). LoRA adapters and FP8 checkpoints are refused for this family."""

    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()
    neox_rope = False

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        return LlamaVariant(qkv_bias=bool(cfg.raw.get("attention_bias", True)), o_bias=False, mlp_bias=False,
                            qk_norm=False, sliding_windows=[None] * cfg.num_hidden_layers)

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        return LlamaModel(cfg, self.variant(cfg), max_positions, layer=Glm4DecoderLayer, is_neox_style=self.neox_rope)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    @staticmethod
    def _unfused(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith("mlp.gate_up_proj.weight"):  # (a lazy slice under tensor parallelism: read whole)
                half = loaded_shape(tensor)[0] // 2
                base = name.removesuffix("gate_up_proj.weight")
                yield base + "gate_proj.weight", tensor[:half]
                yield base + "up_proj.weight", tensor[half:]
            else:
                yield name, tensor


class GlmForCausalLM(Glm4ForCausalLM):
    """The first GLM-4 (glm-4-9b-hf, glm-4-9b-chat-hf; model_type `glm`): GLM-4-0414's attention, partial interleaved
    RoPE and fused gate|up in Llama's block of two norms (transformers' GlmDecoderLayer). LoRA adapters and FP8
    checkpoints are refused as for GLM-4-0414."""

    decoder = LlamaForCausalLM.decoder  # (Llama's two-norm block)
