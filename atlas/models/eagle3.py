"""The EAGLE-3 drafter (published `LlamaForCausalLMEagle3` checkpoints): model math only.

One Llama decoder layer ("midlayer") whose attention reads the concatenation [input_layernorm(embed(token)),
hidden_norm(h)] (q/k/v projections 2H wide), where h is either `fc` of three target residual streams
concatenated (low, mid, high; 3 * target_hidden_size -> H) or, in chained steps, the drafter's own
previous pre-norm output. The residual of the layer is h (or hidden_norm(h) with `norm_before_residual`),
then post_attention_layernorm, a SwiGLU MLP, the final `norm` and the drafter's own `lm_head` over its
reduced draft vocabulary; `d2t` maps a draft id to a target id (target = draft + d2t[draft]).

The layer's K/V live in a paged cache addressed by the target's page ids and slots (one cache layer);
attention is causal over the request's positions. Format, sources and alignment:
../shared/specs/eagle3.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atlas.config import RopeConfig, _parse_rope, config_fields, read_config_json
from atlas.errors import ModelLoadError
from atlas.kernels.fused_ops import qk_norm_rope_kv_write
from atlas.layers.attention import AttentionMetadata, PagedAttention
from atlas.layers.linear import Linear, MergedLinear
from atlas.layers.norm import RMSNorm
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import KVCacheSpec, load_named_weights
from atlas.models.llama import LlamaMLP
from atlas.models.quantization import refuse_quantized

logger = logging.getLogger(__name__)

#: the architectures that name an EAGLE-3 drafter (vLLM's registry maps all of them to one class)
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Qwen2_5vlForCausalLM",
                 "Eagle3Qwen3vlForCausalLM")


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """vLLM / SGLang / the EAGLE repo: layers 2, N // 2 and N - 3, as ids of the residual stream ENTERING that
    layer (id j = the output of layer j - 1)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


@dataclass
class Eagle3Config:
    """The fields of an EAGLE-3 drafter's config.json, checked and typed."""

    path: Path
    raw: dict[str, Any]
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    hidden_act: str
    qkv_bias: bool
    fc_bias: bool
    vocab_size: int | None  # the target vocabulary it was trained for (None: not stated)
    draft_vocab_size: int
    aux_layer_ids: list[int] | None  # as the checkpoint states them (vLLM's entering-layer ids), None: default
    norm_before_residual: bool = False
    torch_dtype: str | None = None

    def aux_layers(self, num_target_layers: int) -> list[int]:
        """The three target layer ids in vLLM's convention (the stream entering layer j), ascending: the engines
        capture them in a loop over the layers, so fc reads them in layer order whatever order the config lists."""
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else default_aux_layer_ids(num_target_layers)
        return sorted(ids)

    def capture_layers(self, num_target_layers: int) -> list[int]:
        """The same three streams as Atlas capture ids (capture id i = the output of decoder layer i): j - 1."""
        return [j - 1 for j in self.aux_layers(num_target_layers)]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path) -> Eagle3Config:
        where = path / "config.json"

        positive_int, need = config_fields(raw, where, "EAGLE-3 drafter")

        archs = raw.get("architectures") or []
        if archs and not any(a in ARCHITECTURES for a in archs):
            raise ModelLoadError(
                f"{path} is not an EAGLE-3 drafter: its architectures are {archs}, expected one of "
                f"{list(ARCHITECTURES)}. Point --draft-model at an EAGLE-3 checkpoint "
                "(e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)")
        refuse_quantized(raw, path, "EAGLE-3 drafter")
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ModelLoadError(f"malformed EAGLE-3 drafter: {where} field 'eagle_config' must be an object")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ModelLoadError(f"EAGLE-3 drafter {path}: eagle_config.use_aux_hidden_state is false (a drafter that "
                                 "reads the last hidden state only, EAGLE-1 style); Atlas runs EAGLE-3 drafters, which "
                                 "read three target layers through fc")
        layers = need("num_hidden_layers")
        if layers != 1:
            raise ModelLoadError(f"EAGLE-3 drafter {path} has {layers} decoder layers; Atlas runs the published "
                                 "one-layer form (num_hidden_layers 1)")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = positive_int(raw.get("num_key_value_heads") or heads, "num_key_value_heads")
        head_dim = positive_int(raw.get("head_dim") or hidden // heads, "head_dim")
        vocab = raw.get("vocab_size")
        if vocab is not None:
            vocab = positive_int(vocab, "vocab_size")
        draft_vocab = raw.get("draft_vocab_size")
        draft_vocab = positive_int(draft_vocab, "draft_vocab_size") if draft_vocab is not None else vocab
        if draft_vocab is None:
            raise ModelLoadError(f"malformed EAGLE-3 drafter: {where} has neither 'draft_vocab_size' nor 'vocab_size'")
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or len(ids) != 3
                                or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)):
            raise ModelLoadError(f"malformed EAGLE-3 drafter: 'eagle_aux_hidden_state_layer_ids' in {where} must list "
                                 f"three non-negative layer ids, got {ids!r}")
        return cls(
            path=path, raw=raw, hidden_size=hidden,
            target_hidden_size=positive_int(raw.get("target_hidden_size") or hidden, "target_hidden_size"),
            intermediate_size=need("intermediate_size"), num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 8192), rope=_parse_rope(raw),
            hidden_act=str(raw.get("hidden_act", "silu")), qkv_bias=bool(raw.get("attention_bias", False)),
            fc_bias=bool(raw.get("bias", False)), vocab_size=vocab, draft_vocab_size=draft_vocab,
            aux_layer_ids=list(ids) if ids is not None else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"))

    @classmethod
    def from_path(cls, path: Path) -> Eagle3Config:
        raw = read_config_json(path, "--draft-model", "an EAGLE-3 checkpoint", "EAGLE-3 drafter")
        return cls.from_dict(raw, path)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(2 * cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.qkv_bias)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x [T, 2H] -> [T, H]; the rows' K/V go to meta.slot_mapping (causal attention over the request)."""
        rotary = self.rotary
        q = qk_norm_rope_kv_write(self.qkv_proj(x), positions, rotary.cos_cache, rotary.sin_cache, self.num_heads,
                                  self.num_kv_heads, self.head_dim, None, None, 0.0, rotary.rotary_dim,
                                  rotary.is_neox_style, kv_cache, meta.slot_mapping)
        out = self.attn.attend(q, kv_cache, meta)
        return self.o_proj(out.view(-1, self.q_size))


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (MLP output, residual stream before it): their sum is the layer's output."""
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), h], dim=-1)
        a, residual = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta), residual)
        return self.mlp(a), residual


