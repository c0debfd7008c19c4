"""The DFlash block-diffusion drafter (z-lab `DFlashDraftModel` checkpoints): model math only.

A drafter is a few pre-norm Qwen3 decoder layers with no embedding and no LM head of its own: it
embeds its block with the target's `embed_tokens` and scores it with the target's `lm_head`. What it
knows about the sequence comes from the target's residual streams after the decoder layers
`target_layer_ids`, concatenated per token and fused by `fc` + `hidden_norm` into one context vector
c. Each draft layer turns c into "injected" K/V only (K = k_norm(k_proj(c)) with RoPE at the token's
position, V = v_proj(c)); the context never has queries, MLPs or residuals.

In Atlas those context K/V live in a per-layer paged cache addressed by the target's page ids and
slots (`write_context`). A drafting step (`forward`) runs the block [x0, MASK x K] at positions
start..start+K: every layer writes the block's own K/V into the same cache at those positions'
slots (scratch: they are overwritten by the real context once tokens are committed) and attends,
without a causal mask, over the request's positions 0..start+K. Format and semantics:
../shared/specs/dflash.md.

Training (atlas/training/dflash.py) uses these same modules and parameters through `forward_train`:
the same math with no cache, in PyTorch only (differentiable), over batches of windows whose blocks see
the context K/V and their own K/V through an explicit mask. It is a separate method so that the
serving path carries none of its work. `checkpoint_tensors` is `load_weights`' inverse: what a trained
drafter saves is what the server loads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atlas.config import RopeConfig, _parse_rope, config_fields, read_config_json
from atlas.errors import ModelLoadError
from atlas.kernels.fused_ops import act_and_mul_ref, qk_norm_rope_kv_write, rms_norm_ref
from atlas.layers.attention import AttentionMetadata, PagedAttention
from atlas.layers.linear import Linear, MergedLinear
from atlas.layers.norm import RMSNorm
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import KVCacheSpec, load_named_weights
from atlas.models.llama import LlamaMLP
from atlas.models.quantization import refuse_quantized

logger = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The z-lab rule when a checkpoint lists no layer ids: one draft layer reads the middle target
    layer; L > 1 draft layers read L layers spread evenly from layer 1 to layer N - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """The fields of a DFlash drafter's config.json, checked and typed."""

    path: Path
    raw: dict[str, Any]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    hidden_act: str
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None  # as the checkpoint states it (only used for the default layer ids)
    sliding_windows: list[int | None] = field(default_factory=list)  # per draft layer
    causal: bool = False  # z-lab drafters attend bidirectionally; a config may say otherwise
    torch_dtype: str | None = None

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_features * self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path, target_num_layers: int | None = None) -> DFlashConfig:
        """`target_num_layers`: the loaded target's layer count, used for the default layer ids when the
        checkpoint states neither `dflash_config.target_layer_ids` nor `num_target_layers`."""
        where = path / "config.json"

        positive_int, need = config_fields(raw, where, "DFlash drafter")

        archs = raw.get("architectures") or []
        if archs and ARCHITECTURE not in archs:
            raise ModelLoadError(
                f"{path} is not a DFlash drafter: its architectures are {archs}, expected [{ARCHITECTURE!r}]. "
                "Point --draft-model at a DFlash checkpoint (e.g. z-lab/Qwen3-8B-DFlash-b16)")
        refuse_quantized(raw, path, "DFlash drafter")  # (before its weights are read, as every checkpoint)
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ModelLoadError(f"malformed DFlash drafter: {where} field 'dflash_config' must be an object")

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = positive_int(raw.get("num_key_value_heads") or heads, "num_key_value_heads")
        head_dim = positive_int(raw.get("head_dim") or hidden // heads, "head_dim")
        layers = need("num_hidden_layers")

        block_size = dflash.get("block_size", raw.get("block_size", DEFAULT_BLOCK_SIZE))
        block_size = positive_int(block_size, "block_size")
        if block_size < 2:
            raise ModelLoadError(f"malformed DFlash drafter: block_size {block_size} in {where} leaves no draft slot")

        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
            raise ModelLoadError(f"malformed DFlash drafter: {where} has no valid 'dflash_config.mask_token_id' "
                                 f"(got {mask!r})")

        num_target_layers = raw.get("num_target_layers")
        if num_target_layers is not None:
            num_target_layers = positive_int(num_target_layers, "num_target_layers")
        ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if ids is None:
            n = num_target_layers or target_num_layers
            if n is None:
                raise ModelLoadError(f"malformed DFlash drafter: {where} gives neither 'dflash_config.target_layer_ids'"
                                     " nor 'num_target_layers'")
            ids = default_target_layer_ids(n, layers)
            logger.info("DFlash drafter %s lists no target_layer_ids: using the default %s for %d target layers",
                        path, ids, n)
        if (not isinstance(ids, list) or not ids
                or any(not isinstance(i, int) or isinstance(i, bool) for i in ids)):
            raise ModelLoadError(f"malformed DFlash drafter: 'target_layer_ids' in {where} must be a non-empty list "
                                 f"of integers, got {ids!r}")
        if min(ids) < 0:
            raise ModelLoadError(f"malformed DFlash drafter: negative target layer id in {ids} ({where})")

        window = raw.get("sliding_window")
        layer_types = raw.get("layer_types") or ["full_attention"] * layers
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise ModelLoadError(f"malformed DFlash drafter: 'layer_types' in {where} must list one type for each "
                                 f"of the {layers} layers, got {layer_types!r}")
        windows: list[int | None] = []
        for t in layer_types:
            if t == "sliding_attention":
                windows.append(positive_int(window, "sliding_window"))
            elif t == "full_attention":
                windows.append(None)
            else:
                raise ModelLoadError(f"DFlash drafter {path}: layer type {t!r} is not supported "
                                     "(full_attention, sliding_attention)")
        return cls(
            path=path, raw=raw, hidden_size=hidden, intermediate_size=need("intermediate_size"),
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 40960),
            rope=_parse_rope(raw), hidden_act=str(raw.get("hidden_act", "silu")),
            attention_bias=bool(raw.get("attention_bias", False)), block_size=block_size, mask_token_id=mask,
            target_layer_ids=list(ids), num_target_layers=num_target_layers, sliding_windows=windows,
            causal=bool(dflash.get("is_causal", raw.get("is_causal", False))),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"))

    @classmethod
    def from_path(cls, path: Path, target_num_layers: int | None = None) -> DFlashConfig:
        raw = read_config_json(path, "--draft-model", "a DFlash checkpoint", "DFlash drafter")
        return cls.from_dict(raw, path, target_num_layers)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5,
                                   sliding_window=cfg.sliding_windows[layer_idx], causal=cfg.causal)

    def write_context_kv(self, c: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_cache: torch.Tensor) -> None:
        """Injected K/V of context vectors c [n, H] at `positions` into the cache at `slot_mapping` (a slot
        < 0 is not written): K = RoPE(k_norm(k_proj(c))), V = v_proj(c). The fused prologue with no
        query heads does the norm, the RoPE and the write in one kernel."""
        w = self.qkv_proj.weight[self.q_size:]
        b = self.qkv_proj.bias[self.q_size:] if self.qkv_proj.bias is not None else None
        rotary = self.rotary
        qk_norm_rope_kv_write(nn.functional.linear(c, w, b), positions, rotary.cos_cache, rotary.sin_cache, 0,
                              self.num_kv_heads, self.head_dim, self.k_norm.weight, self.k_norm.weight,
                              self.k_norm.eps, rotary.rotary_dim, rotary.is_neox_style, kv_cache, slot_mapping)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        rotary = self.rotary
        q = qk_norm_rope_kv_write(
            self.qkv_proj(x), positions, rotary.cos_cache, rotary.sin_cache, self.num_heads, self.num_kv_heads,
            self.head_dim, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rotary.rotary_dim,
            rotary.is_neox_style, kv_cache, meta.slot_mapping)
        out = self.attn.attend(q, kv_cache, meta)
        return self.o_proj(out.view(-1, self.q_size))

    def forward_train(self, x: torch.Tensor, positions: torch.Tensor, c: torch.Tensor,
                      context_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`write_context_kv` + `forward` without a cache: block rows x [N, Q, H] (input-normed) at
        positions [N, Q] attend over the keys [context ++ block]: context vectors c [N, L, H] at
        context_positions [N, L] give injected K/V, the block its own. mask [N, Q, L + Q] (bool) says
        which keys each row sees; the layer's causal / sliding-window rule is applied on top, by
        position, as the paged kernel does. -> [N, Q, H]."""
        n, q_len, _ = x.shape
        length = c.shape[1]
        d = self.head_dim
        q, k_b, v_b = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        w = self.qkv_proj.weight[self.q_size:]
        b = self.qkv_proj.bias[self.q_size:] if self.qkv_proj.bias is not None else None
        k_c, v_c = nn.functional.linear(c, w, b).split([self.kv_size, self.kv_size], dim=-1)
        q = rms_norm_ref(q.reshape(n, q_len, self.num_heads, d), self.q_norm.weight, self.q_norm.eps)
        k = rms_norm_ref(torch.cat([k_c, k_b], dim=1).reshape(n, length + q_len, self.num_kv_heads, d),
                         self.k_norm.weight, self.k_norm.eps)
        v = torch.cat([v_c, v_b], dim=1).reshape(n, length + q_len, self.num_kv_heads, d)
        key_positions = torch.cat([context_positions.expand(n, length), positions], dim=1)
        q, k = self.rotary.rotate(positions, q), self.rotary.rotate(key_positions, k)
        q_pos, k_pos = positions[:, :, None], key_positions[:, None, :]
        if self.attn.causal:
            mask = mask & (k_pos <= q_pos)
        if self.attn.sliding_window is not None:
            mask = mask & (k_pos > q_pos - self.attn.sliding_window)
        rep = self.num_heads // self.num_kv_heads
        k = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v.to(q.dtype), attn_mask=mask[:, None],
                                                         scale=self.attn.scale)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, self.q_size))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (MLP output, residual stream before it), as in the target's layers."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta), residual)
        return self.mlp(h), residual

    def forward_train(self, x: torch.Tensor, positions: torch.Tensor, c: torch.Tensor,
                      context_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The residual stream x [N, Q, H] after this layer (DFlashAttention.forward_train for the rest);
        the PyTorch references of the fused norm and activation, since the kernels have no backward."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        x = x + self.self_attn.forward_train(rms_norm_ref(x, ln1.weight, ln1.eps), positions, c, context_positions,
                                             mask)
        h = rms_norm_ref(x, ln2.weight, ln2.eps)
        return x + self.mlp.down_proj(act_and_mul_ref(self.mlp.gate_up_proj(h), self.mlp.act))


class DFlashDraftModel(nn.Module):
    """fc + hidden_norm (context fusion), the draft layers, and the final norm. No embed, no LM head."""

    stacked_params = [
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    ]

    def __init__(self, cfg: DFlashConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.fc = Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings)
        self.layers = nn.ModuleList([DFlashDecoderLayer(cfg, i, rotary) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        cfg = self.config
        return [KVCacheSpec(cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads)] * cfg.num_hidden_layers

    # ------------------------------------------------------------------ context
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [n, len(ids) * H] (in target_layer_ids order) -> context vectors [n, H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_caches: list[torch.Tensor]) -> None:
        """Store every layer's injected K/V of committed tokens (features [n, len(ids) * H] at absolute
        `positions`) at their cache slots (slots < 0: rows not written)."""
        if features.shape[0] == 0:
            return
        c = self.project_context(features)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.write_context_kv(c, positions, slot_mapping, cache)

    # ------------------------------------------------------------------ the block
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Block embeddings [T, H] (target-embedded [x0, MASK, ...] of each request, flat) -> final-normed
        hidden [T, H]. The block's own K/V go to `meta.slot_mapping` in each layer's cache."""
        x = embeds.to(self.fc.weight.dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, cache, meta)
        hidden, _ = self.norm(x, residual)
        return hidden

    def forward_train(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                      mask: torch.Tensor, context_positions: torch.Tensor | None = None) -> torch.Tensor:
        """`write_context` + `forward` for training, with no cache: target features [N, L, len(ids) * H]
        of context positions (default 0..L-1), block embeddings [N, Q, H] at positions [N, Q] (any
        number of blocks per row), mask [N, Q, L + Q] over [context ++ block] keys -> final-normed
        hidden [N, Q, H]."""
        length = features.shape[1]
        if context_positions is None:
            context_positions = torch.arange(length, device=features.device)[None]
        c = self.project_context_train(features)
        x = embeds.to(self.fc.weight.dtype)
        for layer in self.layers:
            x = layer.forward_train(x, positions, c, context_positions, mask)
        return rms_norm_ref(x, self.norm.weight, self.norm.eps)

    def project_context_train(self, features: torch.Tensor) -> torch.Tensor:
        """`project_context` in PyTorch only (differentiable)."""
        return rms_norm_ref(self.fc(features.to(self.fc.weight.dtype)), self.hidden_norm.weight, self.hidden_norm.eps)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """z-lab names (`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, ...), with or without a
        `model.` prefix. An embedding or LM head in the checkpoint is not used: the target's are."""
        expected_fc = (self.config.hidden_size, self.config.fc_in_features)

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model."):
                    name = name[len("model."):]
                if name == "fc.weight" and tuple(tensor.shape) != expected_fc:
                    raise ModelLoadError(
                        f"DFlash drafter {self.config.path}: fc.weight is {list(tensor.shape)} but "
                        f"{self.config.num_features} target layers {self.config.target_layer_ids} of hidden size "
                        f"{self.config.hidden_size} need [{expected_fc[0]}, {expected_fc[1]}]: the checkpoint's "
                        "target_layer_ids do not match its fc layer")
                if name.startswith(("embed_tokens.", "lm_head.")):
                    logger.info("DFlash drafter: ignoring %s (the target's embedding and LM head are used)", name)
                    continue
                yield name, tensor

        load_named_weights(self, renamed(), self.stacked_params, skip_suffixes=("rotary_emb.inv_freq",))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The z-lab tensors (unprefixed names) of this model's parameters: `load_weights`' inverse, the
        fused q|k|v and gate|up split back along the same `stacked_params` table."""
        modules = dict(self.named_modules())
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            module_name, _, _ = name.rpartition(".")
            module = modules[module_name]
            if not isinstance(module, MergedLinear):
                out[name] = tensor
                continue
            fused = module_name.rpartition(".")[2]
            for ckpt_piece, fused_piece, shard_id in self.stacked_params:
                if fused_piece == fused:
                    offset, size = module.shard_offsets[shard_id]
                    out[name.replace(f".{fused}.", f".{ckpt_piece}.")] = tensor.narrow(0, offset, size)
        return out
