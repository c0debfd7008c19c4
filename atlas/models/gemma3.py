"""Gemma 3 text models: Gemma3ForCausalLM (model_type gemma3_text), and Gemma 2 (Gemma2ForCausalLM) as Gemma 3's
layers without q / k norms (its class at the end).

What sets the family apart from Llama (facts from transformers' models/gemma3):
- the token embedding is scaled by sqrt(hidden_size), rounded to the model dtype first;
- every RMSNorm scales by (1 + weight) in float32 (layers.norm.ZeroCenteredRMSNorm), including the per-head q/k norms;
- a decoder layer norms both the attention output and the MLP output before its residual add (post-attention
  and post-feedforward norms) beside the usual pre-norms (input and pre-feedforward);
- a GELU-tanh gated MLP (`hidden_activation`);
- attention scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5;
- local (sliding-window) and global layers by `layer_types` (by default every sliding_window_pattern-th layer,
  6, is global), with their own RoPE: the local layers' theta is rope_local_base_freq (10000) with no scaling,
  the global layers' rope_theta (1e6) with rope_scaling (e.g. linear x 8);
- final_logit_softcapping: logits = cap * tanh(logits / cap) when set.

Refused, naming the field: attn_logit_softcapping (Gemma 3 sets it null, and transformers' Gemma 3 applies it with
eager attention only; Gemma 2's is served: its class at the end) and use_bidirectional_attention (an encoder use). Gemma3ForConditionalGeneration checkpoints (gemma-3-4b and
larger, image-text) serve their language model on text prompts, as transformers runs them without images; the
SigLIP vision tower and the projector are not loaded (a log line says so), so images cannot be given.

KV pages: the global layers read the whole context and keep every page; the local layers keep theirs in a pool of
their own (KV cache groups: engine/kv_groups.py; each local layer reads and writes through `meta.for_layer`), whose
pages below the window go back as the sequence advances: their memory is that of the window, not of the context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from atlas.config import ModelConfig, RopeConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.kernels.fused_ops import qk_norm_rope_kv_write
from atlas.layers.attention import AttentionMetadata, PagedAttention
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import QKVParallelLinear, RowParallelLinear
from atlas.layers.norm import ZeroCenteredRMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import language_model_weights, make_layers
from atlas.models.llama import LlamaForCausalLM, LlamaMLP

# transformers' Gemma3TextConfig defaults, for fields a config.json may leave out.
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_ROPE_THETA = 1_000_000.0
DEFAULT_ROPE_LOCAL_BASE_FREQ = 10_000.0
SLIDING, FULL = "sliding_attention", "full_attention"


def _where(cfg: ModelConfig) -> str:
    return str(cfg.path / "config.json")


def gemma3_layer_types(cfg: ModelConfig, default_pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN) -> list[str]:
    """`layer_types`, or (older configs) every sliding_window_pattern-th layer global, the others sliding (Gemma 2:
    every second)."""
    types = cfg.raw.get("layer_types")
    if types is None:
        pattern = cfg.raw.get("sliding_window_pattern") or default_pattern
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_hidden_layers)]
    if len(types) != cfg.num_hidden_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} layer_types must give {cfg.num_hidden_layers} "
                             f"entries of {SLIDING!r} or {FULL!r}, got {types!r}")
    return list(types)


def gemma3_windows(cfg: ModelConfig, default_pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN) -> list[int | None]:
    """Each layer's sliding window (None: a global layer)."""
    window = cfg.raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field 'sliding_window' must be a positive "
                             f"integer, got {window!r}")
    return [window if t == SLIDING else None for t in gemma3_layer_types(cfg, default_pattern)]


def positive_or_none(cfg: ModelConfig, key: str) -> float | None:
    """A soft-capping field: a positive number, or null."""
    cap = cfg.raw.get(key)
    if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0):
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field '{key}' must be a positive number or null, "
                             f"got {cap!r}")
    return None if cap is None else float(cap)