class Eagle3DraftModel(nn.Module):
    """fc, the mid layer, the final norm and the draft LM head; `embed_tokens` only when the checkpoint ships
    one (otherwise the target's embedding is passed in). `d2t` is a buffer (draft id -> target id offset)."""

    stacked_params = [
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    ]

    def __init__(self, cfg: Eagle3Config, max_positions: int, own_embedding: bool = False, fc_bias: bool | None = None):
        """fc_bias: whether the checkpoint has `fc.bias` (None: as config.json's `bias` says; the EAGLE repo's own
        loader ignores that field and builds fc without a bias)."""
        super().__init__()
        self.config = cfg
        self.fc = Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias if fc_bias is None else fc_bias)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings)
        self.midlayer = Eagle3MidLayer(cfg, rotary)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Embedding | None = None
        if own_embedding:
            if cfg.vocab_size is None:
                raise ModelLoadError(f"EAGLE-3 drafter {cfg.path} ships embed_tokens but its config.json has no "
                                     "'vocab_size'")
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.has_d2t = False

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        cfg = self.config
        return [KVCacheSpec(cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads)]

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target streams [n, 3 * target_hidden] (low, mid, high) -> the layer's hidden input [n, H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings [T, H] and hidden inputs [T, H] (fc-projected target streams, or the previous step's
        pre-norm output) -> (final-normed hidden for the head, pre-norm output for the next step), both [T, H]."""
        dtype = self.fc.weight.dtype
        m, residual = self.midlayer(positions, embeds.to(dtype), hidden.to(dtype), kv_caches[0], meta)
        return self.norm(m, residual)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """argmax of the draft head, as target token ids [n]."""
        best = self.lm_head(normed).argmax(-1)
        return best + self.d2t[best]

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The published names (`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`; `t2d` is not
        used), with or without a `model.` prefix; vLLM's `layers.0.` spelling of `midlayer.` too."""
        cfg = self.config
        expected_fc = (cfg.hidden_size, 3 * cfg.target_hidden_size)

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model."):
                    name = name[len("model."):]
                if name.startswith("layers.0."):
                    name = "midlayer." + name[len("layers.0."):]
                if name == "t2d":
                    continue
                if name == "d2t":
                    t = tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
                    if tuple(t.shape) != (cfg.draft_vocab_size,):
                        raise ModelLoadError(f"EAGLE-3 drafter {cfg.path}: d2t is {list(t.shape)}, expected "
                                             f"[{cfg.draft_vocab_size}] (draft_vocab_size)")
                    self.d2t.copy_(t.to(torch.long))
                    self.has_d2t = True
                    continue
                if name == "embed_tokens.weight" and self.embed_tokens is None:
                    continue
                if name == "fc.weight" and tuple(tensor.shape) != expected_fc:
                    raise ModelLoadError(
                        f"EAGLE-3 drafter {cfg.path}: fc.weight is {list(tensor.shape)}, expected "
                        f"[{expected_fc[0]}, {expected_fc[1]}] (three target layers of hidden size "
                        f"{cfg.target_hidden_size})")
                yield name, tensor

        load_named_weights(self, renamed(), self.stacked_params, skip_suffixes=("rotary_emb.inv_freq",))
