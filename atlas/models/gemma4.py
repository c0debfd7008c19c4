"""Gemma 4 text models: Gemma4ForCausalLM (model_type gemma4_text) and the language model of the published
Gemma4ForConditionalGeneration checkpoints, served on text.

What Gemma 4 adds over Gemma 3 (facts from transformers' models/gemma4):
- norms scale by the weight itself (x * w, w initialised to 1; not Gemma 3's 1 + w), x * (mean(x^2) + eps) ** -0.5
  in float32, rounded once; the value norm (v_norm) and the router's norm have no weight;
- attention scale 1.0 (the q/k norms carry the scale); keys, values and queries are normed per head, then RoPE on
  q and k;
- local (sliding) and global layers by `layer_types` (default: every 6th global; the last layer is always global),
  window `sliding_window` (512). Global layers have their own head size (`global_head_dim`, 512) and, with
  `attention_k_eq_v`, `num_global_key_value_heads` KV heads and no v_proj: the value is the key projection's output
  (before k_norm), normed by v_norm;
- RoPE by layer type: "default" (full head) for local layers, "proportional" for global ones: the first
  partial_rotary_factor * head_dim / 2 frequencies are 1 / theta^(2i / head_dim), the others 0 (unrotated), over
  rotate_half of the whole head;
- KV sharing: the last `num_kv_shared_layers` layers compute no K/V: each attends over the cache of the last
  earlier layer of its type (here: that layer's cache; a shared layer keeps none). With `use_double_wide_mlp` their
  MLP is twice as wide;
- per-layer embeddings (hidden_size_per_layer_input P > 0): a [vocab, L * P] table scaled by sqrt(P), plus a
  projection of the scaled embedding (times hidden_size^-0.5, normed over P), summed and times 2^-0.5; each layer
  ends with x + norm(proj(act(gate(x)) * ple_i));
- each layer's output is multiplied by its `layer_scalar` (a checkpoint tensor);
- MoE layers (enable_moe_block): the dense MLP and the experts side by side, each with its own norms; the router
  norms the stream (no weight), scales by `scale` * hidden_size^-0.5, softmax top-k renormalised, times
  `per_expert_scale` of each chosen expert; experts gelu-tanh gated, stored stacked ([E, 2I, H] gate|up halves);
- final_logit_softcapping as Gemma 3. The text model has no attention soft-capping and no clippable linears (those
  are the vision and audio towers').

Refused by name: use_bidirectional_attention "all" (not causal), RoPE types other than default / linear /
proportional, every layer KV-shared, pipeline parallelism. Image, video and audio inputs are not
served (their towers' weights are skipped with a log line); as transformers does without media, their placeholder
token ids embed as the pad token.

Tensor parallelism: each rank holds its query heads and KV heads (a KV head replicated where there are fewer than
ranks, as QKVParallelLinear does; a KV-shared layer reads its source layer's heads of this rank), its slice of the
MLP and of every expert (the MoE partial sum all-reduced before its norm); the router, the per-layer embedding
projections and gates are replicated, the per-layer table split by vocabulary like the token embedding.

KV pages: the global layers read the whole context and keep every page; the local layers keep theirs in a pool of
their own, released below the window (KV cache groups, as Gemma 3's: engine/kv_groups.py). The groups go by window,
not by cache shape: the global layers' head size may differ from the local ones'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from atlas.config import ModelConfig, RopeConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.kernels.paged_attention import MAX_TRITON_HEAD_DIM
from atlas.kernels.paged_attention_ref import write_kv_cache
from atlas.layers.attention import AttentionMetadata, KVCacheSpec, PagedAttention
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import Linear, MergedLinear, RowParallelLinear
from atlas.layers.moe import FusedExperts, RouterConfig, select_experts
from atlas.layers.norm import Float32ScaledRMSNorm
from atlas.layers.parallel import ModelParallel, current
from atlas.layers.rotary import RotaryEmbedding, rope_inv_freq
from atlas.models.base import (
    CausalLM,
    language_model_weights,
    load_named_weights,
    make_layers,
    renamed_weights,
)
from atlas.models.gemma3 import Gemma3ForCausalLM
from atlas.models.llama import LlamaMLP

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma4TextConfig defaults, for fields a config.json may leave out.
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_PLE_SIZE = 256
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
ROPE_TYPES = ("default", "linear", "proportional")
# The per-layer input gate's activation (an ungated one), by its transformers name.
_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}
# Prefixes of the multimodal towers of Gemma4ForConditionalGeneration checkpoints (not served).
_MEDIA_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def _where(cfg: ModelConfig) -> str:
    return str(cfg.path / "config.json")


def _positive_int(cfg: ModelConfig, key: str, default: int | None) -> int:
    value = cfg.raw.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field {key!r} must be a positive integer, got "
                             f"{value!r}")
    return value


@dataclasses.dataclass
class Gemma4Layout:
    """Each layer's attention kind, head shape, window, and the layer whose cache it reads."""

    types: list[str]
    head_dims: list[int]
    kv_heads: list[int]
    k_eq_v: list[bool]
    windows: list[int | None]
    kv_source: list[int]  # the layer whose K/V a layer attends over (itself unless KV-shared)

    def shared(self, i: int) -> bool:
        return self.kv_source[i] != i