def gemma3_ropes(cfg: ModelConfig) -> dict[str, RopeConfig]:
    """RoPE of the local and global layers, from either config form: transformers >= 5's rope_parameters keyed by
    layer type, or rope_theta / rope_local_base_freq / rope_scaling (the scaling is the global layers')."""
    raw = cfg.raw
    params = raw.get("rope_parameters") or {}
    if params and not (SLIDING in params or FULL in params):
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} rope_parameters of a Gemma 3 model must be keyed "
                             f"by layer type ({SLIDING!r}, {FULL!r}), got {sorted(params)}")
    full = dict(params.get(FULL) or {})
    full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    local = dict(params.get(SLIDING) or {})
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", DEFAULT_ROPE_LOCAL_BASE_FREQ))
    out = {}
    for kind, p in ((FULL, full), (SLIDING, local)):
        rope_type = p.get("rope_type") or p.get("type") or "default"
        out[kind] = RopeConfig(theta=float(p["rope_theta"]), rope_type=rope_type, params=p)
    return out


def refuse_unsupported(cfg: ModelConfig) -> None:
    raw = cfg.raw
    if raw.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(
            f"attn_logit_softcapping = {raw['attn_logit_softcapping']} (in {_where(cfg)}) for Gemma 3: transformers' "
            "Gemma 3 soft-caps the attention scores with its eager attention and not with SDPA (its default), so "
            "which is meant is unclear (the released Gemma 3 checkpoints set it null; Gemma 2's cap is served)")
    if "vlm_config" in raw and raw.get("final_logit_softcapping") is not None:
        raise UnsupportedModelError(
            f"final_logit_softcapping = {raw['final_logit_softcapping']} in the text_config of an image-text "
            f"checkpoint ({_where(cfg)}): transformers' Gemma3ForConditionalGeneration does not soft-cap its logits "
            "where its Gemma3ForCausalLM does, so which is meant is unclear (the published Gemma 3 checkpoints set "
            "it null)")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"use_bidirectional_attention = true (in {_where(cfg)}): Atlas serves causal "
                                    "decoders only")


