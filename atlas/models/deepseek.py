"""The DeepSeek family: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM and DeepseekV32ForCausalLM. Model math only.

Pre-norm decoder blocks with multi-head latent attention (layers/mla.py: a paged cache of one latent row
per token, absorbed attention) and, from layer `first_k_dense_replace` on (every `moe_layer_freq`-th
layer), a mixture of experts (layers/moe.py) with shared experts; the first layers have a dense SwiGLU
MLP. V3 routes with sigmoid scores, a correction bias for choosing and grouped top-k (noaux_tc); V2
with softmax scores (greedy or group_limited_greedy). V3 checkpoints may carry multi-token-prediction
modules at layer index num_hidden_layers (`DeepseekMTP`, run by speculative/mtp.py). V3.2 (model_type
deepseek_v32) is V3 with DeepSeek sparse attention in every layer (layers/dsa.py: a lightning indexer whose
top-k rows per query are all the MLA attends over); its MTP module is a DSA block with its own indexer.
GLM-5 (GlmMoeDsaForCausalLM, model_type glm_moe_dsa) is V3.2 with settings, as transformers' glm_moe_dsa
computes it: an interleaved indexer RoPE; a layer pattern (indexer_types) of "full" layers that index and
"shared" layers that reuse the last full layer's top-k; the dense/sparse MLP per layer (mlp_layer_types, by
default first_k_dense_replace dense layers); the MLA always interleaved; the q_a / kv_a latent norms at eps
1e-6 (as every family's); routing always sigmoid + correction bias, group-limited (noaux_tc). GLM-4.7-Flash
(Glm4MoeLiteForCausalLM, glm4_moe_lite) is V3 with GLM's defaults and mlp_layer_types.
Spec: ../shared/specs/mla-mtp-dsa-longcat.md sections 1-4.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from atlas.config import ModelConfig, RopeConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.attention import AttentionMetadata
from atlas.layers.dsa import DSAAttention, DSAConfig, TopkShare
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import Linear
from atlas.layers.mla import MLAAttention, MLACacheSpec, MLAConfig, mla_softmax_scale
from atlas.layers.moe import SCORING_FUNCS, TOPK_METHODS, RouterConfig
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import CausalLM, MTPModule, make_layers, renamed_weights
from atlas.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from atlas.models.quantization import refuse_quantized
from atlas.models.sparse_moe import (
    SparseMoE,
    SparseMoeForCausalLM,
    checked_router,
    experts_keep_fp8,
    load_moe_weights,
)

logger = logging.getLogger(__name__)

# The q_a / kv_a latent norms take the norm's default eps whatever rms_norm_eps says: DeepSeek's reference RMSNorm(
# q_lora_rank) and every transformers MLA family's (DeepseekV2/V3/V32, GlmMoeDsa, Glm4MoeLite, LongcatFlash) build
# them so. (vLLM passes rms_norm_eps; the released DeepSeek and Kimi configs say 1e-6, where the two agree, and
# Moonlight's and GLM's say 1e-5, where only this reading is the reference's.)
LATENT_NORM_EPS = 1e-6

_STACKED_MLP = [("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]
# With q_lora, q_a_proj and kv_a_proj_with_mqa are one fused projection; without it (and without attention biases),
# q_proj and kv_a_proj_with_mqa are (layers/mla.py).
_STACKED_Q_LORA = [("q_a_proj", "fused_qkv_a_proj", "q"), ("kv_a_proj_with_mqa", "fused_qkv_a_proj", "kv")]
_STACKED_Q_KV_A = [("q_proj", "fused_q_kv_a_proj", "q"), ("kv_a_proj_with_mqa", "fused_q_kv_a_proj", "kv")]


def stacked_attention(mla: MLAConfig) -> list[tuple[str, str, str]]:
    """The checkpoint's MLA projections that load into one fused parameter (MLAAttention's layout for `mla`)."""
    if mla.q_lora_rank:
        return _STACKED_Q_LORA
    return [] if mla.attention_bias else _STACKED_Q_KV_A


@dataclass(frozen=True)
class DeepseekSettings:
    """The family's config.json fields, checked and typed."""

    mla: MLAConfig
    rope: RopeConfig
    router: RouterConfig
    correction_bias: bool
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    hidden_act: str
    num_nextn_predict_layers: int
    dsa: DSAConfig | None = None  # DeepSeek sparse attention (V3.2: every layer indexes)
    indexer_types: tuple[str, ...] | None = None  # GLM-5: per layer "full" (indexes) or "shared" (reuses)
    moe_layers: tuple[bool, ...] | None = None  # V3.2 / GLM-5 / GLM-4.7-Flash: mlp_layer_types ("sparse": True)

    def is_moe(self, layer_idx: int) -> bool:
        if self.moe_layers is not None:
            # (an MTP block, past the listed layers, is sparse: GLM-5's, as DeepSeek-V3's)
            return self.moe_layers[layer_idx] if layer_idx < len(self.moe_layers) else True
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0


