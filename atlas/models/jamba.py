"""Jamba (`jamba`: AI21's Jamba 1.5 / 1.6 / 1.7 Mini and Large): Mamba (version 1) layers with an attention layer
every attn_layer_period-th (from attn_layer_offset), and a mixture of experts in place of the MLP every
expert_layer_period-th (from expert_layer_offset).

Blocks are pre-norm: x + mixer(input_layernorm(x)), then x + MLP(pre_ff_layernorm(x)). The Mamba mixer is
layers/mamba1.py; the attention is GQA without positional encoding (Jamba's attention layers take no RoPE); the MoE
takes the top num_experts_per_tok of the softmax of the router's logits (in the model dtype) as its weights,
unnormalized, over SwiGLU experts; the final norm is final_layernorm.

Eager mixed steps (layers/mamba1.py); tensor parallelism splits the Mamba channels, the attention heads, the MLPs and
the experts; FP8 checkpoints and LoRA adapters are refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.mamba1 import Mamba1Mixer
from atlas.layers.moe import FusedExperts, TopKRouter
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import load_named_weights, make_layers, renamed_weights
from atlas.models.hybrid import HybridDecoderLayer, RecurrentHybridLM
from atlas.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaVariant
from atlas.models.qwen3_next import check_experts_complete
from atlas.models.sparse_moe import SKIP, checked_router, expert_mapper

_STACKED = [
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
]
_RENAMES = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."),
            (".pre_ff_layernorm.", ".post_attention_layernorm."), ("model.final_layernorm.", "model.norm."))


def _period(cfg: ModelConfig, period_key: str, offset_key: str, period: int, offset: int) -> tuple[int, int]:
    raw = cfg.raw
    p, o = raw.get(period_key, period), raw.get(offset_key, offset)
    if not isinstance(p, int) or isinstance(p, bool) or p <= 0 or not isinstance(o, int) or not 0 <= o < p:
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} {period_key} {p!r} and {offset_key} "
                             f"{o!r} must be a positive period and an offset inside it")
    return p, o


class JambaMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        router = checked_router(cfg.path / "config.json", raw.get("num_experts", 16), raw.get("num_experts_per_tok", 2),
                                "softmax", "greedy", 1, 1, False, 1.0, model_dtype_logits=True)
        self.gate = TopKRouter(cfg.hidden_size, router, correction_bias=False)
        self.experts = FusedExperts(router.num_experts, cfg.hidden_size, cfg.intermediate_size,
                                    raw.get("hidden_act", "silu"))
        self.mp = current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mp.all_reduce(self.experts.forward_routed(x, self.gate))


class JambaDecoderLayer(HybridDecoderLayer):
    recurrent_name = "mamba"

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention: bool, moe: bool, rotary: RotaryEmbedding):
        super().__init__()
        raw = cfg.raw
        self.is_recurrent = not attention
        if self.is_recurrent:
            channels = raw.get("mamba_expand", 2) * cfg.hidden_size
            rank = raw.get("mamba_dt_rank", "auto")
            if rank == "auto":  # (transformers' JambaConfig: ceil(hidden / 16))
                rank = -(-cfg.hidden_size // 16)
            self.mamba = Mamba1Mixer(cfg.hidden_size, channels, raw.get("mamba_d_state", 16), raw.get("mamba_d_conv", 4),
                                     rank, cfg.rms_norm_eps, conv_bias=bool(raw.get("mamba_conv_bias", True)),
                                     proj_bias=bool(raw.get("mamba_proj_bias", False)))
        else:
            variant = LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                                   sliding_windows=[None] * cfg.num_hidden_layers)
            self.self_attn = LlamaAttention(cfg, variant, layer_idx, rotary)
        self.mlp = JambaMoE(cfg) if moe else LlamaMLP(cfg.hidden_size, cfg.intermediate_size,
                                                      raw.get("hidden_act", "silu"), bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class JambaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        # (no positional encoding: the attention layers see the identity rotation)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings).identity()
        attn = _period(cfg, "attn_layer_period", "attn_layer_offset", 8, 4)
        experts = _period(cfg, "expert_layer_period", "expert_layer_offset", 2, 1)
        moe = (cfg.raw.get("num_experts", 16) or 1) > 1
        kinds = [(i % attn[0] == attn[1], moe and i % experts[0] == experts[1]) for i in range(cfg.num_hidden_layers)]
        if not any(a for a, _ in kinds):
            raise UnsupportedModelError(f"{cfg.path / 'config.json'}: no attention layer; Atlas serves the hybrids")
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: JambaDecoderLayer(cfg, i, *kinds[i], rotary))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class JambaForCausalLM(RecurrentHybridLM):
    recurrent_state_in_mixed_graphs = False  # (layers/mamba1.py)
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def tensor_parallel_divisors(cls, cfg: ModelConfig) -> dict[str, int]:
        return {"Mamba channels (mamba_expand x hidden_size)": cfg.raw.get("mamba_expand", 2) * cfg.hidden_size}

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = JambaModel(cfg, max_positions)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    compute_logits = LlamaForCausalLM.compute_logits
    vocab_weight_names = LlamaForCausalLM.vocab_weight_names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, renamed_weights(weights, _RENAMES, self.config.tie_word_embeddings), _STACKED, skip_suffixes=SKIP, mapper=expert_mapper, strict=True)
        check_experts_complete(self, self.config.path)
