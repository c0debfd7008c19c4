"""HunYuan (Tencent): the dense models (Hunyuan 0.5B-7B, Hunyuan-MT; `HunYuanDenseV1ForCausalLM`, model_type
`hunyuan_v1_dense`) and the MoE one (Hunyuan-A13B; `HunYuanMoEV1ForCausalLM`, `hunyuan_v1_moe`).

Llama's layers with two differences in attention: per-head q / k RMSNorms (`query_layernorm`, `key_layernorm`)
applied *after* RoPE, so the fused prologue (which norms, then rotates) does not fit and the steps run one by one;
and RoPE with NTK-alpha scaling (`rope_scaling: {"type": "dynamic", "alpha": A}`), a fixed stretch of the base,
theta x A^(d / (d - 2)) for head dim d, as transformers reads it (not dynamic NTK, which depends on the length).
The MoE model's every layer is routed experts (softmax over the float32 router logits `gate.wg`, top-k,
renormalized) plus one always-on SwiGLU expert (`shared_mlp`).

Refused where transformers and vLLM read a config differently or Atlas has no path: cross-layer attention
(`use_cla`), `use_qk_norm: false` (transformers keeps the norms, vLLM drops them), an `attention_head_dim` other
than the head dim, per-layer expert counts or widths that differ, more than one shared expert, skipped MoE layers.
LoRA adapters are refused; FP8 checkpoints keep their linear layers in FP8 as Llama's do.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from atlas.config import ModelConfig, RopeConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.kernels.paged_attention_ref import write_kv_cache
from atlas.layers.attention import AttentionMetadata
from atlas.models.base import renamed_weights
from atlas.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, LlamaVariant
from atlas.models.sparse_moe import (
    MoESettings,
    SparseMoeForCausalLM,
    _fields,
    checked_router,
    split_fused_experts,
)


class HunYuanAttention(LlamaAttention):
    """Llama's attention with the per-head q / k norms after RoPE (q_norm / k_norm: the checkpoint's
    query_layernorm / key_layernorm)."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        rows, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = self.q_norm(self.rotary.rotate(positions, q.reshape(rows, self.num_heads, d)))
        k = self.k_norm(self.rotary.rotate(positions, k.reshape(rows, self.num_kv_heads, d)))
        write_kv_cache(kv_cache, k, v.reshape(rows, self.num_kv_heads, d), meta.slot_mapping)
        out = self.attn.attend(q, kv_cache, meta)
        return self.o_proj(out.view(rows, self.num_heads * d))


class HunYuanDecoderLayer(LlamaDecoderLayer):
    attention_class = HunYuanAttention


def hunyuan_rope(cfg: ModelConfig) -> RopeConfig:
    """The config's RoPE, NTK-alpha (type dynamic with an alpha) read as the fixed base it gives; dynamic NTK
    without an alpha stays as it is (refused where the rotary tables are built)."""
    rope = cfg.rope
    alpha = rope.params.get("alpha")
    if rope.rope_type != "dynamic" or alpha is None:
        return rope
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} rope alpha must be a positive number, "
                             f"got {alpha!r}")
    d = int(cfg.head_dim * rope.partial_rotary_factor)
    params = {k: v for k, v in rope.params.items() if k not in ("alpha", "factor", "type", "rope_type")}
    return RopeConfig(theta=rope.theta * float(alpha) ** (d / (d - 2)), rope_type="default", params=params,
                      partial_rotary_factor=rope.partial_rotary_factor)


def _check_attention(cfg: ModelConfig) -> LlamaVariant:
    raw, where = cfg.raw, cfg.path / "config.json"
    if raw.get("use_cla"):
        raise UnsupportedModelError(f"{cfg.architecture}: use_cla (cross-layer attention, layers sharing the keys and "
                                    f"values of the one before) in {where} is not supported")
    if raw.get("use_qk_norm", True) is not True:
        raise UnsupportedModelError(f"{cfg.architecture}: use_qk_norm={raw.get('use_qk_norm')!r} in {where}: "
                                    "transformers applies the q / k norms regardless and vLLM drops them, so which "
                                    "is meant is unclear; Atlas implements use_qk_norm true")
    head = raw.get("attention_head_dim")
    if head is not None and head != cfg.head_dim:
        raise UnsupportedModelError(f"{cfg.architecture}: attention_head_dim={head!r} in {where} differs from the head "
                                    f"dim {cfg.head_dim} (transformers reads head_dim, vLLM attention_head_dim)")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{cfg.architecture}: hidden_act {raw.get('hidden_act')!r} in {where}; HunYuan's "
                                    "MLP is SwiGLU (silu)")
    bias = bool(raw.get("attention_bias", False))
    return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=True,
                        sliding_windows=[None] * cfg.num_hidden_layers)