def _refuse_unsupported(cfg: ModelConfig, dsa: bool) -> None:
    raw, where = cfg.raw, cfg.path / "config.json"
    refuse_quantized(raw, cfg.path, f"{cfg.architecture} checkpoint", dequantizes=True)  # (as build_model does)
    if not dsa and any(raw.get(k) is not None for k in ("index_topk", "index_n_heads", "index_head_dim")):
        raise UnsupportedModelError(
            f"{cfg.path} is a {cfg.architecture} checkpoint with DeepSeek sparse attention fields (index_topk / "
            f"index_n_heads in {where}): Atlas serves DSA as DeepSeek-V3.2 (architectures DeepseekV32ForCausalLM, "
            "model_type deepseek_v32), not under this architecture")
    if raw.get("mlp_bias"):  # (DeepSeek-V2's MLPs take biases by it in transformers; the released models have none)
        raise UnsupportedModelError(f"{where}: mlp_bias (biases on the MLP and expert projections) is not supported "
                                    f"for {cfg.architecture}")


def _refuse_glm(cfg: ModelConfig) -> None:
    """GLM-5 fields whose other values transformers' glm_moe_dsa does not honour (it hard-codes them): a
    checkpoint asking for another value is one Atlas cannot check against it, so it is refused by name."""
    raw, where = cfg.raw, cfg.path / "config.json"
    fixed = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "rope_interleave": (True,),
             "indexer_rope_interleave": (True,), "partial_rotary_factor": (1, 1.0)}
    for key, allowed in fixed.items():
        if raw.get(key) is not None and raw[key] not in allowed:
            raise UnsupportedModelError(f"{where}: GLM-5 (glm_moe_dsa) with {key}={raw[key]!r} is not supported (the "
                                        f"reference computes {allowed[0]!r} only)")


def glm_indexer_types(raw: dict, num_layers: int, where) -> tuple[str, ...]:
    """GLM-5's layer pattern, as transformers' GlmMoeDsaConfig derives it: indexer_types, else
    index_topk_pattern ("F"/"S" per layer, or a list), else layer i is "full" iff max(i - offset + 1, 0) % freq
    == 0 (index_topk_freq, default 1: every layer; index_skip_topk_offset, default 2)."""
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        try:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        except KeyError as e:
            raise ModelLoadError(f"malformed checkpoint: {where} index_topk_pattern {pattern!r} has {e} (F or S)") from e
    if types is None:
        freq = max(int(raw.get("index_topk_freq") or 1), 1)
        offset = int(raw.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    types = tuple(types)
    if len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        raise ModelLoadError(f"malformed checkpoint: {where} indexer types {list(types)} must be 'full' or 'shared' "
                             f"for each of the {num_layers} layers")
    if types and types[0] != "full":
        raise ModelLoadError(f"malformed checkpoint: {where} layer 0 is a 'shared' DSA layer (no earlier layer "
                             "selects its top-k)")
    return types


def glm_moe_layers(raw: dict, num_layers: int, where) -> tuple[bool, ...]:
    """mlp_layer_types ("dense" / "sparse" per layer), else min(first_k_dense_replace, layers) dense layers
    then sparse ones (transformers' GlmMoeDsaConfig; its default first_k_dense_replace is 3)."""
    types = raw.get("mlp_layer_types")
    if types is None:
        k = raw.get("first_k_dense_replace")
        n_dense = min(3 if k is None else int(k), num_layers)
        types = ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense)
    if len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
        raise ModelLoadError(f"malformed checkpoint: {where} mlp_layer_types {types} must be 'dense' or 'sparse' "
                             f"for each of the {num_layers} layers")
    return tuple(t == "sparse" for t in types)


