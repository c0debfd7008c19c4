"""Cohere's Command models: CohereForCausalLM (Command R, R+; model_type cohere) and Cohere2ForCausalLM (Command A,
Command R7B; model_type cohere2). Model math only, as transformers' Cohere / Cohere2 compute it:

- a parallel block: one LayerNorm, then attention and the SwiGLU MLP both read it and add to the residual stream
  (x + attn(ln(x)) + mlp(ln(x)));
- Cohere's LayerNorm: mean-centred, no bias, in float32 with the weight applied before the cast back;
- RoPE on interleaved pairs; Cohere2's layers by `layer_types` (every sliding_window_pattern-th one, 4, global):
  the sliding ones rotate and see `sliding_window` keys back, the global ones take no RoPE;
- Command R+'s use_qk_norm: a LayerNorm of each head of q and of k, with a weight per head;
- the logits scaled by logit_scale; the LM head tied to the embedding (tie_word_embeddings, true by default).

Under tensor parallelism the attention's and the MLP's partial sums are added and all-reduced once; the per-head q / k
norm weights are split with their heads.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError
from atlas.kernels.fused_ops import qk_norm_rope_kv_write
from atlas.layers.attention import AttentionMetadata, PagedAttention
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import QKVParallelLinear, RowParallelLinear, kv_heads_of_rank, sharded_loader
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import make_layers
from atlas.models.llama import LlamaForCausalLM, LlamaMLP

SLIDING, FULL = "sliding_attention", "full_attention"


class CohereLayerNorm(nn.Module):
    """Mean-centred LayerNorm without a bias over the last dim (`shape` may be [heads, head_dim]: a weight a head),
    computed in float32. With a residual: (norm(x + residual), x + residual), the Llama norms' protocol."""

    def __init__(self, shape: int | tuple[int, ...], eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce=None, quantize_for=None):
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        out = (self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)
        return out if residual is None else (out, x)


def cohere_layer_types(cfg: ModelConfig) -> list[str]:
    """Cohere2's `layer_types`, or every sliding_window_pattern-th layer global (Cohere: every layer global)."""
    if cfg.raw.get("model_type") != "cohere2":
        return [FULL] * cfg.num_hidden_layers
    types = cfg.raw.get("layer_types")
    if types is None:
        pattern = cfg.raw.get("sliding_window_pattern") or 4
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_hidden_layers)]
    if len(types) != cfg.num_hidden_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} layer_types must give "
                             f"{cfg.num_hidden_layers} entries of {SLIDING!r} or {FULL!r}, got {types!r}")
    return list(types)


class CohereAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, window: int | None, rotary: RotaryEmbedding):
        super().__init__()
        mp = current()
        self.head_dim, self.layer_idx = cfg.head_dim, layer_idx
        bias = bool(cfg.raw.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=bias,
                                        reduce=False)
        self.q_norm = self.k_norm = None
        if cfg.raw.get("use_qk_norm"):
            eps = float(cfg.raw.get("layer_norm_eps", 1e-5))
            self.q_norm = CohereLayerNorm((self.num_heads, self.head_dim), eps)
            self.k_norm = CohereLayerNorm((self.num_kv_heads, self.head_dim), eps)
            if mp.tp_size > 1:
                _, first_kv = kv_heads_of_rank(cfg.num_key_value_heads, mp)
                self.q_norm.weight.weight_loader = sharded_loader(0, mp.tp_rank, cfg.num_attention_heads)
                self.k_norm.weight.weight_loader = sharded_loader(0, first_kv // self.num_kv_heads,
                                                                   cfg.num_key_value_heads)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5,
                                   sliding_window=window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """-> this rank's partial sum of the output projection."""
        if meta.windowed is not None:  # (KV cache groups: a sliding layer reads and writes its group's pages)
            meta = meta.for_layer(self.attn.sliding_window)
        rows, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = self.q_norm(q.reshape(rows, hq, d)).reshape(rows, hq * d)
            k = self.k_norm(k.reshape(rows, hkv, d)).reshape(rows, hkv * d)
            qkv = torch.cat([q, k, v], dim=-1)
        rotary = self.rotary
        q = qk_norm_rope_kv_write(qkv, positions, rotary.cos_cache, rotary.sin_cache, hq, hkv, d, None, None, 0.0,
                                  rotary.rotary_dim, rotary.is_neox_style, kv_cache, meta.slot_mapping)
        return self.o_proj(self.attn.attend(q, kv_cache, meta).view(-1, hq * d))


class CohereDecoderLayer(nn.Module):
    output_partial = False  # (LlamaForCausalLM.forward's protocol: the output is reduced)

    def __init__(self, cfg: ModelConfig, layer_idx: int, window: int | None, rotary: RotaryEmbedding):
        super().__init__()
        self.mp = current()
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, float(cfg.raw.get("layer_norm_eps", 1e-5)))
        self.self_attn = CohereAttention(cfg, layer_idx, window, rotary)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.raw.get("hidden_act", "silu"), bias=False,
                            reduce=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata, x_partial: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous block's output, the stream before it) -> (this block's attention + MLP output, the stream
        before it): the stream after the block is their sum."""
        stream = x if residual is None else x + residual
        h = self.input_layernorm(stream)
        out = self.self_attn(positions, h, kv_cache, meta) + self.mlp(h)
        return self.mp.all_reduce(out), stream


class CohereModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        types = cohere_layer_types(cfg)
        window = cfg.raw.get("sliding_window")
        if SLIDING in types and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} field 'sliding_window' must be a "
                                 f"positive integer, got {window!r}")
        self.windows = [window if t == SLIDING else None for t in types]
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings,
                                 is_neox_style=False)
        # (Cohere2's global layers take no RoPE: the identity tables, one for all of them)
        ropes = {SLIDING: rotary, FULL: rotary.identity() if cfg.raw.get("model_type") == "cohere2" else rotary}
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: CohereDecoderLayer(
            cfg, i, self.windows[i], ropes[types[i]]))
        self.norm = CohereLayerNorm(cfg.hidden_size, float(cfg.raw.get("layer_norm_eps", 1e-5)))
        self.mp = current()


class CohereForCausalLM(LlamaForCausalLM):
    """Llama's forward loop, weight routing and cache specs over Cohere's blocks (module docstring). LoRA adapters
    and FP8 checkpoints are refused (neither is tested over the parallel block)."""

    supports_pooling = False
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, max_positions: int):
        nn.Module.__init__(self)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=bool(cfg.raw.get("tie_word_embeddings", True)))
        self.config = cfg
        self.model = CohereModel(cfg, max_positions)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)
        scale = cfg.raw.get("logit_scale", 0.0625)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} field 'logit_scale' must be a "
                                 f"number, got {scale!r}")
        self.logit_scale = float(scale)
        self.score = None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's logits times logit_scale (in the model dtype, as transformers' Cohere)."""
        return self.lm_head(hidden, out=out).mul_(self.logit_scale)

    def vocab_weight_names(self) -> tuple[str, str] | None:
        return None  # (the logits are scaled: not the plain product)
