"""Granite 4.0-H (`granitemoehybrid`): a Mamba-2 / attention hybrid with Granite's constants.

Decoder blocks are pre-norm (RMSNorm), with two kinds of token mixer as `layer_types` (or the released configs'
`layers_block_type`) says:
- mamba / linear_attention: a Mamba-2 mixer (layers/mamba2.py) that keeps a recurrent state per sequence;
- attention / full_attention: GQA over the paged KV cache, scores scaled by attention_multiplier, with RoPE only
  where position_embedding_type is "rope" (the released Granite 4.0-H models use none: "nope").
Each block's MLP is a shared SwiGLU expert (`shared_mlp`) plus, where num_local_experts > 0, routed experts (top-k of
the router's logits, their softmax as weights); each mixer's and MLP's output is multiplied by residual_multiplier
before the residual add, the embedding by embedding_multiplier, and the logits divided by logits_scaling.

Checkpoint layout (as IBM publishes it and transformers saves it): `block_sparse_moe.input_linear` [E, 2I, H] (gate
rows first), `output_linear` [E, H, I] and `router.layer` [E, H]; `shared_mlp.input_linear` [2I, H] and
`output_linear`; the Mamba-2 mixer's `in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm` and `out_proj`.

Eager mixed steps (layers/mamba2.py says why, and how tensor parallelism splits the Mamba-2 layers; the attention
and MLPs split as Llama's, the experts by their intermediate rows); speculative decoding and prefix caching as
Qwen3-Next's (the engine backs the recurrent state up and snapshots it); FP8 checkpoints and LoRA adapters are
refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.embedding import LMHead
from atlas.layers.mamba2 import Mamba2Mixer
from atlas.layers.moe import FusedExperts, RouterConfig, TopKRouter
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import load_named_weights, make_layers, renamed_weights
from atlas.models.granite_moe import granite_moe_names
from atlas.models.hybrid import HybridDecoderLayer, RecurrentHybridLM
from atlas.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaVariant, _MultipliedEmbedding
from atlas.models.qwen3_next import check_experts_complete
from atlas.models.sparse_moe import SKIP, expert_mapper

MAMBA, ATTENTION = "mamba", "attention"
_TYPES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}
_STACKED = [
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
]


def _positive(cfg: ModelConfig, key: str, default: float) -> float:
    value = cfg.raw.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} field {key!r} must be a positive "
                             f"number, got {value!r}")
    return float(value)


def granite_layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's mixer, MAMBA or ATTENTION, from layer_types or layers_block_type."""
    raw = cfg.raw
    types = raw.get("layer_types") or raw.get("layers_block_type")
    where = cfg.path / "config.json"
    if not isinstance(types, list) or len(types) != cfg.num_hidden_layers or any(t not in _TYPES for t in types):
        raise ModelLoadError(f"malformed checkpoint: {where} must list {cfg.num_hidden_layers} layer_types (or "
                             f"layers_block_type), each one of {sorted(_TYPES)}; got {types!r}")
    out = [_TYPES[t] for t in types]
    if ATTENTION not in out:
        raise UnsupportedModelError(f"{where}: a model of Mamba-2 layers only; Atlas serves the hybrids (at least "
                                    "one attention layer)")
    return out


def _time_step_limit(cfg: ModelConfig) -> tuple[float, float]:
    limit = cfg.raw.get("time_step_limit") or (0.0, float("inf"))

    def number(v) -> float:  # (transformers writes infinity as {"__float__": "Infinity"})
        return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)

    try:
        low, high = (number(v) for v in limit)
    except (TypeError, ValueError, KeyError):
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} time_step_limit must be two numbers, "
                             f"got {limit!r}") from None
    return low, high


