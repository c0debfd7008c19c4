"""PyTorch reference of attention over the paged KV cache. Runs on CPU and CUDA.

This is the numerical reference every faster kernel is tested against, and the path CPU runs use.

Layout: the cache of one layer is `[2, num_pages, block_size, kv_heads, head_dim]` (K then V), so the
K (or V) cache flattens to one `[num_slots, kv_heads, head_dim]` table, slot = page * block_size + offset.
In an 8-bit cache the V plane is stored transposed within each page, `[num_pages, kv_heads, head_dim,
block_size]`: the attention kernel multiplies P by V with the keys as the reduction dimension, and only with
the keys contiguous can its 8-bit V tiles reach the tensor cores without byte-wise shared-memory loads
(BENCHMARKS.md). `v_transposed`, `store_rows` and `load_rows` are the one place the reference paths know it.
Queries are one flat, unpadded batch: request b owns rows query_start_loc[b]:query_start_loc[b+1], and
its keys are its first seq_lens[b] positions, read through its row of the page table. The query rows of
a request are its last positions (q_pos = seq_len - q_len + i).

Attention sinks (gpt-oss): a learned logit per query head, `sinks` [Hq], that joins every row's softmax as one
more score with a zero value: out = sum_k exp(s_k) v_k / (sum_k exp(s_k) + exp(sink)), s_k the scaled scores.
It only ever lowers the weight of the real keys (the row's weights sum to less than 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Requests with at most this many query rows are padded into one batched call (decode, verify);
# longer ones (prefill chunks) are computed one request at a time to bound the padded size.
_BATCHED_MAX_QUERY = 32


def cache_limit(dtype: torch.dtype) -> float:
    """The bound at which stores into an 8-bit float cache saturate (its largest finite value); 0.0 for
    wider types, which store as they are."""
    return float(torch.finfo(dtype).max) if dtype.itemsize == 1 and dtype.is_floating_point else 0.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: a plain cast, except that 8-bit floats saturate at cache_limit (an unscaled
    cache; the cast alone would make NaN or, in Triton's interpreter, garbage of anything past it). The
    kernels that write a cache do the same (fused_ops_triton)."""
    if x.dtype == dtype:
        return x
    limit = cache_limit(dtype)
    return (x.clamp(-limit, limit) if limit else x).to(dtype)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit float tensor viewed as bytes (torch has no index_copy_ / index_select / where for those
    types; moving their bits is exact); any other tensor as it is."""
    return t.view(torch.uint8) if cache_limit(t.dtype) else t


def v_transposed(dtype: torch.dtype) -> bool:
    """Whether a cache of this element type keeps its V plane transposed within each page (8-bit caches)."""
    return dtype.itemsize == 1


def _plane_rows(kv_cache: torch.Tensor, plane: int) -> torch.Tensor:
    """The plane as [num_pages, block_size, kv_heads, head_dim] in token order (a strided view of a transposed
    V plane), as bits."""
    num_pages, block_size, heads, dim = kv_cache.shape[1:]
    if plane == 1 and v_transposed(kv_cache.dtype):
        return as_bits(kv_cache[1]).view(num_pages, heads, dim, block_size).permute(0, 3, 1, 2)
    return as_bits(kv_cache[plane])


def store_rows(kv_cache: torch.Tensor, plane: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Rows [n, kv_heads, head_dim] of plane 0 (K) or 1 (V) stored at slots [n] (>= 0), cast as the cache
    stores them."""
    rows = as_bits(to_cache_dtype(rows, kv_cache.dtype))
    table = _plane_rows(kv_cache, plane)
    if table.is_contiguous():
        # (index_copy_ rather than advanced indexing: on a busy CPU the latter's threaded kernels were a
        # thousand times slower for a few hundred rows.)
        table.view(-1, *table.shape[2:]).index_copy_(0, slots, rows)
    else:
        block_size = table.shape[1]
        table[slots // block_size, slots % block_size] = rows


def load_rows(kv_cache: torch.Tensor, plane: int, slots: torch.Tensor) -> torch.Tensor:
    """The rows of plane 0 (K) or 1 (V) at slots of any shape: [*slots.shape, kv_heads, head_dim]."""
    table = _plane_rows(kv_cache, plane)
    if table.is_contiguous():
        rows = _rows(table.view(-1, *table.shape[2:]), slots)
    else:
        block_size = table.shape[1]
        rows = table[slots // block_size, slots % block_size]
    return rows.view(kv_cache.dtype)


def _rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for an index tensor of any shape, through index_select."""
    rows = as_bits(table).index_select(0, index.reshape(-1)).view(*index.shape, *table.shape[1:])
    return rows.view(table.dtype)


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store key/value rows [T, kv_heads, head_dim] at their slots."""
    store_rows(kv_cache, 0, slot_mapping, key)
    store_rows(kv_cache, 1, slot_mapping, value)


def load_positions(kv_cache: torch.Tensor, plane: int, page_tables: torch.Tensor, length: int) -> torch.Tensor:
    """The rows of plane 0 (K) or 1 (V) at positions 0..length-1 of each page-table row: [B, length, kv_heads,
    head_dim]. Whole pages are gathered (one index a page, not one a position: a fifth of the time of
    load_rows over the same positions on the CPU) and the last page cut at `length`."""
    table = _plane_rows(kv_cache, plane)
    if not table.is_contiguous():  # (a transposed 8-bit V plane: position by position)
        return load_rows(kv_cache, plane, _gather_slots(page_tables, table.shape[1], length))
    return gather_positions(table, page_tables, length).view(kv_cache.dtype)


def gather_positions(table: torch.Tensor, page_tables: torch.Tensor, length: int) -> torch.Tensor:
    """A contiguous paged table [num_pages, block_size, ...] read at positions 0..length-1 of each page-table row
    [B, max_pages]: [B, length, ...], a page at a time."""
    block_size = table.shape[1]
    num_pages = -(-length // block_size)
    pages = page_tables[:, :num_pages].reshape(-1).long()
    rows = as_bits(table).index_select(0, pages).view(page_tables.shape[0], num_pages * block_size, *table.shape[2:])
    return rows[:, :length].view(table.dtype)


def _gather_slots(page_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Slot ids [B, length] of positions 0..length-1 for each row of the page table."""
    pos = torch.arange(length, device=page_tables.device)
    pages = page_tables.index_select(1, pos // block_size).long()
    return pages * block_size + (pos % block_size)


def padded_query_rows(query_start_loc: list[int], seq_lens: list[int], reqs: list[int], device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Requests `reqs` as one padded batch: (flat query row of each padded row [B, Q] (padding rows
    repeat the request's first row), which rows are real [B, Q], their positions [B, Q], the requests'
    sequence lengths [B], the longest of them)."""
    q_lens = [query_start_loc[b + 1] - query_start_loc[b] for b in reqs]
    starts = torch.tensor([query_start_loc[b] for b in reqs], device=device)
    lens = torch.tensor(q_lens, device=device)
    seq = torch.tensor([seq_lens[b] for b in reqs], device=device)
    i = torch.arange(max(q_lens), device=device)
    valid_q = i[None, :] < lens[:, None]
    rows = torch.where(valid_q, starts[:, None] + i[None, :], starts[:, None])
    return rows, valid_q, (seq - lens)[:, None] + i[None, :], seq, max(seq_lens[b] for b in reqs)


def _visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: torch.Tensor, causal: bool,
                sliding_window: int | None, chunk_size: int | None = None) -> torch.Tensor:
    """Bool mask [..., Q, K]: may the query at q_pos see the key at k_pos? (chunk_size: only the keys of the query's
    chunk, positions q_pos // C * C onwards.)"""
    visible = k_pos < seq_len
    if causal:
        visible = visible & (k_pos <= q_pos)
    if sliding_window is not None:
        visible = visible & (k_pos > q_pos - sliding_window)
    if chunk_size is not None:
        visible = visible & (k_pos >= torch.div(q_pos, chunk_size, rounding_mode="floor") * chunk_size)
    return visible


def _outside_window_zeroed(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, first_q_pos: torch.Tensor,
                           sliding_window: int | None, chunk_size: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [..., K, D] (key axis -2, batch axes leading as first_q_pos [...]) with the keys that no query row of
    their request sees through the window (positions below first_q_pos - window + 1) or the chunk (below the first
    row's chunk start) replaced by zeros: their pages may have gone back to the pool (a windowed or chunked model's
    page release) and hold anything, NaN included, which a masked score would still carry into the softmax."""
    if sliding_window is None and chunk_size is None:
        return k, v
    first = first_q_pos[..., None]
    if sliding_window is not None:
        keep = k_pos > first - sliding_window
    else:
        keep = k_pos >= torch.div(first, chunk_size, rounding_mode="floor") * chunk_size
    keep = keep[..., None, :, None]
    return torch.where(keep, k, 0), torch.where(keep, v, 0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, gqa: bool,
            sinks: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v over [..., H, Q, D] / [..., Hkv, K, D] with a boolean mask broadcast to
    [..., H, Q, K]; with `sinks` [H], each head's sink logit joins the softmax's denominator; with `softcap`, the
    scores are softcap * tanh(score / softcap) (written out for either: scaled dot-product attention takes
    neither)."""
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, P, bs, Hkv, D]
    query_start_loc: list[int],
    seq_lens: list[int],
    page_tables: torch.Tensor,  # [B, max_pages] int32
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]: attention-sink logits (see the module docstring)
    chunk_size: int | None = None,  # chunked attention: a query sees the keys of its chunk only
    softcap: float | None = None,  # scores soft-capped to softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty(num_tokens, num_heads, kv_cache.shape[-1], dtype=query.dtype, device=query.device)
    gqa = num_heads != kv_cache.shape[3]
    q_lens = [query_start_loc[b + 1] - query_start_loc[b] for b in range(len(seq_lens))]

    small = [b for b, q_len in enumerate(q_lens) if 0 < q_len <= _BATCHED_MAX_QUERY]
    large = [b for b, q_len in enumerate(q_lens) if q_len > _BATCHED_MAX_QUERY]
    device = query.device

    if small:
        rows, valid_q, q_pos, seq, max_k = padded_query_rows(query_start_loc, seq_lens, small, device)
        q = _rows(query, rows).transpose(1, 2)  # [B, Hq, Q, D]
        tables = page_tables[torch.tensor(small, device=device)]
        k = load_positions(kv_cache, 0, tables, max_k).transpose(1, 2).to(query.dtype)  # [B, Hkv, K, D]
        v = load_positions(kv_cache, 1, tables, max_k).transpose(1, 2).to(query.dtype)
        k_pos = torch.arange(max_k, device=device)
        k, v = _outside_window_zeroed(k, v, k_pos, q_pos[:, 0], sliding_window, chunk_size)
        mask = _visibility(q_pos[:, :, None], k_pos[None, None, :], seq[:, None, None], causal, sliding_window,
                           chunk_size)
        mask = mask | ~valid_q[:, :, None]  # padded rows see everything (discarded) to avoid NaN
        o = _attend(q, k, v, mask[:, None], scale, gqa, sinks, softcap)
        o = o.transpose(1, 2)  # [B, Q, Hq, D]
        out.index_copy_(0, rows[valid_q], o[valid_q])

    for b in large:
        start, q_len, seq_len = query_start_loc[b], q_lens[b], seq_lens[b]
        k = load_positions(kv_cache, 0, page_tables[b: b + 1], seq_len)[0].transpose(0, 1).to(query.dtype)  # [Hkv, K, D]
        v = load_positions(kv_cache, 1, page_tables[b: b + 1], seq_len)[0].transpose(0, 1).to(query.dtype)
        q = query[start: start + q_len].transpose(0, 1)  # [Hq, Q, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        k_pos = torch.arange(seq_len, device=device)
        k, v = _outside_window_zeroed(k, v, k_pos, q_pos[0], sliding_window, chunk_size)
        mask = _visibility(q_pos[:, None], k_pos[None, :], torch.tensor(seq_len, device=device), causal,
                           sliding_window, chunk_size)
        o = _attend(q, k, v, mask, scale, gqa, sinks, softcap)
        out[start: start + q_len] = o.transpose(0, 1)
    return out
