"""Absorbed MLA attention over the paged latent cache: the Triton kernel on CUDA, the PyTorch reference
elsewhere. Both compute the same function; tests compare them case by case."""

from __future__ import annotations

import torch

from atlas.kernels import triton_available
from atlas.kernels.mla_attention_ref import mla_attention_ref
from atlas.kernels.paged_attention import (
    SPLIT_MAX_QUERY_LEN,
    block_shape,
    num_kv_splits,
    sm_count,
    split_kv_enabled,
    step_programs,
    step_split_scratch,
)

MAX_HEADS_PER_PROGRAM = 64  # (kernels/mla_attention_triton.py's; not imported: that module needs triton)

# The kernel keeps a [rows, kv_lora_rank] accumulator per program; wider latents use the reference.
MAX_TRITON_LATENT = 1024


def use_triton(q_latent: torch.Tensor) -> bool:
    return q_latent.is_cuda and q_latent.shape[-1] <= MAX_TRITON_LATENT and triton_available()


def decode_splits(meta, q_latent: torch.Tensor, num_programs: int
                  ) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Split-KV of a latent-attention step on CUDA (MLA's, and DSA's over each row's selected rows): decode steps
    only; `num_programs` query programs, each in head blocks of the kernels' widest tile, so that only the batch
    size fixes the split count. -> (splits, the step's float32 partials or None)."""
    num_tokens, num_heads, latent = q_latent.shape
    if not (q_latent.is_cuda and meta.max_query_len <= SPLIT_MAX_QUERY_LEN and split_kv_enabled()):
        return 1, None
    head_blocks = -(-num_heads // MAX_HEADS_PER_PROGRAM)
    splits = num_kv_splits(num_programs * head_blocks, 1, sm_count(q_latent.device.index or 0))
    if splits == 1:
        return 1, None
    return splits, step_split_scratch(meta, num_tokens, num_heads, latent, splits, q_latent.device)


def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """q_latent [T, H, Lkv], q_pe [T, H, R] -> o_latent [T, H, Lkv] for the step `meta` (AttentionMetadata)
    describes: every query row attends causally over its request's cached latent rows."""
    if not use_triton(q_latent):
        return mla_attention_ref(q_latent, q_pe, cache, meta.query_start_loc_cpu, meta.seq_lens_cpu,
                                 meta.page_tables, scale)
    from atlas.kernels.mla_attention_triton import mla_attention_triton

    # One key head: the program map packs query rows as GQA with H heads per key head does.
    block_q, _ = block_shape(q_latent.shape[1], 1, meta.max_query_len)
    programs = step_programs(meta, block_q, q_latent.device)
    splits, scratch = decode_splits(meta, q_latent, programs.num_programs)
    return mla_attention_triton(q_latent, q_pe, cache, meta.query_start_loc, meta.seq_lens, meta.page_tables,
                                programs.req, programs.q0, block_q, scale, num_splits=splits, scratch=scratch)