# checkpoint names -> the Llama model's
_RENAMES = ((".self_attn.query_layernorm.", ".self_attn.q_norm."), (".self_attn.key_layernorm.", ".self_attn.k_norm."))


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        return _check_attention(cfg)

    def decoder(self, cfg: ModelConfig, max_positions: int) -> LlamaModel:
        return LlamaModel(cfg, self.variant(cfg), max_positions, rope=hunyuan_rope(cfg), layer=HunYuanDecoderLayer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed_weights(weights, _RENAMES))


def _per_layer(cfg: ModelConfig, key: str, value: object) -> int:
    """A field that may be one integer or one a layer (HunYuan's moe_topk, num_experts, ...): the integer, which
    every layer must share."""
    values = value if isinstance(value, list) else [value]
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in values):
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} field {key!r} must be a positive "
                             f"integer or a list of them, got {value!r}")
    if len(set(values)) > 1:
        raise UnsupportedModelError(f"{cfg.architecture}: {key}={value!r} in {cfg.path / 'config.json'} differs "
                                    "between layers, which Atlas does not support")
    return values[0]


def hunyuan_moe_names(name: str, tensor: torch.Tensor, where: Path) -> Iterable[tuple[str, object]]:
    """A Hunyuan-A13B checkpoint tensor under the sparse-MoE model's names: the router `mlp.gate.wg` as `mlp.gate`,
    `mlp.shared_mlp` as `mlp.shared_experts`, fused experts (`mlp.experts.gate_up_proj` [E, 2I, H],
    `down_proj` [E, H, I], transformers 5's) split per expert."""
    for old, new in (*_RENAMES, (".mlp.gate.wg.", ".mlp.gate."), (".mlp.shared_mlp.", ".mlp.shared_experts.")):
        name = name.replace(old, new)
    yield from split_fused_experts(name, tensor, where)


class HunYuanMoEV1ForCausalLM(SparseMoeForCausalLM):
    lora_layers: tuple[str, ...] = ()
    decoder_layer = HunYuanDecoderLayer

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        _, count = _fields(cfg)
        experts = _per_layer(cfg, "num_experts", raw.get("num_experts", 1))
        top_k = _per_layer(cfg, "moe_topk", raw.get("moe_topk", 1))
        width = _per_layer(cfg, "moe_intermediate_size", raw.get("moe_intermediate_size") or cfg.intermediate_size)
        shared = _per_layer(cfg, "num_shared_expert", raw.get("num_shared_expert", 1))
        if width != cfg.intermediate_size or shared != 1:
            raise UnsupportedModelError(
                f"{cfg.architecture}: moe_intermediate_size={width} and num_shared_expert={shared} in {where}: "
                f"transformers builds every expert and the one shared expert intermediate_size="
                f"{cfg.intermediate_size} wide, vLLM reads these fields; Atlas loads the configs where they agree")
        if raw.get("use_mixed_mlp_moe", True) is not True or count("moe_layer_num_skipped", 0):
            raise UnsupportedModelError(f"{cfg.architecture}: use_mixed_mlp_moe={raw.get('use_mixed_mlp_moe')!r}, "
                                        f"moe_layer_num_skipped={raw.get('moe_layer_num_skipped')!r} in {where}: Atlas "
                                        "implements every layer as routed experts plus one shared expert")
        router = checked_router(where, experts, top_k, "softmax", "greedy", 1, 1, True, 1.0)
        return MoESettings(attention=_check_attention(cfg), rope=hunyuan_rope(cfg), router=router,
                           correction_bias=False, moe_intermediate_size=width, n_shared_experts=1, hidden_act="silu",
                           moe_layers=frozenset(range(cfg.num_hidden_layers)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        where = self.config.path

        def renamed() -> Iterable[tuple[str, object]]:
            for name, tensor in weights:
                yield from hunyuan_moe_names(name, tensor, where)

        super().load_weights(renamed())