def _head_shapes(cfg: ModelConfig, full: list[bool], k_eq_v: bool) -> tuple[list[int], list[int]]:
    """Each layer's (head size, KV heads): from `per_layer_config` (layer index -> overrides, as transformers 5
    writes configs), else the global layers' `global_head_dim` and, with attention_k_eq_v,
    `num_global_key_value_heads` (as Gemma4TextConfig derives that per_layer_config)."""
    raw, n = cfg.raw, len(full)
    dims, kv = [cfg.head_dim] * n, [cfg.num_key_value_heads] * n
    per_layer = raw.get("per_layer_config")
    if per_layer is None:
        global_dim = _positive_int(cfg, "global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)
        global_kv = (_positive_int(cfg, "num_global_key_value_heads", None)
                     if k_eq_v and raw.get("num_global_key_value_heads") is not None else cfg.num_key_value_heads)
        per_layer = {i: {"head_dim": global_dim, "num_key_value_heads": global_kv} for i in range(n) if full[i]}
    if not isinstance(per_layer, dict):
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field 'per_layer_config' must map layer indices "
                             f"to fields, got {per_layer!r}")
    for key, fields in per_layer.items():
        i = int(key) if isinstance(key, int) or str(key).isdigit() else -1
        if not 0 <= i < n or not isinstance(fields, dict):
            raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} per_layer_config entry {key!r}: {fields!r}")
        other = sorted(set(fields) - {"head_dim", "num_key_value_heads"})
        if other:
            raise UnsupportedModelError(f"per_layer_config[{key!r}] sets {', '.join(other)} (in {_where(cfg)}): "
                                        "Atlas's Gemma 4 varies only head_dim and num_key_value_heads by layer")
        dims[i] = fields.get("head_dim", dims[i])
        kv[i] = fields.get("num_key_value_heads", kv[i])
        for name, value in (("head_dim", dims[i]), ("num_key_value_heads", kv[i])):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} per_layer_config[{key!r}].{name} must be "
                                     f"a positive integer, got {value!r}")
        if cfg.num_attention_heads % kv[i]:
            raise ModelLoadError(f"malformed checkpoint: {_where(cfg)}: num_attention_heads "
                                 f"({cfg.num_attention_heads}) is not a multiple of layer {i}'s {kv[i]} KV heads")
    return dims, kv


def gemma4_layout(cfg: ModelConfig) -> Gemma4Layout:
    raw, n = cfg.raw, cfg.num_hidden_layers
    types = raw.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} layer_types must give {n} entries of {SLIDING!r} "
                             f"or {FULL!r}, got {types!r}")
    types[-1] = FULL  # (Gemma4TextConfig forces the last layer global)
    window = _positive_int(cfg, "sliding_window", DEFAULT_SLIDING_WINDOW)
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    full = [t == FULL for t in types]
    head_dims, kv_heads = _head_shapes(cfg, full, k_eq_v)
    for t in set(types):  # (one RoPE table per layer type)
        if len({d for d, u in zip(head_dims, types, strict=True) if u == t}) > 1:
            raise UnsupportedModelError(f"{_where(cfg)}: {t} layers of different head sizes (one RoPE per type)")
    shared = raw.get("num_kv_shared_layers") or 0
    if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared <= n:
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field 'num_kv_shared_layers' must be an integer "
                             f"in 0..{n}, got {shared!r}")
    if shared == n:
        raise UnsupportedModelError(f"num_kv_shared_layers = {n} (in {_where(cfg)}): every layer reuses another's "
                                    "K/V and none computes them")
    first_shared = n - shared
    source = list(range(n))
    for i in range(first_shared, n):
        producers = [j for j in range(first_shared) if types[j] == types[i]]
        if not producers:
            raise ModelLoadError(f"malformed checkpoint: {_where(cfg)}: KV-shared layer {i} ({types[i]}) has no "
                                 "earlier layer of its type to share K/V with")
        source[i] = producers[-1]
    return Gemma4Layout(
        types=types, head_dims=head_dims, kv_heads=kv_heads, k_eq_v=[k_eq_v and f for f in full],
        windows=[None if f else window for f in full], kv_source=source)