class GraniteMoE(nn.Module):
    """The shared SwiGLU expert plus the routed experts where the model has them. Under tensor parallelism both are
    sharded (the experts by their intermediate rows, layers/moe.py) and their partial sums all-reduced once."""

    def __init__(self, cfg: ModelConfig, shared_size: int):
        super().__init__()
        raw = cfg.raw
        act = raw.get("hidden_act", "silu")
        self.mp = current()
        self.shared_mlp = LlamaMLP(cfg.hidden_size, shared_size, act, bias=False, reduce=False)
        experts = raw.get("num_local_experts", 0) or 0
        self.experts = self.gate = None
        if experts:
            self.gate = TopKRouter(cfg.hidden_size, RouterConfig(experts, raw["num_experts_per_tok"],
                                                                 scoring_func="softmax", topk_method="greedy",
                                                                 norm_topk_prob=True, model_dtype_logits=True),
                                   correction_bias=False)
            self.experts = FusedExperts(experts, cfg.hidden_size, cfg.intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_mlp(x)
        if self.experts is not None:
            weights, ids = self.gate(x)
            out = out + self.experts(x, weights, ids)
        return self.mp.all_reduce(out)


class GraniteHybridDecoderLayer(HybridDecoderLayer):
    recurrent_name = "mamba"

    def __init__(self, cfg: ModelConfig, kind: str, layer_idx: int, rotary: RotaryEmbedding, multipliers: dict,
                 shared_size: int):
        super().__init__()
        raw = cfg.raw
        self.is_recurrent = kind == MAMBA
        if self.is_recurrent:
            heads, head_dim = raw.get("mamba_n_heads", 128), raw.get("mamba_d_head", 64)
            expand = raw.get("mamba_expand", 2)
            if head_dim == "auto":  # (Bamba's config: the width over the heads)
                head_dim = expand * cfg.hidden_size // heads
            if expand * cfg.hidden_size != heads * head_dim:  # (transformers reshapes one into the other)
                raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'}: mamba_expand x hidden_size "
                                     f"({expand} x {cfg.hidden_size}) is not mamba_n_heads x mamba_d_head "
                                     f"({heads} x {head_dim})")
            self.mamba = Mamba2Mixer(
                cfg.hidden_size, heads, head_dim, raw.get("mamba_d_state", 128), raw.get("mamba_n_groups", 1),
                raw.get("mamba_d_conv", 4),
                cfg.rms_norm_eps, conv_bias=bool(raw.get("mamba_conv_bias", True)),
                proj_bias=bool(raw.get("mamba_proj_bias", False)), time_step_limit=_time_step_limit(cfg),
                chunk_size=raw.get("mamba_chunk_size", 256), act=raw.get("hidden_act", "silu"))
        else:
            bias = bool(raw.get("attention_bias", False))
            variant = LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False,
                                   sliding_windows=[None] * cfg.num_hidden_layers)
            self.self_attn = LlamaAttention(cfg, variant, layer_idx, rotary)
            self.self_attn.attn.scale = multipliers["attention_multiplier"]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GraniteMoE(cfg, shared_size)
        self.residual_multiplier = multipliers["residual_multiplier"]


class GraniteHybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, types: list[str], multipliers: dict, max_positions: int, rope: bool,
                 shared_size: int):
        super().__init__()
        self.embed_tokens = _MultipliedEmbedding(cfg.vocab_size, cfg.hidden_size, multipliers["embedding_multiplier"])
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings)
        if not rope:  # (no RoPE: the attention layers see the identity rotation)
            rotary = rotary.identity()
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: GraniteHybridDecoderLayer(
            cfg, types[i], i, rotary, multipliers, shared_size))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GraniteMoeHybridForCausalLM(RecurrentHybridLM):
    # (its Mamba-2 scan reads host values outside the uniform steps: layers/mamba2.py)
    recurrent_state_in_mixed_graphs = False
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def tensor_parallel_divisors(cls, cfg: ModelConfig) -> dict[str, int]:
        return {"Mamba-2 heads (mamba_n_heads)": cfg.raw.get("mamba_n_heads", 128),
                "shared_intermediate_size": cls.shared_size(cfg)}

    @classmethod
    def layer_kinds(cls, cfg: ModelConfig) -> list[str]:
        return granite_layer_types(cfg)

    @classmethod
    def uses_rope(cls, cfg: ModelConfig) -> bool:
        position = cfg.raw.get("position_embedding_type")
        if position not in (None, "nope", "rope"):
            raise UnsupportedModelError(f"{cfg.path / 'config.json'}: position_embedding_type {position!r}; Atlas "
                                        "implements 'rope' and none ('nope')")
        return position == "rope"

    @classmethod
    def shared_size(cls, cfg: ModelConfig) -> int:
        """The shared (always-on) SwiGLU expert's width."""
        return cfg.raw["shared_intermediate_size"]

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        multipliers = {key: _positive(cfg, key, 1.0) for key in
                       ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")}
        if "attention_multiplier" not in cfg.raw:  # (transformers' default: the usual head_dim^-0.5)
            multipliers["attention_multiplier"] = cfg.head_dim ** -0.5
        self.logits_scaling = multipliers["logits_scaling"]
        self.layer_types = self.layer_kinds(cfg)
        self.model = GraniteHybridModel(cfg, self.layer_types, multipliers, max_positions, self.uses_rope(cfg),
                                        self.shared_size(cfg))
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    # (no vocab_weight_names: the embedding is multiplied, so a drafter cannot share it as a plain lookup)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return LlamaForCausalLM.compute_logits(self, hidden, out=out).div_(self.logits_scaling)

    def _checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, object]]:
        """The published names under this model's (models/granite_moe.granite_moe_names; the shared expert is this
        block's `shared_mlp`)."""
        for name, tensor in renamed_weights(weights, tied_head=self.config.tie_word_embeddings):
            yield from granite_moe_names(name, tensor, self.config.path, "shared_mlp")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._checkpoint_names(weights), _STACKED, skip_suffixes=SKIP,
                           mapper=expert_mapper, strict=True)
        check_experts_complete(self, self.config.path)


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """Bamba (ibm-ai-platform/Bamba-9B; model_type bamba), Granite 4.0-H's predecessor: the same Mamba-2 and
    attention layers (attention on the layers `attn_layer_indices` lists) without Granite's multipliers, a dense
    SwiGLU MLP (`feed_forward`) after `pre_ff_layernorm`, RoPE on the first half of each head's dims (transformers'
    BambaConfig fixes partial_rotary_factor at 0.5), the final norm `final_layernorm`."""

    _RENAMES = ((".feed_forward.", ".mlp.shared_mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                ("model.final_layernorm.", "model.norm."))

    @classmethod
    def layer_kinds(cls, cfg: ModelConfig) -> list[str]:
        raw = cfg.raw
        if raw.get("layers_block_type") is None and raw.get("layer_types") is None:
            attention = raw.get("attn_layer_indices") or []
            if not isinstance(attention, list) or not all(isinstance(i, int) for i in attention):
                raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} attn_layer_indices must be a "
                                     f"list of layer ids, got {attention!r}")
            cfg = replace(cfg, raw={**raw, "layer_types": [ATTENTION if i in attention else MAMBA
                                                           for i in range(cfg.num_hidden_layers)]})
        return granite_layer_types(cfg)

    @classmethod
    def uses_rope(cls, cfg: ModelConfig) -> bool:
        return True

    @classmethod
    def shared_size(cls, cfg: ModelConfig) -> int:
        if cfg.raw.get("mlp_bias"):
            raise UnsupportedModelError(f"{cfg.path / 'config.json'}: Bamba with mlp_bias (biases on the MLP "
                                        "projections) is not supported; the released models have none")
        return cfg.intermediate_size

    def _checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, object]]:
        yield from super()._checkpoint_names(renamed_weights(weights, self._RENAMES))