def _lite_moe_layers(raw: dict, num_layers: int, where) -> tuple[bool, ...]:
    """GLM-4.7-Flash's dense / sparse MLP per layer as transformers' Glm4MoeLiteConfig reads it: mlp_layer_types,
    else the first layer dense and the rest sparse (first_k_dense_replace is not read there; a config whose
    first_k_dense_replace says otherwise without mlp_layer_types reads two ways, and is refused)."""
    k = raw.get("first_k_dense_replace")
    if raw.get("mlp_layer_types") is None and k not in (None, 1):
        raise UnsupportedModelError(f"{where}: first_k_dense_replace={k!r} without mlp_layer_types: transformers' "
                                    "glm4_moe_lite makes only the first layer dense whatever it says; give "
                                    "mlp_layer_types to say which layers are")
    return glm_moe_layers({**raw, "first_k_dense_replace": 1}, num_layers, where)


def deepseek_settings(cfg: ModelConfig, v3: bool, dsa: bool = False, glm: bool = False,
                      lite: bool = False) -> DeepseekSettings:
    """lite: GLM-4.7-Flash (glm4_moe_lite: V3's MLA and routing with GLM's defaults and mlp_layer_types)."""
    _refuse_unsupported(cfg, dsa)
    if glm:
        _refuse_glm(cfg)
    raw, where = cfg.raw, cfg.path / "config.json"
    layer_types = raw.get("layer_types")
    if dsa and layer_types is not None and any(t != "indexed_attention" for t in layer_types):
        raise UnsupportedModelError(f"{where}: DSA layer_types other than 'indexed_attention' are not supported "
                                    f"({sorted(set(layer_types))})")
    if lite and cfg.rope.partial_rotary_factor != 1.0:
        raise UnsupportedModelError(f"{where}: GLM-4.7-Flash (glm4_moe_lite) with partial_rotary_factor="
                                    f"{cfg.rope.partial_rotary_factor} is not supported (the MLA rotates all "
                                    "qk_rope_head_dim dims)")

    def need(key: str) -> int:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"malformed checkpoint: {where} field '{key}' must be a positive integer, got "
                                 f"{value!r}")
        return value

    rope = cfg.rope
    if rope.rope_type == "deepseek_yarn":  # vLLM's name for the same YaRN
        rope = RopeConfig(rope.theta, "yarn", rope.params, rope.partial_rotary_factor)
    q_lora = raw.get("q_lora_rank")
    mla = MLAConfig(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                    q_lora_rank=need("q_lora_rank") if q_lora is not None else None,
                    kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
                    qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
                    rms_norm_eps=LATENT_NORM_EPS,
                    attention_bias=bool(raw.get("attention_bias", False)),
                    rope_interleave=True if glm else bool(raw.get("rope_interleave", True)))
    if mla.qk_rope_head_dim % 2:
        raise ModelLoadError(f"malformed checkpoint: qk_rope_head_dim {mla.qk_rope_head_dim} in {where} is odd")
    num_experts = need("n_routed_experts")
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if scoring not in SCORING_FUNCS or method not in TOPK_METHODS:
        raise UnsupportedModelError(f"{where}: MoE routing scoring_func={scoring!r}, topk_method={method!r} is not "
                                    f"supported (scoring: {', '.join(SCORING_FUNCS)}; top-k: {', '.join(TOPK_METHODS)})")
    n_group = raw.get("n_group") or 1
    # (defaults where the field is absent: each reference config class's)
    router = checked_router(where, num_experts, need("num_experts_per_tok"), scoring, method, n_group,
                            raw.get("topk_group") or n_group, bool(raw.get("norm_topk_prob", v3)),
                            float(raw.get("routed_scaling_factor", 2.5 if glm else 1.8 if lite else 1.0)))
    # (V3.2 and GLM-5 as transformers reads them: mlp_layer_types, else first_k_dense_replace (default 3) dense
    #  layers; moe_layer_freq is not read there)
    moe_layers = (glm_moe_layers(raw, cfg.num_hidden_layers, where) if glm or dsa else
                  _lite_moe_layers(raw, cfg.num_hidden_layers, where) if lite else None)
    return DeepseekSettings(
        mla=mla, rope=rope, router=router, correction_bias=method == "noaux_tc",
        moe_intermediate_size=need("moe_intermediate_size"),
        n_shared_experts=int(raw.get("n_shared_experts", 1 if glm or lite else 0) or 0),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(raw.get("moe_layer_freq") or 1), hidden_act=str(raw.get("hidden_act", "silu")),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        dsa=_dsa_config(cfg, mla, need, glm) if dsa else None,
        indexer_types=glm_indexer_types(raw, cfg.num_hidden_layers, where) if glm else None,
        moe_layers=moe_layers)