def gemma4_ropes(cfg: ModelConfig) -> dict[str, dict]:
    params = cfg.raw.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(params, dict) or not (SLIDING in params or FULL in params):
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} rope_parameters of a Gemma 4 model must be keyed "
                             f"by layer type ({SLIDING!r}, {FULL!r}), got {params!r}")
    out = {}
    for kind in (SLIDING, FULL):
        p = dict(params.get(kind) or {})
        rope_type = p.get("rope_type") or "default"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope_parameters[{kind!r}].rope_type = {rope_type!r} (in {_where(cfg)}): "
                                        f"Atlas's Gemma 4 computes {', '.join(ROPE_TYPES)}")
        if rope_type == "linear" and p.get("partial_rotary_factor", 1.0) != 1.0:
            # (transformers' linear RoPE then makes a table narrower than the head, which its Gemma 4 cannot apply)
            raise UnsupportedModelError(f"rope_parameters[{kind!r}]: linear RoPE with partial_rotary_factor "
                                        f"{p['partial_rotary_factor']} (in {_where(cfg)})")
        if "rope_theta" not in p:
            raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} rope_parameters[{kind!r}] has no rope_theta")
        out[kind] = p
    return out


class Gemma4RoPE(RotaryEmbedding):
    """One layer kind's RoPE over the whole head (rotate_half of head_dim): default and linear as transformers'
    (a partial_rotary_factor is not read there), proportional with its zero frequencies past the rotated ones."""

    def __init__(self, head_dim: int, p: dict, max_positions: int):
        nn.Module.__init__(self)
        self.rotary_dim, self.is_neox_style = head_dim, True
        theta, rope_type = float(p["rope_theta"]), p.get("rope_type") or "default"
        if rope_type == "proportional":
            angles = int(p.get("partial_rotary_factor", 1.0) * head_dim // 2)
            rotated = 1.0 / theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim)
            inv_freq = torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / p.get("factor", 1.0)
        else:
            inv_freq, _ = rope_inv_freq(head_dim, RopeConfig(theta=theta, rope_type=rope_type, params=p), 0)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)


class Gemma4RMSNorm(Float32ScaledRMSNorm):
    """x * (mean(x^2) + eps) ** -0.5 * w in float32, one rounding (transformers' Gemma4RMSNorm, its torch.pow form);
    with_scale=False: no weight (v_norm, the router's norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__(hidden_size, eps)
        if not with_scale:
            del self.weight
            self.weight = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            x32 = x32 * self.weight.float()
        return x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: ModelParallel | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The call forms of ZeroCenteredRMSNorm, in plain PyTorch ops (the torch.pow form is not the fused
        kernel's rsqrt)."""
        if reduce is not None and reduce.tp_size > 1:
            x = reduce.all_reduce(x)
        if residual is None:
            return self._norm(x)
        total = x + residual
        return self._norm(total), total


class ScaledEmbedding(VocabEmbedding):
    """A token embedding times `scale`, that factor rounded to the weight's dtype first (transformers'
    Gemma4TextScaledWordEmbedding)."""

    def __init__(self, vocab_size: int, dim: int, scale: float):
        super().__init__(vocab_size, dim)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(input_ids)
        return out * torch.tensor(self.scale, dtype=torch.float32).to(out.dtype)


