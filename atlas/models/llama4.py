"""Llama 4 (Llama4ForCausalLM; Llama4ForConditionalGeneration, Llama 4 Scout and Maverick, served on text). Model math
only, as transformers' Llama4TextModel computes it.

- Attention: GQA with RoPE on interleaved pairs (llama3 scaling where the config has it) on the layers
  `no_rope_layers` marks 1; those attend in chunks (`layer_types` chunked_attention: a query sees only the keys of
  its own chunk of `attention_chunk_size` positions) and, with use_qk_norm, normalize each head of q and k with a
  weightless RMS norm (after the rotation in the reference; RMS norm commutes with a rotation, so the fused
  prologue's norm-then-rope computes the same). The other layers (every fourth by default) take no RoPE and see
  every key; with attn_temperature_tuning their queries are scaled by 1 + attn_scale * ln(1 + floor((p + 1) /
  floor_scale)) at position p.
- MLP: on `moe_layers` (by default every interleave_moe_layer_step-th layer) a shared expert plus routed experts
  whose router takes the top-k logits and scales each chosen expert's *input* by the sigmoid of its logit (so the
  routed sum is sum_e expert_e(sigmoid(l_e) * x), not a weighted sum of outputs: the experts run on pre-scaled
  rows with unit weights); elsewhere a SwiGLU of intermediate_size_mlp.
- The checkpoint's experts are fused, `experts.gate_up_proj` [E, hidden, 2 x intermediate] (gate first) and
  `experts.down_proj` [E, intermediate, hidden]: split per expert at load.

A chunked layer's pages below its current chunk go back to the pool as a sliding window's do (its reach is the
chunk: KV cache groups beside the global NoPE layers, engine/kv_groups.py), so a long sequence holds a chunk's
pages in those layers. LoRA adapters and FP8 checkpoints are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError
from atlas.kernels import gemv
from atlas.kernels.fused_ops import qk_norm_rope_kv_write
from atlas.layers.attention import AttentionMetadata, PagedAttention
from atlas.layers.linear import materialize
from atlas.layers.moe import FusedExperts, RouterConfig, TopKRouter
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import language_model_weights
from atlas.models.llama import (
    LANGUAGE_MODEL_RENAMES,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
    LlamaVariant,
)
from atlas.models.sparse_moe import (
    MoESettings,
    SparseMoeForCausalLM,
    _fields,
    checked_router,
    fused_expert_pieces,
)


class Llama4Layout:
    """Per-layer switches from config.json, as transformers' Llama4TextConfig derives them."""

    def __init__(self, cfg: ModelConfig):
        raw, n, where = cfg.raw, cfg.num_hidden_layers, cfg.path / "config.json"
        _, count = _fields(cfg)
        interval = count("no_rope_layer_interval", 4, 1)
        uses = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        chunk = raw.get("attention_chunk_size", 8192)
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0):
            raise ModelLoadError(f"malformed checkpoint: {where} field 'attention_chunk_size' must be a positive "
                                 f"integer or null, got {chunk!r}")
        types = raw.get("layer_types") or ["chunked_attention" if use and chunk is not None else "full_attention"
                                           for use in uses]
        step = count("interleave_moe_layer_step", 1, 1)
        moe = raw.get("moe_layers")
        moe = list(range(step - 1, n, step)) if moe is None else moe
        for name, values in (("no_rope_layers", uses), ("layer_types", types)):
            if not isinstance(values, list) or len(values) != n:
                raise ModelLoadError(f"malformed checkpoint: {where} field '{name}' must list the {n} layers, got "
                                     f"{values!r}")
        if any(t not in ("chunked_attention", "full_attention") for t in types) or (
                chunk is None and "chunked_attention" in types):
            raise ModelLoadError(f"malformed checkpoint: {where} layer_types {types} must be 'chunked_attention' "
                                 "(with an attention_chunk_size) or 'full_attention'")
        if not isinstance(moe, list) or not all(isinstance(i, int) and 0 <= i < n for i in moe):
            raise ModelLoadError(f"malformed checkpoint: {where} field 'moe_layers' must list layer ids, got {moe!r}")
        self.use_rope = [bool(u) for u in uses]
        self.chunks = [chunk if t == "chunked_attention" else None for t in types]
        self.moe_layers = frozenset(moe)
        self.qk_norm = bool(raw.get("use_qk_norm", True))
        self.temperature = bool(raw.get("attn_temperature_tuning", True))
        self.floor_scale = float(raw.get("floor_scale", 8192))
        self.attn_scale = float(raw.get("attn_scale", 0.1))


@dataclass
class Llama4Variant(LlamaVariant):
    """LlamaVariant with the per-layer switches read once (the attention layers and the model read them here)."""

    layout: Llama4Layout | None = None


class Llama4Attention(LlamaAttention):
    """LlamaAttention with Llama 4's per-layer switches (module docstring): chunks, weightless q / k norms on the RoPE
    layers, no RoPE and tuned query temperature on the others."""

    def __init__(self, cfg: ModelConfig, variant: LlamaVariant, layer_idx: int, rotary: RotaryEmbedding,
                 reduce: bool = True):
        super().__init__(cfg, variant, layer_idx, rotary, reduce)
        layout = variant.layout
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5,
                                   chunk_size=layout.chunks[layer_idx])
        self.use_rope = layout.use_rope[layer_idx]  # (a NoPE layer's rotary: the identity, set by the model)
        self.norm_eps = cfg.rms_norm_eps if self.use_rope and layout.qk_norm else None
        # (a weightless norm: ones through the fused prologue's weighted one; not a checkpoint tensor)
        self.register_buffer("unit_weight", torch.ones(self.head_dim), persistent=False)
        self.temperature = (layout.floor_scale, layout.attn_scale) if layout.temperature and not self.use_rope \
            else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.windowed is not None:  # (KV cache groups: a chunked layer reads and writes the window group's pages)
            meta = meta.for_layer(self.attn.reach)
        rotary, norm = self.rotary, self.unit_weight if self.norm_eps is not None else None
        q = qk_norm_rope_kv_write(self.qkv_proj(x), positions, rotary.cos_cache, rotary.sin_cache, self.num_heads,
                                  self.num_kv_heads, self.head_dim, norm, norm, self.norm_eps or 0.0,
                                  rotary.rotary_dim, rotary.is_neox_style, kv_cache, meta.slot_mapping)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q.float() * scales[:, None, None]).to(q.dtype)
        out = self.attn.attend(q, kv_cache, meta)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_class = Llama4Attention


