"""Multi-head latent attention (DeepSeek-V2/V3): a paged cache of one latent row per token, and absorbed
attention over it for every kind of step.

Per token the cache keeps only [c | k_pe]: the normalized KV latent (kv_lora_rank values) and the roped
shared rope key (qk_rope_head_dim values), 576 values for DeepSeek-V3, never per-head K/V. Every query
row (a prefill chunk over a cached prefix, a decode, a speculative verify row) attends over its
request's cached rows with the absorbed formulation: the nope query is mapped into latent space through
W_UK (the k half of kv_b_proj), scores are q_lat . c + q_pe . k_pe, the weighted latents are mapped to
per-head values through W_UV (the v half), then o_proj. The step writes its own rows first, so a prefix
served from the prefix cache is attended exactly like one computed in this step.
Spec: ../shared/specs/mla-mtp-dsa-longcat.md sections 1.2-1.8.

Tensor parallelism splits the heads (q_proj / q_b_proj and kv_b_proj column-parallel, o_proj
row-parallel) and replicates the latent projections and the latent cache on every rank: the latent
row is shared by all heads (one "KV head"), so each rank needs all of it, as GQA ranks share a KV head
when there are fewer KV heads than ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from atlas.config import RopeConfig
from atlas.kernels.fused_ops import mla_prologue
from atlas.kernels.mla_attention import mla_attention
from atlas.layers.attention import AttentionMetadata, CacheSpec
from atlas.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear, plain_weight
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding, yarn_mscale


@dataclass(frozen=True)
class MLACacheSpec(CacheSpec):
    """One latent row of kv_lora_rank + rope_dim values per token, layout [pages, block, Lkv + R],
    read by kernels/mla_attention*.py; num_heads query heads share it (MQA). In an 8-bit cache the row is
    stored as it is, each value rounded (write_latent_cache) and widened where it is read."""

    kv_lora_rank: int
    rope_dim: int
    num_heads: int
    no_8bit_path: ClassVar[str | None] = None

    def values_per_token(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def cache_shape(self, num_pages: int, block_size: int) -> tuple[int, ...]:
        return (num_pages, block_size, self.kv_lora_rank + self.rope_dim)

    @property
    def program_heads(self) -> tuple[int, int]:
        return (self.num_heads, 1)


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    rope_interleave: bool  # rope dims stored as adjacent pairs (the DeepSeek checkpoints)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_softmax_scale(cfg: MLAConfig, rope: RopeConfig) -> float:
    """(P + R)^-0.5, times mscale^2 with mscale = yarn_mscale(factor, mscale_all_dim) when the rope is
    scaled and mscale_all_dim is set (spec 1.3; as transformers' yarn_apply_mscale)."""
    scale = cfg.qk_head_dim ** -0.5
    p = rope.params
    if rope.rope_type != "default" and p.get("mscale_all_dim"):
        m = yarn_mscale(p["factor"], p["mscale_all_dim"])
        scale *= m * m
    return scale


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLAConfig, rotary: RotaryEmbedding, scale: float, reduce: bool = True):
        """reduce=False: under tensor parallelism the output is this rank's partial sum."""
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_heads, cfg.hidden_size
        tp = current().tp_size
        if h % tp:
            raise ValueError(f"{h} attention heads are not divisible by the tensor-parallel size {tp}")
        self.num_heads = h // tp  # this rank's heads
        kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            # q_a_proj and kv_a_proj_with_mqa read the same input: one matmul.
            self.fused_qkv_a_proj = MergedLinear(d, {"q": cfg.q_lora_rank, "kv": kv_a}, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, h * cfg.qk_head_dim)
        elif not cfg.attention_bias:
            # q_proj and kv_a_proj_with_mqa read the same input: one matmul (q's rows split over the ranks, kv_a's
            # whole on every rank), as fused_qkv_a_proj is with q_lora; a decode step's layer launches one GEMV less.
            q_rows = self.num_heads * cfg.qk_head_dim
            sources = {"q": (current().tp_rank * q_rows, h * cfg.qk_head_dim)} if tp > 1 else None
            self.fused_q_kv_a_proj = MergedLinear(d, {"q": q_rows, "kv": kv_a}, sources=sources)
        else:  # (kv_a has a bias and q_proj none: apart)
            self.q_proj = ColumnParallelLinear(d, h * cfg.qk_head_dim)
            self.kv_a_proj_with_mqa = Linear(d, kv_a, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        with plain_weight():  # (absorbed: attention reads its weight whole, absorbed_weights)
            self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = RowParallelLinear(h * cfg.v_head_dim, d, bias=cfg.attention_bias, reduce=reduce)
        self.rotary = rotary
        self.scale = scale

    def cache_spec(self) -> MLACacheSpec:
        return MLACacheSpec(self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim, self.num_heads)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, P, Lkv], W_UV [H, V, Lkv]): views of kv_b_proj's weight, whose rows are per head
        [k_nope P | v V]."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (q [T, H * (P + R)], each head's nope then rope dims; kv_a [T, Lkv + R], the latent then the
        shared rope key), before any norm or RoPE."""
        cfg = self.cfg
        if cfg.q_lora_rank:
            q_a, kv_a = self.fused_qkv_a_proj(x).split([cfg.q_lora_rank, self.fused_qkv_a_proj.out_features
                                                        - cfg.q_lora_rank], dim=-1)
            return self.q_b_proj(self.q_a_layernorm(q_a)), kv_a
        if not cfg.attention_bias:  # (q | kv_a in one projection: __init__'s layout)
            q, kv_a = self.fused_q_kv_a_proj(x).split([self.num_heads * cfg.qk_head_dim,
                                                       cfg.kv_lora_rank + cfg.qk_rope_head_dim], dim=-1)
            return q, kv_a
        return self.q_proj(x), self.kv_a_proj_with_mqa(x)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        q, kv_a = self.projections(x)
        # kv_a_layernorm on the latent, RoPE on q_pe and k_pe, the step's rows into the cache: one launch on CUDA
        q_pe = mla_prologue(q, kv_a, positions, self.rotary.cos_cache, self.rotary.sin_cache,
                            self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, self.num_heads, cfg.qk_nope_head_dim,
                            self.rotary.rotary_dim, self.rotary.is_neox_style, kv_cache, meta.slot_mapping)
        q_nope = q.reshape(t, self.num_heads, cfg.qk_head_dim)[..., : cfg.qk_nope_head_dim]
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, Lkv]
        o_latent = mla_attention(q_latent, q_pe, kv_cache, meta, self.scale)
        out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, V]
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], self.num_heads * cfg.v_head_dim))
