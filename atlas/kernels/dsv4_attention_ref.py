"""PyTorch reference of DeepSeek-V4's attention over its paged cache (layers/dsv4_attention.py): shared-KV MQA
(one key row per token that is also its value) over a sliding window of raw rows plus the compressed rows (one
per closed window of `compress_rate` tokens) that are visible to the query, all of them for a heavily compressed
(HCA) layer, the top `index_topk` by the lightning indexer for a compressed sparse (CSA) layer, each head with a
learnable sink logit in its softmax. Runs on CPU and CUDA (on CUDA the exact path, not a fast one: no Triton
kernel yet). Checked against transformers' deepseek_v4 (DeepseekV4Attention, eager_attention_forward).

Per query row at position p of a request (rows as in mla_attention_ref: request b's query rows are its last
positions), the keys are
- the raw rows of positions p - window + 1 .. p (transformers' sliding-window mask: kv > q - window);
- the compressed row of window w, kept at the slot of the window's last token e = (w + 1) * m - 1, when e <= p
  (transformers' `entry < (p + 1) // m`); for CSA only those the indexer selects (dsa_attention_ref.select_topk:
  the top min(index_topk, visible) by score, ties to the earlier row), its scores over the indexer's own
  compressed keys (kept beside them in the same cache row).
Scores q . k * scale in float32; the softmax runs over the keys and the head's sink, whose probability is
dropped; the output is sum_k prob_k * k.
"""

from __future__ import annotations

import torch

from atlas.kernels.dsa_attention_ref import indexer_scores, select_topk

_QUERY_BLOCK = 256


def slots_of(page_tables: torch.Tensor, req: torch.Tensor | int, positions: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """Cache slots of `positions` (any shape) of request(s) `req` (broadcast against positions)."""
    if isinstance(req, int):
        pages = page_tables[req].long()[positions // block_size]
    else:
        pages = page_tables.long()[req, positions // block_size]
    return pages * block_size + positions % block_size


def dsv4_attention_ref(
    q: torch.Tensor,  # [T, H, D]: roped queries
    cache: torch.Tensor,  # [P, bs, width]: the key row at [:D], the compressed row at [entry: entry + D]
    query_start_loc: list[int],
    seq_lens: list[int],
    page_tables: torch.Tensor,  # [B, max_pages] int32
    sinks: torch.Tensor,  # [H] float32
    scale: float,
    window: int,
    compress_rate: int = 0,  # 0: the sliding window only
    entry: int = 0,  # offset of the compressed row in a cache row
    q_idx: torch.Tensor | None = None,  # [T, Hi, Di]: the indexer's roped queries (CSA)
    w_idx: torch.Tensor | None = None,  # [T, Hi]: its head weights
    index_entry: int = 0,  # offset of the indexer's compressed key in a cache row
    index_topk: int = 0,
    index_scale: float = 1.0,
) -> torch.Tensor:
    """-> [T, H, D] attention outputs (before the output's inverse RoPE)."""
    num_tokens, num_heads, dim = q.shape
    _, block_size, width = cache.shape
    flat = cache.view(-1, width)
    device = q.device
    out = torch.empty_like(q)
    m = compress_rate
    for b, seq_len in enumerate(seq_lens):
        start, q_len = query_start_loc[b], query_start_loc[b + 1] - query_start_loc[b]
        if q_len == 0:
            continue
        first = seq_len - q_len
        lo = max(0, first - window + 1)
        w_pos = torch.arange(lo, seq_len, device=device)
        keys = flat[slots_of(page_tables, b, w_pos, block_size)]
        k_all, k_pos = keys[:, :dim], w_pos
        e_pos = torch.arange(m - 1, seq_len, m, device=device) if m and seq_len >= m else w_pos[:0]
        if e_pos.numel():
            e_rows = flat[slots_of(page_tables, b, e_pos, block_size)]
            k_all = torch.cat([k_all, e_rows[:, entry: entry + dim]])
            k_idx = e_rows[:, index_entry: index_entry + q_idx.shape[-1]] if q_idx is not None else None
        k32 = k_all.float()
        for a in range(0, q_len, _QUERY_BLOCK):
            n = min(_QUERY_BLOCK, q_len - a)
            rs = slice(start + a, start + a + n)
            q_pos = torch.arange(first + a, first + a + n, device=device)
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            if e_pos.numel():
                seen = e_pos[None, :] <= q_pos[:, None]
                if q_idx is not None:
                    seen = select_topk(indexer_scores(q_idx[rs], w_idx[rs], k_idx, index_scale), seen, index_topk)
                visible = torch.cat([visible, seen], dim=1)
            logits = torch.einsum("qhd,kd->qhk", q[rs].float(), k32) * scale
            logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
            sink = sinks.float().view(1, num_heads, 1).expand(n, num_heads, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
            out[rs] = torch.einsum("qhk,kd->qhd", probs, k32).to(out.dtype)
    return out


def pool_windows(raw_kv: torch.Tensor, raw_gate: torch.Tensor, ape: torch.Tensor, overlap: bool,
                 has_prev: torch.Tensor | None) -> torch.Tensor:
    """The compressor's softmax-gated pooling of windows (transformers' DeepseekV4HCACompressor /
    DeepseekV4CSACompressor): raw_kv / raw_gate [N, S, s * D] are the projected rows of the window's tokens (S = m),
    or with `overlap` of the previous window's then the window's tokens (S = 2m, s = 2); ape [m, s * D] is added to
    the gate by slot within a window. Without overlap: sum_j softmax_j(gate + ape) * kv over the window. With
    overlap, a window pools 2m slots: the previous window's first halves (Ca, [:D]) then its own second halves (Cb,
    [D:]); has_prev [N] False for window 0, whose Ca slots weigh nothing (transformers' -inf gate). -> [N, D]
    (before the norm and RoPE) in raw_kv's dtype; the softmax in float32."""
    gate = raw_gate.float() + ape.float().repeat(raw_gate.shape[1] // ape.shape[0], 1)
    if not overlap:
        weights = torch.softmax(gate, dim=1).to(raw_kv.dtype)
        return (raw_kv * weights).sum(dim=1)
    m, d = ape.shape[0], ape.shape[1] // 2
    kv = torch.cat([raw_kv[:, :m, :d], raw_kv[:, m:, d:]], dim=1)
    g = torch.cat([gate[:, :m, :d], gate[:, m:, d:]], dim=1)
    if has_prev is not None:
        kv = kv.clone()
        kv[:, :m] = torch.where(has_prev[:, None, None], kv[:, :m], torch.zeros((), dtype=kv.dtype))
        g[:, :m] = torch.where(has_prev[:, None, None], g[:, :m], float("-inf"))
    weights = torch.softmax(g, dim=1).to(kv.dtype)
    return (kv * weights).sum(dim=1)