def _dsa_config(cfg: ModelConfig, mla: MLAConfig, need: Callable[[str], int], glm: bool = False) -> DSAConfig:
    where = cfg.path / "config.json"
    def get(key: str, default: int) -> int:  # (defaults: transformers' DeepseekV32Config / GlmMoeDsaConfig)
        return need(key) if cfg.raw.get(key) is not None else default

    dsa = DSAConfig(index_topk=get("index_topk", 2048), index_n_heads=get("index_n_heads", 32 if glm else 64),
                    index_head_dim=get("index_head_dim", 128), rope_interleave=glm)
    if not mla.q_lora_rank:
        raise ModelLoadError(f"malformed checkpoint: {where} has DeepSeek sparse attention without q_lora_rank (the "
                             "indexer's query reads the q_a_layernorm output)")
    if mla.qk_rope_head_dim > dsa.index_head_dim:
        raise ModelLoadError(f"malformed checkpoint: {where} has qk_rope_head_dim {mla.qk_rope_head_dim} > "
                             f"index_head_dim {dsa.index_head_dim} (the indexer ropes its first qk_rope_head_dim dims)")
    return dsa


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, s: DeepseekSettings, layer_idx: int, rotary: RotaryEmbedding, scale: float,
                 defer_reductions: bool = False, index_rotary: RotaryEmbedding | None = None,
                 share: TopkShare | None = None):
        """defer_reductions: under tensor parallelism, hand the attention's and the MLP's partial sums to
        the norms that follow (LlamaDecoderLayer.forward and LlamaForCausalLM.forward, which this model
        shares, all-reduce them there, fused with the add and norm where they can)."""
        super().__init__()
        mp = current()
        defer = defer_reductions and mp.tp_size > 1
        defer_attn = defer and not s.mla.attention_bias
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # (an MTP block, past the listed layers, has its own full indexer)
        shared = (s.indexer_types is not None and layer_idx < len(s.indexer_types)
                  and s.indexer_types[layer_idx] == "shared")
        self.self_attn = (DSAAttention(s.mla, s.dsa, rotary, index_rotary, scale, reduce=not defer_attn,
                                       shared=shared, share=share)
                          if s.dsa is not None else MLAAttention(s.mla, rotary, scale, reduce=not defer_attn))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (SparseMoE(cfg.hidden_size, s.router, s.correction_bias, s.moe_intermediate_size, s.n_shared_experts,
                              s.hidden_act, reduce=not defer) if s.is_moe(layer_idx)
                    else LlamaMLP(cfg.hidden_size, cfg.intermediate_size, s.hidden_act, bias=False, reduce=not defer))
        self.mp, self.attn_reduce, self.output_partial = mp, mp if defer_attn else None, defer
        # (LlamaDecoderLayer.forward's norm consumers: MLA's first projection is q_a | kv_a in one with q_lora, q | kv_a
        #  without it (none where kv_a has a bias: they read the input apart); DSA's indexer reads it too)
        plain_mla = isinstance(self.self_attn, MLAAttention) and not isinstance(self.self_attn, DSAAttention)
        self.attn_input = getattr(self.self_attn, "fused_qkv_a_proj" if s.mla.q_lora_rank else "fused_q_kv_a_proj",
                                  None) if plain_mla else None
        self.mlp_input = self.mlp.gate_up_proj if isinstance(self.mlp, LlamaMLP) else None

    # (x, residual) -> (this layer's MLP output, the residual stream before it)
    forward = LlamaDecoderLayer.forward


