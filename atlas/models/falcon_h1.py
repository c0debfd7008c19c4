"""Falcon-H1 (`falcon_h1`): a parallel hybrid, each decoder block running a Mamba-2 mixer and GQA attention side by
side on the same normed input, their outputs summed, then a SwiGLU MLP.

Per block, with RMSNorm input_layernorm and pre_ff_layernorm:
    h = input_layernorm(x)
    x = x + mamba(h) * ssm_out_multiplier + attention(h * attention_in_multiplier) * attention_out_multiplier
    x = x + down(up(h') * silu(gate(h') * gate_multiplier)) * down_multiplier,   h' = pre_ff_layernorm(x)
The Mamba-2 mixer (layers/mamba2.py) takes its input times ssm_in_multiplier and scales its in_proj output's z, x,
B, C and dt rows by ssm_multipliers; its width is mamba_d_ssm (else mamba_expand x hidden_size) and its output norm is
optional (mamba_rms_norm; mamba_norm_before_gate). The attention's keys are multiplied by key_multiplier before RoPE,
which here scales the scores (q . (m k) = m (q . k)); the embedding is multiplied by embedding_multiplier and the
logits by lm_head_multiplier (transformers' FalconH1 multiplies exactly these; the mup multipliers are not folded
into weights).

Every block keeps both a Mamba-2 state (the state slots) and KV pages. Eager mixed steps (layers/mamba2.py); tensor
parallelism as layers/mamba2.py says for the mixer and Llama's for the attention and MLP; FP8 and LoRA refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError
from atlas.kernels.fused_ops import act_and_mul
from atlas.layers.activation import gated_activation
from atlas.layers.attention import AttentionMetadata
from atlas.layers.embedding import LMHead
from atlas.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from atlas.layers.mamba2 import Mamba2Mixer
from atlas.layers.norm import RMSNorm
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import load_named_weights, make_layers, renamed_weights
from atlas.models.granite_hybrid import _time_step_limit
from atlas.models.hybrid import RecurrentHybridLM
from atlas.models.llama import LlamaAttention, LlamaVariant, _MultipliedEmbedding

_STACKED = [
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
]
_SCALARS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
            "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")


def _multipliers(cfg: ModelConfig) -> dict:
    raw, where = cfg.raw, cfg.path / "config.json"
    out = {}
    for key in _SCALARS:
        value = raw.get(key, 1.0)
        if value is None:
            value = 1.0
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ModelLoadError(f"malformed checkpoint: {where} field {key!r} must be a number, got {value!r}")
        out[key] = float(value)
    for key, count in (("mlp_multipliers", 2), ("ssm_multipliers", 5)):
        values = raw.get(key) or [1.0] * count
        if not isinstance(values, list) or len(values) != count or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ModelLoadError(f"malformed checkpoint: {where} field {key!r} must be {count} numbers, got "
                                 f"{values!r}")
        out[key] = [float(v) for v in values]
    return out


class FalconH1MLP(nn.Module):
    """gate | up (column-parallel), silu(gate * gate_multiplier) * up, down (row-parallel) * down_multiplier."""

    def __init__(self, cfg: ModelConfig, multipliers: list[float]):
        super().__init__()
        bias = bool(cfg.raw.get("mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, {0: cfg.intermediate_size,
                                                                         1: cfg.intermediate_size}, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act = gated_activation(cfg.raw.get("hidden_act", "silu"))
        self.gate_multiplier, self.down_multiplier = multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_multiplier != 1.0:
            gate, up = gate_up.chunk(2, dim=-1)
            gate_up = torch.cat([gate * self.gate_multiplier, up], dim=-1)
        out = self.down_proj(act_and_mul(gate_up, self.act))
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, m: dict):
        super().__init__()
        raw = cfg.raw
        heads = raw.get("mamba_n_heads", 128)
        width = raw.get("mamba_d_ssm") or raw.get("mamba_expand", 2) * cfg.hidden_size
        head_dim = raw.get("mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = width // heads
        if heads * head_dim != width:
            raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'}: mamba_n_heads x mamba_d_head "
                                 f"({heads} x {head_dim}) is not the Mamba-2 width {width}")
        norm = ("none" if not raw.get("mamba_rms_norm", False) else
                "before_gate" if raw.get("mamba_norm_before_gate", True) else "gated")
        self.mamba = Mamba2Mixer(
            cfg.hidden_size, heads, head_dim, raw.get("mamba_d_state", 256), raw.get("mamba_n_groups", 1),
            raw.get("mamba_d_conv", 4), cfg.rms_norm_eps, conv_bias=bool(raw.get("mamba_conv_bias", True)),
            proj_bias=bool(raw.get("mamba_proj_bias", False)), time_step_limit=_time_step_limit(cfg),
            chunk_size=raw.get("mamba_chunk_size", 256), act=raw.get("hidden_act", "silu"), norm=norm,
            in_scale=m["ssm_in_multiplier"], section_scales=tuple(m["ssm_multipliers"]))
        # (the mamba out_proj's bias is projectors_bias in transformers' FalconH1, mamba_proj_bias its in_proj's)
        if bool(raw.get("projectors_bias", False)) != bool(raw.get("mamba_proj_bias", False)):
            raise ModelLoadError(f"{cfg.path / 'config.json'}: projectors_bias and mamba_proj_bias differ; Atlas's "
                                 "Mamba-2 layer gives its two projections one bias setting")
        bias = bool(raw.get("attention_bias", False))
        variant = LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False,
                               sliding_windows=[None] * cfg.num_hidden_layers)
        self.self_attn = LlamaAttention(cfg, variant, layer_idx, rotary)
        self.self_attn.attn.scale = cfg.head_dim ** -0.5 * m["key_multiplier"]
        self.feed_forward = FalconH1MLP(cfg, m["mlp_multipliers"])
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_in, self.attn_out = m["attention_in_multiplier"], m["attention_out_multiplier"]
        self.ssm_out = m["ssm_out_multiplier"]

    @property
    def recurrent(self) -> Mamba2Mixer:
        return self.mamba

    @property
    def attention(self) -> LlamaAttention:
        return self.self_attn

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this block's MLP output, the residual stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        mixed = self.mamba(h, meta) * self.ssm_out + self.self_attn(positions, h * self.attn_in, kv_cache,
                                                                     meta) * self.attn_out
        h, residual = self.pre_ff_layernorm(mixed, residual)
        return self.feed_forward(h), residual


class FalconH1Model(nn.Module):
    def __init__(self, cfg: ModelConfig, m: dict, max_positions: int):
        super().__init__()
        self.embed_tokens = _MultipliedEmbedding(cfg.vocab_size, cfg.hidden_size, m["embedding_multiplier"])
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings)
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: FalconH1DecoderLayer(cfg, i, rotary, m))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class FalconH1ForCausalLM(RecurrentHybridLM):
    recurrent_state_in_mixed_graphs = False  # (layers/mamba2.py)
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def tensor_parallel_divisors(cls, cfg: ModelConfig) -> dict[str, int]:
        return {"Mamba-2 heads (mamba_n_heads)": cfg.raw.get("mamba_n_heads", 128)}

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        m = _multipliers(cfg)
        self.lm_head_multiplier = m["lm_head_multiplier"]
        self.model = FalconH1Model(cfg, m, max_positions)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    def final_norm(self) -> nn.Module:
        return self.model.final_layernorm

    # (no vocab_weight_names: the embedding is multiplied, so a drafter cannot share it as a plain lookup)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(hidden, out=out)
        return logits.mul_(self.lm_head_multiplier) if self.lm_head_multiplier != 1.0 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, renamed_weights(weights, tied_head=self.config.tie_word_embeddings), _STACKED,
                           skip_suffixes=("rotary_emb.inv_freq",), strict=True)
