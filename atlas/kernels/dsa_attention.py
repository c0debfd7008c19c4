"""DeepSeek sparse attention over the paged latent cache: the Triton kernels (kernels/dsa_attention_triton.py)
on CUDA (decode steps split each row's selected rows over more programs, as MLA's split-KV), the PyTorch
reference (kernels/dsa_attention_ref.py) elsewhere. Both compute the same function and
select the same keys for the same scores; tests compare them case by case (tests/dsa_attention_cases.py).

The two paths record a step's selections for GLM-5's shared layers in different forms (the reference: one mask
per (request, query block); Triton: one [T, K] index tensor), so a shared layer must take the path its full
layer took: both follow `use_triton`, which depends only on the device and the model's latent width, the same
for every layer.
"""

from __future__ import annotations

import logging

import torch

from atlas.kernels import triton_available
from atlas.kernels.dsa_attention_ref import dsa_attention_ref
from atlas.kernels.mla_attention import decode_splits

logger = logging.getLogger(__name__)
_logged_cuda = False

# As kernels/mla_attention.py: the kernel keeps a [heads, kv_lora_rank] accumulator per program.
MAX_TRITON_LATENT = 1024


def use_triton(q_latent: torch.Tensor) -> bool:
    return q_latent.is_cuda and q_latent.shape[-1] <= MAX_TRITON_LATENT and triton_available()


def dsa_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, q_idx: torch.Tensor | None,
                  w_idx: torch.Tensor | None, cache: torch.Tensor, meta, scale: float, index_topk: int,
                  index_scale: float, record: list[torch.Tensor] | None = None,
                  reuse: list[torch.Tensor] | None = None) -> torch.Tensor:
    """o_latent [T, H, Lkv] for the step `meta` (AttentionMetadata) describes: dsa_attention_ref's arguments,
    the step's lengths and tables from `meta` (its device tensors on the Triton path, its host lists
    elsewhere)."""
    global _logged_cuda
    if not use_triton(q_latent):
        if q_latent.is_cuda and not _logged_cuda:
            _logged_cuda = True
            logger.warning("DeepSeek sparse attention runs its exact PyTorch reference on CUDA (triton is "
                           "not installed, or the latent is wider than the kernel's): correct, not fast")
        return dsa_attention_ref(q_latent, q_pe, q_idx, w_idx, cache, meta.query_start_loc_cpu,
                                 meta.seq_lens_cpu, meta.page_tables, scale, index_topk, index_scale,
                                 record=record, reuse=reuse)
    from atlas.kernels.dsa_attention_triton import dsa_attention_triton

    # (a program a query row; the interpreter's model tests run this path on the CPU, unsplit)
    splits, scratch = decode_splits(meta, q_latent, q_latent.shape[0])
    return dsa_attention_triton(q_latent, q_pe, q_idx, w_idx, cache, meta.query_start_loc, meta.seq_lens,
                                meta.page_tables, meta.max_seq_len, scale, index_topk, index_scale,
                                record=record, reuse=reuse, num_splits=splits, scratch=scratch)
