"""OLMo 2 (Olmo2ForCausalLM): Llama's attention and SwiGLU MLP in a block that normalizes each branch's output before
the residual add (post_attention_layernorm after attention, post_feedforward_layernorm after the MLP; no norm before
either), and q / k norms over the whole projected query and key (every head at once, not per head), before RoPE.
Every norm is OLMo's: the weight multiplied in float32, then the result cast (transformers' Olmo2RMSNorm).

The block keeps the Llama layers' protocol (LlamaDecoderLayer.forward: the branch output and the stream before it,
summed by whoever reads them next), so the model's forward, pipeline stages and hidden-state capture are Llama's.
Under tensor parallelism each rank normalizes its own heads with the sum of squares over every rank (an
all-reduce of one value a row); a model whose key-value heads would be replicated over the ranks is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atlas.config import ModelConfig, rope_of_layer_type
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.kernels.fused_ops import qk_norm_rope_kv_write
from atlas.layers.attention import AttentionMetadata
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import ModelParallel, current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaVariant,
)


class OlmoNorm(nn.Module):
    """RMSNorm as OLMo computes it, over `size` values of which this rank holds `local` (from `first`): the sum of
    squares is all-reduced over `mp`'s ranks when it splits them. With a residual: (norm(x + residual), x +
    residual), as the Llama norms return it."""

    def __init__(self, size: int, eps: float, local: int | None = None, first: int = 0,
                 mp: ModelParallel | None = None, weight_in_float32: bool = True):
        """weight_in_float32=False: the normalized values cast to the input's dtype before the weight multiplies
        them (Llama's order, which MiniMax-M2's q / k norms keep)."""
        super().__init__()
        self.size, self.eps, self.mp, self.weight_in_float32 = size, eps, mp, weight_in_float32
        local = size if local is None else local
        self.weight = nn.Parameter(torch.ones(local))
        if local != size:
            def load(param: nn.Parameter, loaded) -> None:
                param.data.copy_(loaded[first: first + local])

            self.weight.weight_loader = load

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce=None, quantize_for=None):
        if residual is not None:
            x = x + residual
        h = x.float()
        squares = h.pow(2).sum(-1, keepdim=True)
        if self.mp is not None and self.mp.tp_size > 1:
            squares = self.mp.all_reduce(squares)
        normed = h * torch.rsqrt(squares / self.size + self.eps)
        out = (self.weight * normed).to(x.dtype) if self.weight_in_float32 else self.weight * normed.to(x.dtype)
        return out if residual is None else (out, x)


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q / k norms over the whole projections (OLMo 2 and 3; MiniMax-M2 with Llama's order of
    cast and weight: norm_weight_in_float32)."""

    norm_weight_in_float32 = True

    def __init__(self, cfg: ModelConfig, variant: LlamaVariant, layer_idx: int, rotary: RotaryEmbedding,
                 reduce: bool = True):
        super().__init__(cfg, variant, layer_idx, rotary, reduce)
        mp = current()
        if mp.tp_size > 1 and cfg.num_key_value_heads % mp.tp_size:
            raise UnsupportedModelError(
                f"{cfg.architecture} normalizes all key heads together, and {cfg.num_key_value_heads} key-value heads "
                f"cannot be split over {mp.tp_size} tensor-parallel ranks without replicating them: use a "
                f"--tensor-parallel-size that divides {cfg.num_key_value_heads}")
        q_local, kv_local = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_norm = OlmoNorm(cfg.num_attention_heads * self.head_dim, cfg.rms_norm_eps, q_local,
                               mp.tp_rank * q_local, mp, self.norm_weight_in_float32)
        self.k_norm = OlmoNorm(cfg.num_key_value_heads * self.head_dim, cfg.rms_norm_eps, kv_local,
                               mp.tp_rank * kv_local, mp, self.norm_weight_in_float32)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.windowed is not None:
            meta = meta.for_layer(self.attn.sliding_window)
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        rotary = self.rotary
        q = qk_norm_rope_kv_write(qkv, positions, rotary.cos_cache, rotary.sin_cache, self.num_heads,
                                  self.num_kv_heads, self.head_dim, None, None, 0.0, rotary.rotary_dim,
                                  rotary.is_neox_style, kv_cache, meta.slot_mapping)
        out = self.attn.attend(q, kv_cache, meta)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class ProjectionNormAttention(Olmo2Attention):
    """Whole-projection q / k norms in Llama's order (the normalized values cast to the model dtype, then the weight):
    OLMoE's and MiniMax-M2's."""

    norm_weight_in_float32 = False


class ProjectionNormDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block over ProjectionNormAttention (OLMoE, MiniMax-M2)."""

    attention_class = ProjectionNormAttention


class PostNormDecoderLayer(nn.Module):
    """A block that normalizes each branch's output before the residual add, with no norm before either (OLMo 2 and
    3, EXAONE 4): `attention_class` and `norm_class` say whose attention and norms."""

    attention_class: Callable[..., nn.Module] = LlamaAttention
    norm_class: Callable[..., nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, variant: LlamaVariant, layer_idx: int, rotary: RotaryEmbedding,
                 mlp: Callable[[bool], nn.Module] | None = None):
        super().__init__()
        self.self_attn = self.attention_class(cfg, variant, layer_idx, rotary)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.raw.get("hidden_act", "silu"), False)
        self.post_feedforward_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_partial = False
        self.attn_input = self.mlp_input = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata, x_partial: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous block's normed MLP output, the stream before it) -> this block's (LlamaDecoderLayer's
        protocol; for the first block x is the embedding and residual None)."""
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2DecoderLayer(PostNormDecoderLayer):
    attention_class = Olmo2Attention
    norm_class = OlmoNorm


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (module docstring). LoRA adapters and FP8 checkpoints are refused for this family."""

    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        bias = bool(cfg.raw.get("attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False,
                            sliding_windows=[None] * cfg.num_hidden_layers)

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        model = LlamaModel(cfg, self.variant(cfg), max_positions, layer=Olmo2DecoderLayer)
        model.norm = OlmoNorm(cfg.hidden_size, cfg.rms_norm_eps)
        return model


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2's blocks with a window on the layers `layer_types` marks sliding_attention, and RoPE set per
    layer type (rope_parameters holds one set a type)."""

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        types = cfg.raw.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
        if len(types) != cfg.num_hidden_layers:
            raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} has {len(types)} layer_types for "
                                 f"{cfg.num_hidden_layers} layers")
        window = cfg.raw.get("sliding_window")
        bias = bool(cfg.raw.get("attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False,
                            sliding_windows=[window if t == "sliding_attention" else None for t in types])

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        model = super().decoder(cfg, max_positions)
        types = cfg.raw.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
        if isinstance((cfg.raw.get("rope_parameters") or {}).get(types[0]), dict):
            rotaries = {t: RotaryEmbedding(cfg.head_dim, rope_of_layer_type(cfg.raw, t), max_positions,
                                           cfg.max_position_embeddings) for t in set(types)}
            for layer in model.layers:
                layer.self_attn.rotary = rotaries[types[layer.self_attn.layer_idx]]
        return model

