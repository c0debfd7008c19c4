"""DeepSeek-V4 attention (transformers' deepseek_v4: DeepseekV4Attention and its compressors): shared-KV MQA with
a sliding-window branch and, per layer type, a compressed branch.

Every layer: q = RMS(wq_b(q_norm(wq_a(x)))) per head (unweighted RMS), k = v = norm(wkv(x)) (one head of head_dim);
RoPE (interleaved pairs) on the last rope_dim dims of each; softmax(q . k * head_dim^-0.5) with a learnable sink
per head, over the keys below; the output's rope dims rotated back by the query's position (the value carried the
key's rotation); the grouped output projection wo_a (o_groups blocks of heads, each to o_lora_rank) then wo_b.
- sliding_attention: the last `sliding_window` tokens' rows only ("main" RoPE, rope_theta).
- heavily_compressed_attention (HCA, rate m'): plus one compressed row per closed window of m' tokens:
  norm(sum_j softmax_j(wgate(x_j) + ape_j) * wkv(x_j)) (softmax per channel over the window), roped at the
  window's first position ("compress" RoPE, compress_rope_theta, YaRN where configured; so are the layer's q/k).
- compressed_sparse_attention (CSA, rate m): windows of m with two series per token (wkv / wgate give 2 x
  head_dim): compressed row w pools the previous window's first halves and its own second halves over 2m slots;
  plus a lightning indexer with its own such compressor at index_head_dim, whose per-query scores
  sum_h w_h * ReLU(q_h . k) * index_head_dim^-0.5 (q = indexer.wq_b(q_norm output), roped; w =
  weights_proj(x) * index_n_heads^-0.5) keep the top index_topk visible compressed rows.

The cache (DSV4CacheSpec) keeps per token, in one paged row: the key row; for a compressed layer the compressed
row of the window this token closes (written when the token closing it is computed: the slot of position
(w + 1) * m - 1) and this token's projected wkv / wgate outputs (what transformers buffers until a window
closes; kept per token, so a window whose tokens came in earlier steps, chunks or a prefix-cache hit pools from
the cache); for CSA the indexer's compressed key and projections likewise. Every value is a function of the
token prefix up to its position, so chunked prefill, preemption, prefix caching and speculative verify (a
rejected row is rewritten with its position) read what transformers computes. Nothing is released with the
window: the compressed rows live in every page.

Under tensor parallelism nothing here is sharded (transformers keeps V4's attention replicated too); the model
refuses tp > 1. Attention math: kernels/dsv4_attention_ref.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from atlas.kernels.dsv4_attention_ref import dsv4_attention_ref, pool_windows, slots_of
from atlas.kernels.fused_ops import apply_rope
from atlas.layers.attention import AttentionMetadata, CacheSpec
from atlas.layers.linear import Linear
from atlas.layers.norm import Float32RMSNorm
from atlas.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)
_logged_cuda = False

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class DSV4CacheSpec(CacheSpec):
    """One row per token: [key D | compressed D | wkv s*D | wgate s*D | index key Di | index wkv 2Di | index wgate
    2Di] (s = 2 for CSA, 1 for HCA; a sliding layer keeps the key only), layout [pages, block, width]."""

    head_dim: int
    num_heads: int
    compress_rate: int = 0
    overlap: bool = False
    index_head_dim: int = 0
    no_8bit_path: ClassVar[str | None] = ("DeepSeek-V4: keys beside compressed keys and the compressors' kv and gate "
                                          "inputs; not implemented in 8 bits")

    def offsets(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, width) of each part of a row."""
        d, parts = self.head_dim, [("key", self.head_dim)]
        if self.compress_rate:
            s = 2 if self.overlap else 1
            parts += [("entry", d), ("wkv", s * d), ("wgate", s * d)]
            if self.index_head_dim:
                di = self.index_head_dim
                parts += [("index_entry", di), ("index_wkv", 2 * di), ("index_wgate", 2 * di)]
        out, at = {}, 0
        for name, width in parts:
            out[name] = (at, width)
            at += width
        return out

    def values_per_token(self) -> int:
        return sum(w for _, w in self.offsets().values())

    def cache_shape(self, num_pages: int, block_size: int) -> tuple[int, ...]:
        return (num_pages, block_size, self.values_per_token())

    @property
    def program_heads(self) -> tuple[int, int]:
        return (self.num_heads, 1)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4UnweightedRMSNorm: x * rsqrt(mean(x^2) + eps), the factor in float32 cast to x's
    dtype before the product."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_tail(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor, inverse: bool = False
              ) -> torch.Tensor:
    """Interleaved RoPE on the last rotary.rotary_dim dims of x [T, H, D] at positions [T] (V4 lays a head out as
    [nope | rope]); inverse: rotate back (-sin), as transformers does to the attention output."""
    r = rotary.rotary_dim
    cos = rotary.cos_cache[positions].unsqueeze(1).to(x.dtype)
    sin = rotary.sin_cache[positions].unsqueeze(1).to(x.dtype)
    rotated = apply_rope(x[..., -r:], cos, -sin if inverse else sin, r, False)
    return torch.cat([x[..., :-r], rotated], dim=-1)