def _head_split(num_heads: int, num_kv_heads: int, mp: ModelParallel) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of this rank, as layers.linear.QKVParallelLinear splits them (a KV head
    replicated on tp / num_kv_heads ranks when there are fewer than ranks)."""
    tp, rank = mp.tp_size, mp.tp_rank
    if num_heads % tp:
        raise UnsupportedModelError(f"the {num_heads} attention heads are not divisible by the tensor-parallel size "
                                    f"{tp}")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise UnsupportedModelError(f"the {num_kv_heads} KV heads are not divisible by the tensor-parallel size "
                                        f"{tp}")
        return num_heads // tp, num_kv_heads // tp, rank * (num_kv_heads // tp)
    if tp % num_kv_heads:
        raise UnsupportedModelError(f"the tensor-parallel size {tp} is neither a divisor nor a multiple of the "
                                    f"{num_kv_heads} KV heads")
    return num_heads // tp, 1, rank // (tp // num_kv_heads)


def _qkv_linear(hidden: int, d: int, num_heads: int, num_kv_heads: int, pieces: str, bias: bool,
                mp: ModelParallel) -> tuple[MergedLinear, int, int]:
    """The fused projection of `pieces` (of "qkv": a KV-shared layer has q only, keys-as-values layers q and k) over
    this rank's heads -> (linear, query heads, KV heads)."""
    heads, kv_heads, first_kv = _head_split(num_heads, num_kv_heads, mp)
    sizes = {"q": heads * d, "k": kv_heads * d, "v": kv_heads * d}
    sources = {"q": (mp.tp_rank * heads * d, num_heads * d), "k": (first_kv * d, num_kv_heads * d),
               "v": (first_kv * d, num_kv_heads * d)}
    shards = {p: sizes[p] for p in pieces}
    linear = MergedLinear(hidden, shards, bias, {p: sources[p] for p in pieces} if mp.tp_size > 1 else None)
    return linear, heads, kv_heads


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Gemma4Layout, i: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = d = layout.head_dims[i]
        self.shared, self.k_eq_v = layout.shared(i), layout.k_eq_v[i]
        bias, eps = bool(cfg.raw.get("attention_bias", False)), cfg.rms_norm_eps
        pieces = "q" if self.shared else "qk" if self.k_eq_v else "qkv"
        # (this rank's heads under tensor parallelism; a KV-shared layer's KV heads are its source layer's)
        self.qkv_proj, self.num_heads, self.num_kv_heads = _qkv_linear(
            cfg.hidden_size, d, cfg.num_attention_heads, layout.kv_heads[i], pieces, bias, current())
        self.split = [self.qkv_proj.shard_offsets[p][1] for p in pieces]
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(d, eps)
        if not self.shared:
            self.k_norm = Gemma4RMSNorm(d, eps)
            self.v_norm = Gemma4RMSNorm(d, eps, with_scale=False)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale=1.0,
                                   sliding_window=layout.windows[i])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # (KV cache groups: a local layer reads and writes its group's pages; a KV-shared layer's source is a layer
        #  of its own kind, so its cache is in the same group)
        if meta.windowed is not None:
            meta = meta.for_layer(self.attn.sliding_window)
        rows, d = x.shape[0], self.head_dim
        parts = self.qkv_proj(x).split(self.split, dim=-1)
        q = self.rotary.rotate(positions, self.q_norm(parts[0].reshape(rows, self.num_heads, d)))
        if not self.shared:  # (a KV-shared layer reads its source layer's cache, written earlier in this step)
            k = parts[1].reshape(rows, self.num_kv_heads, d)
            v = k if self.k_eq_v else parts[2].reshape(rows, self.num_kv_heads, d)
            k = self.rotary.rotate(positions, self.k_norm(k))
            write_kv_cache(kv_cache, k, self.v_norm(v), meta.slot_mapping)
        out = self.attn.attend(q, kv_cache, meta)
        return self.o_proj(out.reshape(rows, self.num_heads * d))


