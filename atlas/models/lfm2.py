"""LFM2 (`lfm2`: Liquid AI's LFM2-350M .. 2.6B; `lfm2_moe`: LFM2-8B-A1B): a hybrid of gated short-convolution layers
(layers/short_conv.py) and GQA attention layers, as `layer_types` ("conv" / "full_attention") or `full_attn_idxs`
says; LFM2-MoE's blocks after its first num_dense_layers take a sparse MoE (Lfm2MoE) in place of the MLP.

Each block is pre-norm: x + mixer(operator_norm(x)), then x + MLP(ffn_norm(x)), the MLP SwiGLU (w1 gate, w3 up, w2
down) of intermediate_size, or with block_auto_adjust_ff_dim of int(2/3 of it) times block_ffn_dim_multiplier
rounded up to block_multiple_of, as transformers' Lfm2MLP sizes it. The attention layers normalise q and k per head
(q_layernorm, k_layernorm) before RoPE; every RMSNorm takes norm_eps; the final norm is `embedding_norm`; the LM
head is tied by default.

Eager mixed steps (the short convolution's state as the other recurrent layers': layers/short_conv.py); tensor
parallelism splits the convolution's channels, the attention heads and the MLP; FP8 and LoRA refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.moe import FusedExperts, TopKRouter
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.layers.short_conv import ShortConv
from atlas.models.base import load_named_weights, make_layers, renamed_weights
from atlas.models.hybrid import HybridDecoderLayer, RecurrentHybridLM
from atlas.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaVariant
from atlas.models.qwen3_next import check_experts_complete
from atlas.models.sparse_moe import SKIP, checked_router, expert_mapper

CONV, ATTENTION = "conv", "full_attention"
_PIECES = {"1": "gate", "3": "up", "2": "down"}
_STACKED = [
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
]
_RENAMES = ((".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
            (".feed_forward.w2.", ".mlp.down_proj."), (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            (".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
            # (LFM2-MoE's sparse blocks)
            (".feed_forward.gate.", ".mlp.gate."), (".feed_forward.expert_bias", ".mlp.gate.e_score_correction_bias"))
_EXPERT_PIECE = re.compile(r"\.feed_forward\.experts\.(\d+)\.w([123])\.")


def lfm2_layer_types(cfg: ModelConfig) -> list[str]:
    raw, n, where = cfg.raw, cfg.num_hidden_layers, cfg.path / "config.json"
    types = raw.get("layer_types")
    if types is None:
        idxs = raw.get("full_attn_idxs") or []
        types = [ATTENTION if i in idxs else CONV for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (CONV, ATTENTION) for t in types):
        raise ModelLoadError(f"malformed checkpoint: {where} must give {n} layer_types, each {CONV!r} or "
                             f"{ATTENTION!r}; got {types!r}")
    if ATTENTION not in types:
        from atlas.errors import UnsupportedModelError

        raise UnsupportedModelError(f"{where}: a model of short-convolution layers only; Atlas serves the hybrids")
    return types


def lfm2_mlp_size(cfg: ModelConfig) -> int:
    """The MLP width as transformers' Lfm2MLP computes it."""
    raw, size = cfg.raw, cfg.intermediate_size
    if raw.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = raw.get("block_multiple_of", 256)
            size = int(multiplier * size)
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2MoE(nn.Module):
    """LFM2-MoE's sparse block: sigmoid scores of the router's logits (in the model dtype), the top-k chosen by the
    scores plus expert_bias where use_expert_bias says, renormalized (their sum + 1e-6) by norm_topk_prob and scaled by
    routed_scaling_factor; SwiGLU experts (w1 gate, w3 up, w2 down); no shared expert. Under tensor parallelism the
    experts are sharded by their intermediate rows and their partial sums all-reduced."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        bias = bool(raw.get("use_expert_bias", True))
        router = checked_router(cfg.path / "config.json", raw.get("num_experts", 32), raw.get("num_experts_per_tok", 4),
                                "sigmoid", "noaux_tc" if bias else "greedy", 1, 1, bool(raw.get("norm_topk_prob", True)),
                                float(raw.get("routed_scaling_factor", 1.0)), model_dtype_logits=True)
        self.gate = TopKRouter(cfg.hidden_size, replace(router, norm_eps=1e-6), correction_bias=bias)
        self.experts = FusedExperts(router.num_experts, cfg.hidden_size, raw.get("moe_intermediate_size", 1792), "silu")
        self.mp = current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mp.all_reduce(self.experts.forward_routed(x, self.gate))


class Lfm2DecoderLayer(HybridDecoderLayer):
    recurrent_name = "conv"

    def __init__(self, cfg: ModelConfig, kind: str, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.is_recurrent = kind == CONV
        if self.is_recurrent:
            self.conv = ShortConv(cfg.hidden_size, cfg.raw.get("conv_L_cache", 3),
                                  bool(cfg.raw.get("conv_bias", False)))
        else:
            variant = LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True,
                                   sliding_windows=[None] * cfg.num_hidden_layers)
            self.self_attn = LlamaAttention(cfg, variant, layer_idx, rotary)
        if cfg.model_type == "lfm2_moe":  # (dense for the first num_dense_layers, as transformers' Lfm2Moe builds them)
            self.mlp = (LlamaMLP(cfg.hidden_size, cfg.intermediate_size, "silu", bias=False)
                        if layer_idx < cfg.raw.get("num_dense_layers", 2) else Lfm2MoE(cfg))
        else:
            self.mlp = LlamaMLP(cfg.hidden_size, lfm2_mlp_size(cfg), "silu", bias=False)
        # (the checkpoint's operator_norm and ffn_norm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Lfm2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, types: list[str], max_positions: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings)
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: Lfm2DecoderLayer(cfg, types[i], i, rotary))
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Lfm2ForCausalLM(RecurrentHybridLM):
    """LFM2 and LFM2-MoE (module docstring)."""

    recurrent_state_in_mixed_graphs = False  # (layers/short_conv.py)
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def tensor_parallel_divisors(cls, cfg: ModelConfig) -> dict[str, int]:
        """The MLP's width as transformers sizes it (intermediate_size adjusted; the sparse blocks' experts are
        checked as every model's moe_intermediate_size)."""
        return {} if cfg.model_type == "lfm2_moe" else {"MLP width (intermediate_size, adjusted)": lfm2_mlp_size(cfg)}

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        cfg = replace(cfg, rms_norm_eps=float(cfg.raw.get("norm_eps", 1e-5)))  # (LFM2 names its eps norm_eps)
        self.config = cfg
        self.layer_types = lfm2_layer_types(cfg)
        self.model = Lfm2Model(cfg, self.layer_types, max_positions)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    def final_norm(self) -> nn.Module:
        return self.model.embedding_norm

    compute_logits = LlamaForCausalLM.compute_logits
    vocab_weight_names = LlamaForCausalLM.vocab_weight_names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in renamed_weights(weights, _RENAMES, self.config.tie_word_embeddings):
                yield _EXPERT_PIECE.sub(lambda m: f".mlp.experts.{m[1]}.{_PIECES[m[2]]}_proj.", name), tensor

        load_named_weights(self, renamed(), _STACKED, skip_suffixes=SKIP, mapper=expert_mapper, strict=True)
        check_experts_complete(self, self.config.path)