def _rotary(s: DeepseekSettings, max_positions: int, max_position_embeddings: int) -> RotaryEmbedding:
    # Interleaved (adjacent pairs) as the checkpoints store the rope dims; HF's rope_interleave=False
    # switch means rotate-half.
    return RotaryEmbedding(s.mla.qk_rope_head_dim, s.rope, max_positions, max_position_embeddings,
                           is_neox_style=not s.mla.rope_interleave)


def _index_rotary(s: DeepseekSettings, max_positions: int, max_position_embeddings: int) -> RotaryEmbedding | None:
    """The DSA indexer's RoPE: the same tables, rotate-half for V3.2 (transformers' DeepseekV32Indexer),
    interleaved pairs for GLM-5 (GlmMoeDsaIndexer's apply_rotary_pos_emb_interleave)."""
    if s.dsa is None:
        return None
    return RotaryEmbedding(s.mla.qk_rope_head_dim, s.rope, max_positions, max_position_embeddings,
                           is_neox_style=not s.dsa.rope_interleave)


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def _check_tensor(name: str, where, dsa: bool = False) -> None:
    """Refuse checkpoint tensors of features Atlas does not implement, naming the feature. (Quantizers' tensors are
    refused where they load, models/base.load_named_weights: an FP8 layer's scales are its own.)"""
    if ".indexer." in name and not dsa:
        raise UnsupportedModelError(f"{where} holds DeepSeek sparse attention indexer weights ({name}): DSA is "
                                    "served only as DeepSeek-V3.2 (architectures DeepseekV32ForCausalLM)")


def _load(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], where, mla: MLAConfig,
          dsa: bool = False) -> None:
    """Strict loading with the family's names: unknown tensors are refused, not ignored."""
    def checked() -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            _check_tensor(name, where, dsa)
            yield name, tensor

    load_moe_weights(module, checked(), where, _STACKED_MLP + stacked_attention(mla))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, s: DeepseekSettings, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = _rotary(s, max_positions, cfg.max_position_embeddings)
        index_rotary = _index_rotary(s, max_positions, cfg.max_position_embeddings)
        scale = mla_softmax_scale(s.mla, s.rope)
        # GLM-5's shared DSA layers read the selection of the last full layer before them, in this stage.
        share = TopkShare() if s.indexer_types is not None and "shared" in s.indexer_types else None
        self.layers = make_layers(cfg.num_hidden_layers,
                                  lambda i: DeepseekDecoderLayer(cfg, s, i, rotary, scale, defer_reductions=True,
                                                                 index_rotary=index_rotary, share=share))
        if share is not None:
            kinds = [s.indexer_types[self.layers.first + i] for i in range(len(self.layers))]
            for i, layer in enumerate(self.layers):
                nxt = kinds[i + 1] if i + 1 < len(kinds) else None
                layer.self_attn.records = kinds[i] == "full" and nxt == "shared"
                layer.self_attn.releases = kinds[i] == "shared" and nxt != "shared"
        if share is not None and len(self.layers) and s.indexer_types[self.layers.first] == "shared":
            raise UnsupportedModelError(
                f"{cfg.path}: this pipeline stage starts at layer {self.layers.first}, a 'shared' DSA layer that reuses "
                "the top-k of a layer on the stage before it; handing selections between stages is not implemented "
                "(use fewer pipeline stages, or stage boundaries at 'full' layers)")
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mp = current()