class Gemma4Router(nn.Module):
    def __init__(self, cfg: ModelConfig, num_experts: int, top_k: int):
        super().__init__()
        h = cfg.hidden_size
        self.norm = Gemma4RMSNorm(h, cfg.rms_norm_eps, with_scale=False)
        self.proj = Linear(h, num_experts)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.root = h ** -0.5
        self.cfg = RouterConfig(num_experts=num_experts, top_k=top_k, scoring_func="softmax", topk_method="greedy",
                                norm_topk_prob=True)

    @property
    def top_k(self) -> int:
        return self.cfg.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (transformers' order: the projection in the model dtype, the softmax in float32)
        logits = self.proj(self.norm(x) * self.scale * self.root).float()
        weights, ids = select_experts(logits, self.cfg)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Gemma4Layout, i: int, rotary: RotaryEmbedding, act: str,
                 ple_size: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kv_source = layout.kv_source[i]
        self.mp = current()  # (the experts return this rank's partial sum under tensor parallelism)
        self.self_attn = Gemma4Attention(cfg, layout, i, rotary)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        wide = 2 if cfg.raw.get("use_double_wide_mlp") and layout.shared(i) else 1
        self.mlp = LlamaMLP(h, cfg.intermediate_size * wide, act, bias=False)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.moe = bool(cfg.raw.get("enable_moe_block"))
        if self.moe:
            experts = _positive_int(cfg, "num_experts", None)
            top_k = _positive_int(cfg, "top_k_experts", None)
            self.router = Gemma4Router(cfg, experts, top_k)
            self.experts = FusedExperts(experts, h, _positive_int(cfg, "moe_intermediate_size", None), act)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        self.ple = ple_size > 0
        if self.ple:
            self.act = _ACTIVATIONS[act]
            self.per_layer_input_gate = Linear(h, ple_size)
            self.per_layer_projection = Linear(ple_size, h)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ple: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after this layer (transformers' order of adds, so that bf16 rounds alike)."""
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), kv_cache, meta))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            weights, ids = self.router(x)
            moe = self.mp.all_reduce(self.experts(self.pre_feedforward_layernorm_2(x), weights, ids))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)
        if self.ple:
            g = self.per_layer_projection(self.act(self.per_layer_input_gate(x)) * ple)
            x = x + self.post_per_layer_input_norm(g)
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Gemma4Layout, max_positions: int, act: str, ple_size: int):
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_hidden_layers
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, h, h ** 0.5)
        self.ple_size = ple_size
        if ple_size:
            ple_vocab = _positive_int(cfg, "vocab_size_per_layer_input", cfg.vocab_size)
            if ple_vocab < cfg.vocab_size:
                raise UnsupportedModelError(
                    f"vocab_size_per_layer_input = {ple_vocab} < vocab_size = {cfg.vocab_size} (in {_where(cfg)}): "
                    "tokens past the per-layer table have no per-layer embedding")
            self.embed_tokens_per_layer = ScaledEmbedding(ple_vocab, n * ple_size, ple_size ** 0.5)
            self.per_layer_model_projection = Linear(h, n * ple_size)
            self.per_layer_projection_norm = Gemma4RMSNorm(ple_size, cfg.rms_norm_eps)
        ropes = gemma4_ropes(cfg)
        dims = {t: d for t, d in zip(layout.types, layout.head_dims, strict=True)}
        rotary = {t: Gemma4RoPE(dims[t], ropes[t], max_positions) for t in dims}
        self.layers = make_layers(n, lambda i: Gemma4DecoderLayer(cfg, layout, i, rotary[layout.types[i]], act,
                                                                  ple_size))
        self.norm = Gemma4RMSNorm(h, cfg.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: the token's per-layer rows and the projected embedding, as transformers combines them."""
        n, p = len(self.layers), self.ple_size
        tok = self.embed_tokens_per_layer(input_ids).reshape(-1, n, p)
        proj = self.per_layer_model_projection(x) * x.shape[-1] ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(-1, n, p))
        return (proj + tok) * 2.0 ** -0.5


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4's text model (module docstring)."""

    supports_pooling = False
    supports_kv_cache_groups = True  # (Gemma4Attention: meta.for_layer)
    supports_fp8_linear = False

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        raw = cfg.raw
        if raw.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError(f"use_bidirectional_attention = 'all' (in {_where(cfg)}): Atlas serves "
                                        "causal decoders only ('vision' is served: text tokens stay causal)")
        if current().pp_size > 1:
            raise UnsupportedModelError(f"{cfg.architecture}: pipeline parallelism is not supported for Gemma 4 yet "
                                        "(its later layers read earlier layers' K/V and per-layer embeddings)")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        ple = raw.get("hidden_size_per_layer_input", DEFAULT_PLE_SIZE) or 0
        if ple and act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_activation {act!r} (in {_where(cfg)}): the per-layer input gate "
                                        f"computes {', '.join(_ACTIVATIONS)}")
        ple = _positive_int(cfg, "hidden_size_per_layer_input", None) if ple else 0
        # (Gemma4TextConfig ties the LM head to the embedding unless told otherwise)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
        self.config = cfg
        self.layout = gemma4_layout(cfg)
        self.model = Gemma4Model(cfg, self.layout, max_positions, act, ple)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)
        cap = raw.get("final_logit_softcapping")
        if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0):
            raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field 'final_logit_softcapping' must be a "
                                 f"positive number or null, got {cap!r}")
        self.final_logit_softcapping = None if cap is None else float(cap)
        # The image-text checkpoints' media placeholders: embedded as the pad token (transformers, without media).
        media = [raw.get(k) for k in ("image_token_id", "video_token_id", "audio_token_id")]
        self.media_ids = sorted({t for t in media if isinstance(t, int)}) if "vlm_config" in raw else []
        self.pad_token_id = raw.get("pad_token_id") or 0
        # Cache index of each layer: its own, or its KV source's.
        own = [i for i in range(cfg.num_hidden_layers) if not self.layout.shared(i)]
        self.cache_index = [own.index(self.layout.kv_source[i]) for i in range(cfg.num_hidden_layers)]
        self.cache_layers = own

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One per layer that computes K/V (KV-shared layers read their source's cache)."""
        lay = self.layout
        attn = [self.model.layers[i].self_attn for i in self.cache_layers]
        return [KVCacheSpec(a.num_kv_heads, a.head_dim, a.num_heads, lay.windows[i])
                for a, i in zip(attn, self.cache_layers, strict=True)]

    def attention_program_heads(self) -> tuple[int, int] | None:
        # (the local layers' packing where the global ones differ: those build their own map in the step, and CUDA
        #  graphs are off, cuda_graph_blocker)
        packs = [spec.program_heads for spec in self.kv_cache_specs()]
        return packs[0] if len(set(packs)) > 1 else None

    @property
    def cuda_graph_blocker(self) -> str:
        specs = self.kv_cache_specs()
        if len({s.program_heads for s in specs}) > 1:
            return "its global and local layers pack attention heads differently"
        if max(s.head_dim for s in specs) > MAX_TRITON_HEAD_DIM:
            return (f"its global layers' head size {max(s.head_dim for s in specs)} exceeds the Triton attention "
                    f"kernels' {MAX_TRITON_HEAD_DIM} (the PyTorch reference attends there)")
        if not all(layer.experts.graph_safe() for layer in self.model.layers if layer.moe):
            return "its experts need the grouped GEMM (recent PyTorch, bf16, an sm90+ GPU) inside a graph"
        return ""

    def supports_cuda_graphs(self, dtype: torch.dtype, device: torch.device) -> bool:
        return not self.cuda_graph_blocker

    def attention_windows(self) -> list[int | None]:
        return list(self.layout.windows)

    def _text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.media_ids:
            return input_ids
        media = torch.isin(input_ids, torch.tensor(self.media_ids, device=input_ids.device))
        return torch.where(media, self.pad_token_id, input_ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(self._text_ids(input_ids))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [T, H], the residual streams after capture_layers [T, n * H] or None)."""
        if intermediate is not None:
            raise UnsupportedModelError(f"{self.config.architecture}: pipeline parallelism is not supported")
        ids = self._text_ids(input_ids)
        x = self.model.embed_tokens(ids)
        ple = self.model.per_layer_inputs(ids, x) if self.model.ple_size else None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(positions, x, ple[:, i] if ple is not None else None, kv_caches[self.cache_index[i]], meta)
            if i in capture_layers:
                captured[i] = x
        aux = torch.cat([captured[i] for i in capture_layers if i in captured], dim=-1) if captured else None
        return self.model.norm(x), aux

    # (final-logit soft-capping, and no plain embedding-product vocabulary: as Gemma 3)
    compute_logits = Gemma3ForCausalLM.compute_logits
    vocab_weight_names = Gemma3ForCausalLM.vocab_weight_names

    def _checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        shared = {f"model.layers.{i}.self_attn.{p}." for i in range(self.num_layers) if self.layout.shared(i)
                  for p in ("k_proj", "v_proj", "k_norm", "v_norm")}
        for name, tensor in renamed_weights(language_model_weights(weights, _MEDIA_PREFIXES, self.config.path,
                                                                   "the vision / audio towers'"),
                                            tied_head=self.config.tie_word_embeddings):
            if name.rpartition(".")[0] + "." in shared:
                continue  # (a KV-shared layer's unused projections, as transformers ignores them)
            yield name, tensor

    @staticmethod
    def _mapper(name: str) -> tuple[str, object] | None:
        for piece, target in ((".experts.gate_up_proj", ".experts.w13"), (".experts.down_proj", ".experts.w2")):
            if name.endswith(piece):
                return name[: -len(piece)] + target, "halves"  # ([E, 2I, H] gate rows then up rows; [E, H, I])
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stacked = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
                   ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]
        load_named_weights(self, self._checkpoint_names(weights), stacked, skip_suffixes=("rotary_emb.inv_freq",),
                           mapper=self._mapper, strict=True)
        missing = [f"{name}.{piece}" for name, m in self.named_modules() if isinstance(m, FusedExperts)
                   for piece in m.missing_shards()]
        if missing:
            raise ModelLoadError(f"malformed checkpoint: missing expert weight(s) {', '.join(missing[:5])}")

