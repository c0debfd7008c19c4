"""MiniMax-M2 (MiniMaxM2ForCausalLM: MiniMax-M2, M2.1). Model math only.

A sparse-MoE decoder of the Mixtral kind (models/sparse_moe.py; Mixtral's checkpoint names, `block_sparse_moe.
experts.{e}.w1|w2|w3`) with:
- q / k RMSNorms over the whole projected query and key (every head at once, as OLMo 2's, models/olmo2.py), in
  Llama's order (the normalized values cast to the model dtype, then the weight), before RoPE;
- RoPE on the first `rotary_dim` dims of each head (the released configs give rotary_dim, not
  partial_rotary_factor);
- sigmoid routing: the experts chosen by score + e_score_correction_bias (`block_sparse_moe.e_score_correction_bias`
  in the checkpoint), weighted by their unbiased scores renormalized to sum 1; the logits in the model dtype, as
  transformers computes them;
- no shared experts and no dense layers; the multi-token-prediction modules (num_mtp_modules, at layer indices
  num_hidden_layers ...) are not loaded.

Refused, naming the field: a scoring_func other than sigmoid, shared experts (shared_intermediate_size), linear-
attention layers (attn_type_list: MiniMax-Text-01's lightning attention). Under tensor parallelism the q / k norms sum
their squares over the ranks (one all-reduce of a value a row).
"""

from __future__ import annotations

import re
from dataclasses import replace

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.models.llama import LlamaVariant
from atlas.models.olmo2 import ProjectionNormDecoderLayer
from atlas.models.sparse_moe import MixtralForCausalLM, MoESettings, _fields, checked_router


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    """MiniMax-M2 (module docstring). LoRA adapters are refused (no test covers them on the whole-projection norms);
    FP8 checkpoints load as the other sparse-MoE families' (the released ones are block-scaled FP8)."""

    decoder_layer = ProjectionNormDecoderLayer
    lora_layers: tuple[str, ...] = ()
    _BIAS = re.compile(r"\.block_sparse_moe\.e_score_correction_bias$")

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        need, count = _fields(cfg)
        scoring = raw.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise UnsupportedModelError(f"{cfg.architecture}: scoring_func={scoring!r} in {where} is not supported "
                                        "(MiniMax-M2 routes by sigmoid scores)")
        if raw.get("shared_intermediate_size"):
            raise UnsupportedModelError(f"{cfg.architecture}: shared experts (shared_intermediate_size="
                                        f"{raw['shared_intermediate_size']} in {where}) are not supported")
        kinds = raw.get("attn_type_list")
        if kinds is not None and (not isinstance(kinds, list) or any(k != 1 for k in kinds)):
            raise UnsupportedModelError(f"{cfg.architecture}: attn_type_list in {where} marks layers other than full "
                                        "attention (1), such as MiniMax-Text-01's linear attention (0), which Atlas "
                                        "does not implement")
        rope = cfg.rope
        params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
        if "partial_rotary_factor" not in params and "partial_rotary_factor" not in raw and "rotary_dim" in raw:
            rope = replace(rope, partial_rotary_factor=count("rotary_dim", cfg.head_dim, 2) / cfg.head_dim)
        rotary_dim = int(cfg.head_dim * rope.partial_rotary_factor)
        if not 0 < rotary_dim <= cfg.head_dim or rotary_dim % 2:
            raise ModelLoadError(f"malformed checkpoint: {where} rotates {rotary_dim} dims of head_dim {cfg.head_dim} "
                                 "(must be even, 2 .. head_dim)")
        router = checked_router(where, need("num_local_experts"), need("num_experts_per_tok"), "sigmoid", "noaux_tc",
                                1, 1, True, 1.0, model_dtype_logits=True)
        return MoESettings(
            attention=LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                                   sliding_windows=[None] * cfg.num_hidden_layers),
            rope=rope, router=router, correction_bias=raw.get("use_routing_bias", True) is not False,
            moe_intermediate_size=cfg.intermediate_size, n_shared_experts=0,
            hidden_act=str(raw.get("hidden_act", "silu")), moe_layers=frozenset(range(cfg.num_hidden_layers)),
            num_mtp_layers=count("num_mtp_modules", 0))

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """Mixtral's names, and the correction bias beside the router's weight."""
        return super().checkpoint_name(cls._BIAS.sub(".mlp.gate.e_score_correction_bias", name))