class Gemma3ScaledEmbedding(VocabEmbedding):
    """The token embedding times sqrt(hidden_size), that factor rounded to the weight's dtype (as transformers'
    Gemma3TextScaledWordEmbedding; in bf16, sqrt(3840) = 61.97 becomes 62.0)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.scale = hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(input_ids)
        return out * torch.tensor(self.scale, dtype=torch.float32).to(out.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, rotary: RotaryEmbedding, qk_norm: bool = True,
                 softcap: float | None = None):
        """qk_norm=False: no q / k norms (Gemma 2); softcap: the scores soft-capped (Gemma 2's
        attn_logit_softcapping)."""
        super().__init__()
        self.head_dim = cfg.head_dim
        bias = bool(cfg.raw.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        scalar = cfg.raw.get("query_pre_attn_scalar", DEFAULT_QUERY_PRE_ATTN_SCALAR)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=float(scalar) ** -0.5,
                                   sliding_window=window, softcap=softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.windowed is not None:  # (KV cache groups: a local layer reads and writes its group's pages)
            meta = meta.for_layer(self.attn.sliding_window)
        rows, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        # The (1 + weight) q/k norms here (float32 scaling, then one rounding), then RoPE and the cache write in the
        # fused prologue without its (Llama-rounding) norm.
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(rows, hq, d)).reshape(rows, hq * d)
            k = self.k_norm(k.reshape(rows, hkv, d)).reshape(rows, hkv * d)
        rotary = self.rotary
        q = qk_norm_rope_kv_write(torch.cat([q, k, v], dim=-1), positions, rotary.cos_cache, rotary.sin_cache, hq,
                                  hkv, d, None, None, 0.0, rotary.rotary_dim, rotary.is_neox_style, kv_cache,
                                  meta.slot_mapping)
        out = self.attn.attend(q, kv_cache, meta)
        return self.o_proj(out.view(-1, hq * d))


class Gemma3DecoderLayer(nn.Module):
    # (LlamaForCausalLM.forward's protocol: outputs are reduced, the stream after the layer is their sum)
    output_partial = False

    def __init__(self, cfg: ModelConfig, window: int | None, rotary: RotaryEmbedding, qk_norm: bool = True,
                 softcap: float | None = None):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, window, rotary, qk_norm, softcap)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        act = cfg.raw.get("hidden_activation") or cfg.raw.get("hidden_act") or "gelu_pytorch_tanh"
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, act, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata, x_partial: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's normed MLP output, the stream before it), the stream after the layer
        being their sum (the first layer: residual None, x the embedding)."""
        if residual is None:
            h, stream = self.input_layernorm(x), x
        else:
            h, stream = self.input_layernorm(x, residual)
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta))
        out = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream)))
        return out, stream


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, windows: list[int | None], max_positions: int,
                 ropes: dict[str, RopeConfig], qk_norm: bool = True, softcap: float | None = None):
        super().__init__()
        self.windows = list(windows)
        self.embed_tokens = Gemma3ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        # One table per distinct RoPE (buffers, not weights), each shared by the layers that use it.
        tables = {}
        for rope in ropes.values():
            if id(rope) not in tables:
                tables[id(rope)] = RotaryEmbedding(cfg.head_dim, rope, max_positions, cfg.max_position_embeddings)
        rotary = {kind: tables[id(rope)] for kind, rope in ropes.items()}
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: Gemma3DecoderLayer(
            cfg, windows[i], rotary[SLIDING if windows[i] is not None else FULL], qk_norm, softcap))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mp = current()


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's forward loop, weight routing and cache specs over Gemma 3's layers (module docstring)."""

    supports_pooling = False
    # --enable-lora: the same projections as Llama's (models/lora.py)
    lora_layers: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    supports_fp8_linear = False  # (FP8 checkpoints are dequantized as they load: not tested with Gemma's layers)

    def __init__(self, cfg: ModelConfig, max_positions: int):
        nn.Module.__init__(self)
        self.refuse_unsupported(cfg)
        # (Gemma3TextConfig ties the LM head to the embedding unless told otherwise)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=bool(cfg.raw.get("tie_word_embeddings", True)))
        self.config = cfg
        self.model = self.build_model(cfg, max_positions)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)
        self.final_logit_softcapping = positive_or_none(cfg, "final_logit_softcapping")

    @staticmethod
    def refuse_unsupported(cfg: ModelConfig) -> None:
        refuse_unsupported(cfg)

    def build_model(self, cfg: ModelConfig, max_positions: int) -> Gemma3Model:
        return Gemma3Model(cfg, gemma3_windows(cfg), max_positions, gemma3_ropes(cfg))

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """LM head logits, soft-capped in place (cap * tanh(logits / cap), in the model dtype, transformers' order)
        when the config sets final_logit_softcapping."""
        logits = self.lm_head(hidden, out=out)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def vocab_weight_names(self) -> tuple[str, str] | None:
        return None  # (the embedding is scaled and the logits may be capped: neither is the plain product)

    def adapter_module(self, name: str) -> str | None:
        """(An image-text model's adapter: its language model's modules under the text model's names; the vision
        tower's and projector's are not run.)"""
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, target in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                return target + name[len(prefix):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # (an image-text checkpoint's language model, in either layout transformers has saved)
        super().load_weights(language_model_weights(weights, _VISION_PREFIXES, self.config.path,
                                                    "the vision tower's and projector's", _LANGUAGE_MODEL_PREFIXES))


_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 (model_type gemma2): Gemma 3's layers without the q / k norms, one RoPE for every layer (rope_theta,
    rope_scaling), a window on every second layer by default, and the attention scores soft-capped by
    attn_logit_softcapping (50 in the released configs: in the Triton kernels and the reference alike) beside the
    final logits' final_logit_softcapping (30)."""

    @staticmethod
    def refuse_unsupported(cfg: ModelConfig) -> None:
        if cfg.raw.get("use_bidirectional_attention"):
            raise UnsupportedModelError(f"use_bidirectional_attention = true (in {_where(cfg)}): Atlas serves causal "
                                        "decoders only")

    def build_model(self, cfg: ModelConfig, max_positions: int) -> Gemma3Model:
        rope = cfg.rope
        return Gemma3Model(cfg, gemma3_windows(cfg, default_pattern=2), max_positions, {FULL: rope, SLIDING: rope},
                           qk_norm=False, softcap=positive_or_none(cfg, "attn_logit_softcapping"))