class DeepseekV2ForCausalLM(CausalLM):
    V3 = False
    DSA = False
    # FP8 checkpoints (DeepSeek-V3's own layout) keep the attention projections, the dense and shared-expert MLPs and
    # the routed experts in FP8 (layers/linear.py, layers/moe.py); kv_b_proj (which attention absorbs) and the router
    # are dequantized as they load (keeps_fp8).
    supports_fp8_linear = True
    GLM = False
    LITE = False

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.settings = deepseek_settings(cfg, self.V3, self.DSA, self.GLM, self.LITE)
        self.model = DeepseekModel(cfg, self.settings, max_positions)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_specs(self) -> list[MLACacheSpec]:
        return [layer.self_attn.cache_spec() for layer in self.model.layers]

    # The same embedding, decoder loop (capture id i = the residual stream after layer i), final norm
    # and LM head as the Llama family.
    embed = LlamaForCausalLM.embed
    forward = LlamaForCausalLM.forward
    compute_logits = LlamaForCausalLM.compute_logits
    vocab_weight_names = LlamaForCausalLM.vocab_weight_names

    def keeps_fp8(self, name: str) -> bool:
        """The main model's FP8 linear layers and its routed experts (where FusedExperts keeps them in FP8: dynamic
        activation scales, blocks that this rank's slices do not cut) load as they are; its router (where a
        checkpoint quantized it) and kv_b_proj are dequantized.
        (The MTP module's tensors pass untouched: the model skips them, and --speculative mtp dequantizes its own.)"""
        if self._mtp_tensor(name):
            return True
        if ".mlp.experts." in name:
            return experts_keep_fp8(self)
        return ".mlp.gate." not in name and ".kv_b_proj." not in name

    def _mtp_tensor(self, name: str) -> bool:
        m = _LAYER_NAME.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        n = self.config.num_hidden_layers
        layer = _LAYER_NAME

        skipped = 0

        def main_model() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in renamed_weights(weights, tied_head=self.config.tie_word_embeddings):
                m = layer.match(name)
                # Multi-token-prediction modules (layers n .. n + num_nextn_predict_layers - 1) are known and
                # loaded by build_mtp for --speculative mtp; layers past them are not known (refused).
                if m is not None and n <= int(m.group(1)) < n + self.settings.num_nextn_predict_layers:
                    _check_tensor(name, self.config.path, self.DSA)
                    skipped += 1
                    continue
                yield name, tensor

        _load(self, main_model(), self.config.path, self.settings.mla, self.DSA)
        if skipped:
            logger.info("%s: the %d tensors of its MTP module (layer %d) are loaded only as the drafter of "
                        "--speculative mtp", self.config.path, skipped, n)

    # (graphs as the other MoE families: where the experts take the grouped GEMM)
    cuda_graph_blocker = SparseMoeForCausalLM.cuda_graph_blocker
    supports_cuda_graphs = SparseMoeForCausalLM.supports_cuda_graphs

    # ------------------------------------------------------------------ multi-token prediction
    @property
    def num_mtp_modules(self) -> int:
        return self.settings.num_nextn_predict_layers

    def build_mtp(self, max_positions: int, embedding: VocabEmbedding | None = None,
                  lm_head: LMHead | None = None) -> DeepseekMTP:
        """The first MTP module (layer index num_hidden_layers), without weights: load them with its
        load_weights from the checkpoint tensors named `weight_prefix`... It takes the view it is built in
        (whole outside building_with). `embedding`: a whole copy of the target's embedding to share in
        place of the model's (a tensor-parallel driver's, whose own is a vocabulary shard). `lm_head` is not
        used: the module has its own (shared_head.head)."""
        return DeepseekMTP(self.config, self.settings, max_positions, self.model.norm,
                           embedding if embedding is not None else self.model.embed_tokens)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    V3 = True


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's MLA (interleaved RoPE unless rope_interleave is false) and
    sigmoid routing with a correction bias, GLM's defaults (routed_scaling_factor 1.8, one shared expert) and its
    dense / sparse MLP per layer (mlp_layer_types); the MTP layer, as V3's, drafts under --speculative mtp.
    Exact against transformers' Glm4MoeLiteForCausalLM."""

    LITE = True


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with DeepSeek sparse attention in every layer. On CUDA its attention runs Triton
    kernels from the step's device tensors, and sizes the indexer's scores and selections by a bound on the step's
    longest context: CUDA graphs are captured per bound (graph_context_buckets)."""

    DSA = True
    NAME = "DeepSeek-V3.2"
    supports_fp8_linear = False  # (the indexer's projections are not checked in FP8: dequantized as they load)

    def graph_context_buckets(self, max_seq_len: int) -> list[int]:
        """index_topk (up to which every visible key is selected and nothing is scored), then doublings up to
        max_seq_len: a step's scores and top-k run over at most twice its longest context."""
        bounds = [min(self.settings.dsa.index_topk, max_seq_len)]
        while bounds[-1] < max_seq_len:
            bounds.append(min(2 * bounds[-1], max_seq_len))
        return bounds


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5 (glm_moe_dsa): DeepSeek-V3.2 with GLM-5's settings (module docstring); exact against transformers'
    GlmMoeDsaForCausalLM."""

    GLM = True
    NAME = "GLM-5"


class DeepseekMTP(MTPModule):
    """One multi-token-prediction module (spec 3.1-3.2): for row i, the target's final hidden state h_i
    and the token t_{i+1} that follows -> u_i = block(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])) at
    position i, whose logits shared_head.head(shared_head.norm(u_i)) predict t_{i+2}. Chained drafting
    feeds u_i back as the next row's hidden state. The block has its own MLA layer and latent cache.

    Captured target rows are pre-norm residual streams; `target_hidden` applies the target's final norm
    (the MTP reads the normed hidden state). The checkpoint's copy of the embedding is used only if it
    differs from the target's (V3 shares them); its head is its own."""

    def __init__(self, cfg: ModelConfig, s: DeepseekSettings, max_positions: int, final_norm: RMSNorm,
                 target_embed: VocabEmbedding):
        super().__init__()
        self.config = cfg
        self.settings = s
        self.layer_idx = cfg.num_hidden_layers
        self.weight_prefix = f"model.layers.{self.layer_idx}."
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d)
        rotary = _rotary(s, max_positions, cfg.max_position_embeddings)
        # (V3.2 / GLM-5: a DSA block, with its own indexer and indexer cache)
        self.block = DeepseekDecoderLayer(cfg, s, self.layer_idx, rotary, mla_softmax_scale(s.mla, s.rope),
                                          index_rotary=_index_rotary(s, max_positions, cfg.max_position_embeddings))
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.shared_head.head = LMHead(cfg.vocab_size, d)
        self.share_target(final_norm, target_embed)

    def kv_cache_specs(self) -> list[MLACacheSpec]:
        return [self.block.self_attn.cache_spec()]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Tokens t_{i+1} [T], hidden states h_i [T, D] (target-normed, or a previous u) at positions i ->
        u [T, D] (before shared_head.norm)."""
        e = self.enorm(self.embed(input_ids))
        g = self.hnorm(hidden.to(e.dtype))
        x, residual = self.block(positions, self.eh_proj(torch.cat([e, g], dim=-1)), None, kv_caches[0], meta)
        return x + residual

    @property
    def draft_head(self) -> nn.Module:
        return self.shared_head.head

    def head_input(self, u: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(u)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors under weight_prefix (the module's own names after it)."""
        prefix = self.weight_prefix
        own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(prefix):
                    continue
                rest = name[len(prefix):]
                if rest == "embed_tokens.weight":
                    self._adopt_embedding(tensor)
                    continue
                yield (rest if rest.startswith(own) else f"block.{rest}"), tensor

        _load(self, renamed(), self.config.path, self.settings.mla, self.settings.dsa is not None)
        self._finish_adoption()