class Compressor(nn.Module):
    """Checkpoint names `compressor.{wkv,wgate,ape,norm}` (the indexer's under `indexer.compressor.`)."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        s = 2 if overlap else 1
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.wkv = Linear(hidden_size, s * head_dim)
        self.wgate = Linear(hidden_size, s * head_dim)
        self.ape = nn.Parameter(torch.zeros(rate, s * head_dim, dtype=torch.float32))
        self.norm = Float32RMSNorm(head_dim, eps)

    def write_and_pool(self, x: torch.Tensor, flat: torch.Tensor, slot_mapping: torch.Tensor, parts: tuple,
                       close: tuple, rotary: RotaryEmbedding) -> None:
        """Write this step's projections at their slots, then the compressed row of every window a row of this
        step closes. parts: the (offset, width) of (compressed row, wkv, wgate) in the cache row; close: (rows
        that close a window, the slots of its tokens [N, S], has_prev [N] or None, the windows' first positions)."""
        (entry, d), (kv_at, kv_w), (gate_at, gate_w) = parts
        flat[slot_mapping, kv_at: kv_at + kv_w] = self.wkv(x).to(flat.dtype)
        flat[slot_mapping, gate_at: gate_at + gate_w] = self.wgate(x).to(flat.dtype)
        rows, slots, has_prev, first_pos = close
        if rows.numel() == 0:
            return
        src = flat[slots]  # [N, S, width]
        pooled = pool_windows(src[..., kv_at: kv_at + kv_w], src[..., gate_at: gate_at + gate_w], self.ape,
                              self.overlap, has_prev)
        pooled = rope_tail(rotary, first_pos, self.norm(pooled).unsqueeze(1))[:, 0]
        flat[slot_mapping[rows], entry: entry + d] = pooled.to(flat.dtype)


class Indexer(nn.Module):
    """Checkpoint names `indexer.{wq_b,weights_proj,compressor.*}`."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, rate: int,
                 eps: float):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim)
        self.weights_proj = Linear(hidden_size, n_heads)
        self.compressor = Compressor(hidden_size, head_dim, rate, True, eps)


class DSV4Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, q_lora_rank: int, o_groups: int,
                 o_lora_rank: int, eps: float, layer_type: str, window: int, rate: int, rotary: RotaryEmbedding,
                 index: tuple[int, int, int] | None = None):
        """index: (index_n_heads, index_head_dim, index_topk) of a CSA layer."""
        super().__init__()
        if num_heads % o_groups:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by o_groups {o_groups}")
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps
        self.layer_type, self.window, self.rotary = layer_type, window, rotary
        self.rate = rate if layer_type != SLIDING else 0
        self.o_groups, self.o_lora_rank = o_groups, o_lora_rank
        self.scale = head_dim ** -0.5
        self.wq_a = Linear(hidden_size, q_lora_rank)
        self.q_norm = Float32RMSNorm(q_lora_rank, eps)
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim)
        self.wkv = Linear(hidden_size, head_dim)
        self.norm = Float32RMSNorm(head_dim, eps)
        self.wo_a = Linear(num_heads * head_dim // o_groups, o_groups * o_lora_rank)
        self.wo_b = Linear(o_groups * o_lora_rank, hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        self.compressor = (Compressor(hidden_size, head_dim, self.rate, layer_type == CSA, eps)
                           if self.rate else None)
        self.indexer = None
        if layer_type == CSA:
            n, di, topk = index
            self.indexer = Indexer(hidden_size, q_lora_rank, n, di, topk, self.rate, eps)

    def cache_spec(self) -> DSV4CacheSpec:
        return DSV4CacheSpec(self.head_dim, self.num_heads, self.rate, self.layer_type == CSA,
                             self.indexer.head_dim if self.indexer is not None else 0)

    def _closing(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple:
        """The rows of this step that close a window, the slots of the tokens each pools (with CSA's overlap,
        the previous window's then its own), whether there is a previous window, and the window's first
        position."""
        m = self.rate
        rows = torch.nonzero((positions + 1) % m == 0).flatten()
        q_lens = torch.tensor(meta.query_start_loc_cpu, device=positions.device).diff()
        req = torch.repeat_interleave(torch.arange(len(q_lens), device=positions.device), q_lens)[rows]
        end = positions[rows]
        span = 2 * m if self.layer_type == CSA else m
        pos = end[:, None] - span + 1 + torch.arange(span, device=positions.device)
        has_prev = (pos[:, 0] >= 0) if self.layer_type == CSA else None
        slots = slots_of(meta.page_tables, req[:, None], pos.clamp(min=0), meta.block_size)
        return rows, slots, has_prev, end - m + 1

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        global _logged_cuda
        t = x.shape[0]
        spec = self.cache_spec()
        at = spec.offsets()
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        slot_mapping = meta.slot_mapping
        q_resid = self.q_norm(self.wq_a(x))
        q = unweighted_rms(self.wq_b(q_resid).view(t, self.num_heads, self.head_dim), self.eps)
        q = rope_tail(self.rotary, positions, q)
        kv = rope_tail(self.rotary, positions, self.norm(self.wkv(x)).unsqueeze(1))[:, 0]
        flat[slot_mapping, : self.head_dim] = kv.to(flat.dtype)
        q_idx = w_idx = None
        if self.compressor is not None:
            close = self._closing(positions, meta)
            self.compressor.write_and_pool(x, flat, slot_mapping, (at["entry"], at["wkv"], at["wgate"]), close,
                                           self.rotary)
            if self.indexer is not None:
                ix = self.indexer
                ix.compressor.write_and_pool(x, flat, slot_mapping,
                                             (at["index_entry"], at["index_wkv"], at["index_wgate"]), close,
                                             self.rotary)
                q_idx = rope_tail(self.rotary, positions, ix.wq_b(q_resid).view(t, ix.n_heads, ix.head_dim))
                w_idx = ix.weights_proj(x).float() * ix.n_heads ** -0.5
        if kv_cache.is_cuda and not _logged_cuda:
            _logged_cuda = True
            logger.warning("DeepSeek-V4 attention runs its exact PyTorch reference on CUDA (no Triton kernel yet): "
                           "correct, not fast")
        o = dsv4_attention_ref(
            q, kv_cache, meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.page_tables, self.attn_sink, self.scale,
            self.window, self.rate, at["entry"][0] if self.rate else 0, q_idx, w_idx,
            at["index_entry"][0] if self.indexer is not None else 0, self.indexer.topk if self.indexer else 0,
            self.indexer.head_dim ** -0.5 if self.indexer is not None else 1.0)
        o = rope_tail(self.rotary, positions, o, inverse=True)
        # Grouped output projection: group g's heads (a block of num_heads / o_groups) through rows
        # g * o_lora_rank .. of wo_a.
        grouped = o.reshape(t, self.o_groups, -1)
        w = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        mid = torch.einsum("tgi,goi->tgo", grouped, w.to(grouped.dtype)).reshape(t, -1)
        return self.wo_b(mid)
