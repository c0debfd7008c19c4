"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): MLA whose every query attends only over the index_topk
latent rows a lightning indexer selects for it.

The indexer (per layer, weights under `self_attn.indexer.`): a query of index_n_heads x index_head_dim
from the MLA's q_a_layernorm output (wq_b), one key per token from the attention input (wk, then a
LayerNorm with bias, eps 1e-6), RoPE on the first qk_rope_head_dim dims of both (rotate-half, unlike the
main MLA's interleaved pairs, with the same cos/sin tables), and per-head weights weights_proj(x) *
index_n_heads^-0.5. Scores and top-k: kernels/dsa_attention_ref.py (the CPU's path),
kernels/dsa_attention_triton.py (CUDA's, with triton: the same function and the same selected keys, from the
step's device tensors), chosen by kernels/dsa_attention.py.

The key is cached per token in the same paged row as the latent ([c | k_pe | k_idx], DSACacheSpec), so
one page table, one memory plan and one prefix-cache hit cover both: a chunk over a cached prefix, a
decode and a verify row score against the indexer keys of every earlier token from the cache.

GLM-5 (glm_moe_dsa) is the same layer with two settings: its indexer ropes interleaved pairs (the
index_rotary it is handed) and its layer pattern (indexer_types): a "full" layer indexes, a "shared" layer has
no indexer and attends over the rows the last full layer before it selected for the same queries in the
same step (TopkShare); a shared layer's cache row is the plain MLA latent row.

Under tensor parallelism the indexer is replicated (it is small and its top-k is per token, not per head).
Spec: ../shared/specs/mla-mtp-dsa-longcat.md section 4, checked against transformers' DeepseekV32Indexer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from atlas.kernels.dsa_attention import dsa_attention
from atlas.kernels.mla_attention_ref import write_latent_cache
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear import Linear
from atlas.layers.mla import MLAAttention, MLACacheSpec, MLAConfig
from atlas.layers.rotary import RotaryEmbedding

INDEXER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DSAConfig:
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rope_interleave: bool = False  # the indexer's RoPE: rotate-half (V3.2) or interleaved pairs (GLM-5)


@dataclass(frozen=True)
class DSACacheSpec(MLACacheSpec):
    """An MLA latent row followed by the indexer key: layout [pages, block, Lkv + R + index_head_dim]."""

    index_head_dim: int = 0
    # (an 8-bit cache rounds the indexer key with the rest of the row: the top-k is chosen over the rounded keys)
    no_8bit_path: ClassVar[str | None] = None

    def values_per_token(self) -> int:
        return self.kv_lora_rank + self.rope_dim + self.index_head_dim

    def cache_shape(self, num_pages: int, block_size: int) -> tuple[int, ...]:
        return (num_pages, block_size, self.values_per_token())


class IndexerLayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = INDEXER_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class TopkShare:
    """The selections a full DSA layer hands to the shared layers after it in the same forward (the
    attention's `record` / `reuse`): on the reference path per (request, query block) the selected-key mask,
    on the Triton path one [T, K] tensor of selected positions (-1 padded); full and shared layers take the
    same path (the predicate depends on the device and the latent width only). Every full layer of a model
    with shared layers overwrites it, so a shared layer always reads its own step's last full layer."""

    def __init__(self) -> None:
        self.selected: list[torch.Tensor] | None = None


class Indexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, cfg: DSAConfig, rope_dim: int, rotary: RotaryEmbedding):
        super().__init__()
        if rope_dim > cfg.index_head_dim:
            raise ValueError(f"qk_rope_head_dim {rope_dim} exceeds index_head_dim {cfg.index_head_dim}")
        self.cfg, self.rope_dim, self.rotary = cfg, rope_dim, rotary
        self.wq_b = Linear(q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.wk = Linear(hidden_size, cfg.index_head_dim)
        self.k_norm = IndexerLayerNorm(cfg.index_head_dim)
        self.weights_proj = Linear(hidden_size, cfg.index_n_heads)
        self.scale = cfg.index_head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] (the attention input), q_resid [T, Lq] -> (q [T, Hi, Di], k [T, Di], w [T, Hi] float32),
        q and k roped on their first rope_dim dims."""
        t, cfg, r = x.shape[0], self.cfg, self.rope_dim
        q = self.wq_b(q_resid).view(t, cfg.index_n_heads, cfg.index_head_dim)
        k = self.k_norm(self.wk(x)).view(t, 1, cfg.index_head_dim)
        q_rot, k_rot = self.rotary(positions, q[..., :r].contiguous(), k[..., :r].contiguous())
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot, k[..., r:]], dim=-1)[:, 0]
        w = self.weights_proj(x).float() * cfg.index_n_heads ** -0.5
        return q, k, w


class DSAAttention(MLAAttention):
    def __init__(self, cfg: MLAConfig, dsa: DSAConfig, rotary: RotaryEmbedding, index_rotary: RotaryEmbedding,
                 scale: float, reduce: bool = True, shared: bool = False, share: TopkShare | None = None):
        """shared: no indexer of its own, the selection of the last full layer (through `share`, which full
        layers fill when given one)."""
        super().__init__(cfg, rotary, scale, reduce=reduce)
        if not cfg.q_lora_rank:
            raise ValueError("DeepSeek sparse attention needs q_lora_rank (its indexer reads the q_a_layernorm output)")
        if shared and share is None:
            raise ValueError("a shared DSA layer needs the TopkShare its full layers fill")
        self.dsa, self.shared, self.share = dsa, shared, share
        # (set by the model from its layer pattern: a full layer records only for a shared layer right after it;
        #  the last shared layer of a run drops the selections, so none outlive the step)
        self.records, self.releases = share is not None and not shared, shared
        self.indexer = None if shared else Indexer(cfg.hidden_size, cfg.q_lora_rank, dsa, cfg.qk_rope_head_dim,
                                                   index_rotary)

    def cache_spec(self) -> MLACacheSpec:
        if self.shared:
            return super().cache_spec()
        return DSACacheSpec(self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim, self.num_heads, self.dsa.index_head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        q_a, kv_a = self.fused_qkv_a_proj(x).split([cfg.q_lora_rank, self.fused_qkv_a_proj.out_features
                                                    - cfg.q_lora_rank], dim=-1)
        q_resid = self.q_a_layernorm(q_a)
        q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(t, self.num_heads, cfg.qk_head_dim).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim],
                                                                        dim=-1)
        c, k_pe = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.reshape(t, 1, cfg.qk_rope_head_dim))
        record = reuse = None
        if self.shared:
            q_idx = w_idx = None
            reuse = self.share.selected
            if reuse is None:
                raise RuntimeError("a shared DSA layer ran before any full layer of its step")
            write_latent_cache(kv_cache, c, k_pe[:, 0], meta.slot_mapping)
            if self.releases:
                self.share.selected = None
        else:
            q_idx, k_idx, w_idx = self.indexer(positions, x, q_resid)
            write_latent_cache(kv_cache, c, torch.cat([k_pe[:, 0], k_idx.to(k_pe.dtype)], dim=-1),
                               meta.slot_mapping)
            if self.records:
                record = self.share.selected = []
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, Lkv]
        # (Triton kernels from the step's device tensors on CUDA, the reference from its host lists elsewhere)
        o_latent = dsa_attention(q_latent, q_pe, q_idx, w_idx, kv_cache, meta, self.scale,
                                 self.dsa.index_topk, self.dsa.index_head_dim ** -0.5, record=record,
                                 reuse=reuse)
        out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, V]
        return self.o_proj(out.transpose(0, 1).reshape(t, self.num_heads * cfg.v_head_dim))