class Llama4Router(TopKRouter):
    """The top-k logits (in the model dtype, as the reference's linear) and the sigmoid of each, rounded to the
    model dtype as the reference rounds them."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = gemv.linear(x, self.weight).topk(self.cfg.top_k, dim=-1)
        return values.float().sigmoid().to(x.dtype), ids


class Llama4MoE(nn.Module):
    """The shared expert plus the routed experts run on inputs pre-scaled by their router scores."""

    def __init__(self, hidden_size: int, router: RouterConfig, intermediate_size: int, act: str, reduce: bool):
        super().__init__()
        self.mp = current()
        self.reduce = reduce
        self.gate = Llama4Router(hidden_size, router, correction_bias=False)
        self.experts = FusedExperts(router.num_experts, hidden_size, intermediate_size, act)
        self.shared_experts = LlamaMLP(hidden_size, intermediate_size, act, bias=False, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, ids = self.gate(x)
        t, k = ids.shape
        rows = (x[:, None, :] * scores[..., None]).reshape(t * k, -1)  # (one row a chosen expert)
        unit = torch.ones(t * k, 1, dtype=torch.float32, device=x.device)
        routed = self.experts(rows, unit, ids.reshape(t * k, 1)).view(t, k, -1).sum(dim=1)
        out = routed + self.shared_experts(x)
        return self.mp.all_reduce(out) if self.reduce else out


class Llama4ForCausalLM(SparseMoeForCausalLM):
    """Llama 4's language model (module docstring)."""

    decoder_layer = Llama4DecoderLayer
    neox_rope = False
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()
    _TOWERS = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        need, _ = _fields(cfg)
        layout = Llama4Layout(cfg)
        router = (checked_router(where, need("num_local_experts"), need("num_experts_per_tok"), "sigmoid", "greedy",
                                 1, 1, False, 1.0, model_dtype_logits=True) if layout.moe_layers else None)
        bias = bool(raw.get("attention_bias", False))
        return MoESettings(
            attention=Llama4Variant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False,
                                    sliding_windows=[None] * cfg.num_hidden_layers, layout=layout),
            rope=cfg.rope, router=router, correction_bias=False, moe_intermediate_size=cfg.intermediate_size,
            n_shared_experts=1, hidden_act=str(raw.get("hidden_act", "silu")), moe_layers=layout.moe_layers)

    def attention_windows(self) -> list[int | None]:
        """Each layer's reach: a chunked layer reads at most its chunk back, so the page manager releases its pages
        below that (a pool of their own beside the global layers': KV cache groups), as a sliding window's."""
        return list(self.moe_settings.attention.layout.chunks)

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        s = self.moe_settings = self.read_settings(cfg, max_positions)
        dense = cfg.raw.get("intermediate_size_mlp") or cfg.intermediate_size

        def mlp(i: int) -> Callable[[bool], nn.Module]:
            if i in s.moe_layers:
                return lambda reduce: Llama4MoE(cfg.hidden_size, s.router, s.moe_intermediate_size, s.hidden_act,
                                                reduce)
            return lambda reduce: LlamaMLP(cfg.hidden_size, dense, s.hidden_act, False, reduce=reduce, direct=True)

        model = LlamaModel(cfg, s.attention, max_positions, rope=s.rope, mlp=mlp, layer=self.decoder_layer,
                           is_neox_style=False)
        identity = None  # (one identity table for every NoPE layer)
        for layer in model.layers:
            if not layer.self_attn.use_rope:
                if identity is None:
                    identity = layer.self_attn.rotary.identity()
                layer.self_attn.rotary = identity
        return model

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """`feed_forward.` -> `mlp.`; the router and the shared expert under the MoE block's names."""
        return (name.replace(".feed_forward.router.", ".mlp.gate.")
                .replace(".feed_forward.shared_expert.", ".mlp.shared_experts.")
                .replace(".feed_forward.", ".mlp."))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        text = language_model_weights(weights, self._TOWERS, self.config.path, "the vision tower's and projector's",
                                      LANGUAGE_MODEL_RENAMES)
        super().load_weights(self._per_expert(text))

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        hidden, inter = self.config.hidden_size, self.moe_settings.moe_intermediate_size
        for name, tensor in weights:
            if not name.endswith((".feed_forward.experts.gate_up_proj", ".feed_forward.experts.down_proj")):
                yield name, tensor
                continue
            w = materialize(tensor)
            down = name.endswith("down_proj")
            want = (inter, hidden) if down else (hidden, 2 * inter)
            if w.dim() != 3 or tuple(w.shape[1:]) != want:
                raise ModelLoadError(f"malformed checkpoint {self.config.path}: {name} has shape {tuple(w.shape)}, "
                                     f"not [experts, {want[0]}, {want[1]}]")
            yield from fused_expert_pieces(name, w, transposed=True)

