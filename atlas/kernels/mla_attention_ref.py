"""PyTorch reference of absorbed MLA attention over the paged latent cache. Runs on CPU and CUDA.

This is the numerical reference the Triton kernel (kernels/mla_attention_triton.py) is tested
against, and the path CPU runs use. Format and formulas: ../shared/specs/mla-mtp-dsa-longcat.md 1.6-1.8.

Layout: the cache of one MLA layer is `[num_pages, block_size, kv_lora_rank + rope_dim]`: per token one
row holding the normalized latent c (kv_lora_rank values) then the roped key k_pe (rope_dim values),
so it flattens to one `[num_slots, kv_lora_rank + rope_dim]` table, slot = page * block_size + offset.
There are no per-head K/V: attention is MQA with H query heads over that one row, K = the whole row and
V = its first kv_lora_rank values. An 8-bit cache (--kv-cache-dtype fp8) holds the same row in float8 e4m3,
unscaled: written rounded and saturated at +-448 (as the GQA cache), widened exactly to float32 where read.

Queries are one flat, unpadded batch as in paged_attention_ref: request b owns rows
query_start_loc[b]:query_start_loc[b+1], its keys are its first seq_lens[b] positions read through its
page-table row, and its query rows are its last positions (q_pos = seq_len - q_len + i), each seeing
keys at positions <= q_pos. So a prefill chunk over a cached prefix, a decode and a speculative verify
are the same call.
"""

from __future__ import annotations

import torch

from atlas.kernels.paged_attention_ref import (
    _rows,
    as_bits,
    gather_positions,
    padded_query_rows,
    to_cache_dtype,
)

# Requests with at most this many query rows are padded into one batched call (decode, verify);
# longer ones (prefill chunks) go one request at a time, in blocks of this many query rows.
_BATCHED_MAX_QUERY = 32
_QUERY_BLOCK = 256


def write_latent_cache(cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store rows [c | k_pe] (latent [T, Lkv], k_pe [T, R]) at their slots, cast as the cache stores them (an
    8-bit cache rounds and saturates: paged_attention_ref.to_cache_dtype); rows with a slot < 0 (padding)
    are not written. No host sync (CUDA-graph safe): a skipped row re-writes the first valid row, and
    when no row is valid slot 0 is written with its own contents (as fused_ops.write_kv_cache_ref)."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    # (as bits: torch has no index_copy_ or where for 8-bit floats; moving their bits is exact)
    flat = as_bits(cache).view(-1, cache.shape[-1])
    row = as_bits(to_cache_dtype(torch.cat([latent, k_pe], dim=-1), cache.dtype))
    if not slot_mapping.is_cuda:  # on the CPU a host decision is free: write the valid rows only
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            row, slot_mapping = row[keep], slot_mapping[keep]
        flat.index_copy_(0, slot_mapping, row)
        return
    valid = slot_mapping >= 0
    first_valid = valid.to(torch.int32).argmax()
    rows = torch.where(valid, torch.arange(num_tokens, device=slot_mapping.device), first_valid)
    slots = slot_mapping[rows]
    any_valid = (slots >= 0)[:, None]
    slots = slots.clamp(min=0)
    flat[slots] = torch.where(any_valid, row[rows], flat[slots])


def _attend(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, kv_lora_rank: int,
            scale: float) -> torch.Tensor:
    """q [B, Q, H, D], kv [B, K, D], visible [B, Q, K] -> [B, Q, H, kv_lora_rank] (float32 math)."""
    scores = torch.einsum("bqhd,bkd->bhqk", q.float(), kv.float()) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkl->bqhl", probs, kv[..., :kv_lora_rank].float())


def mla_attention_ref(
    q_latent: torch.Tensor,  # [T, H, Lkv]: the absorbed nope query (W_UK^T q_nope per head)
    q_pe: torch.Tensor,  # [T, H, R]: the roped query
    cache: torch.Tensor,  # [P, bs, Lkv + R]
    query_start_loc: list[int],
    seq_lens: list[int],
    page_tables: torch.Tensor,  # [B, max_pages] int32
    scale: float,
) -> torch.Tensor:
    """-> o_latent [T, H, Lkv]: per head, sum_s softmax_s((q_lat . c_s + q_pe . k_pe_s) * scale) c_s."""
    num_tokens, num_heads, lkv = q_latent.shape
    out = torch.empty(num_tokens, num_heads, lkv, dtype=q_latent.dtype, device=q_latent.device)
    query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, Lkv + R]: one dot product against the row
    device = q_latent.device
    q_lens = [query_start_loc[b + 1] - query_start_loc[b] for b in range(len(seq_lens))]
    small = [b for b, n in enumerate(q_lens) if 0 < n <= _BATCHED_MAX_QUERY]
    large = [b for b, n in enumerate(q_lens) if n > _BATCHED_MAX_QUERY]

    if small:
        rows, valid_q, q_pos, seq, max_k = padded_query_rows(query_start_loc, seq_lens, small, device)
        kv = gather_positions(cache, page_tables[torch.tensor(small, device=device)], max_k)  # [B, K, D]
        k_pos = torch.arange(max_k, device=device)
        visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq[:, None, None])
        visible = visible | ~valid_q[:, :, None]  # padded rows see everything (discarded) to avoid NaN
        o = _attend(_rows(query, rows), kv, visible, lkv, scale)
        out.index_copy_(0, rows[valid_q], o[valid_q].to(out.dtype))

    for b in large:
        start, q_len, seq_len = query_start_loc[b], q_lens[b], seq_lens[b]
        kv = gather_positions(cache, page_tables[b: b + 1], seq_len)  # [1, K, D]
        k_pos = torch.arange(seq_len, device=device)
        for a in range(0, q_len, _QUERY_BLOCK):
            n = min(_QUERY_BLOCK, q_len - a)
            q_pos = torch.arange(seq_len - q_len + a, seq_len - q_len + a + n, device=device)
            end = int(q_pos[-1]) + 1  # keys past the block's last query are never visible
            visible = (k_pos[None, :end] <= q_pos[:, None])[None]
            o = _attend(query[start + a: start + a + n][None], kv[:, :end], visible, lkv, scale)
            out[start + a: start + a + n] = o[0].to(out.dtype)
    return out
