"""PyTorch reference of DeepSeek sparse attention (DSA) over the paged latent cache: the lightning
indexer's scores and top-k selection per query, then absorbed MLA attention over the selected rows
only. Runs on CPU and CUDA; on CUDA with triton the layer takes kernels/dsa_attention_triton.py instead, which
the tests compare against this.
Formulas: ../shared/specs/mla-mtp-dsa-longcat.md 4.2-4.3, checked against transformers' deepseek_v32.

Layout: a DSA layer's cache is `[num_pages, block_size, kv_lora_rank + rope_dim + index_head_dim]`: per
token the MLA latent row [c | k_pe] (kernels/mla_attention_ref.py) followed by the indexer key (after
its LayerNorm and RoPE), so one page table addresses both and a prefix-cache hit restores both. An 8-bit cache
(--kv-cache-dtype fp8) rounds the whole row, indexer key included (write_latent_cache): the indexer scores the
rounded keys, widened exactly to float32 as the latents are.

Per query row t at position p (a flat, unpadded batch as in mla_attention_ref: request b's rows are
query_start_loc[b]:query_start_loc[b+1], its keys its first seq_lens[b] positions, its query rows its last
positions), over keys s <= p:
    I(t, s) = sum_h w[t, h] * ReLU(q_idx[t, h] . k_idx[s] * index_scale)
(w already holds weights_proj(x) * Hi^-0.5). The top min(index_topk, p + 1) keys by I are selected, ties
going to the earlier position (a stable sort, so the choice never depends on how the batch was formed);
attention is then softmax over the selected keys of (q_latent . c_s + q_pe . k_pe_s) * scale, weighting c_s.
With p + 1 <= index_topk every visible key is selected: dense MLA.

Top-k sharing (GLM-5's "shared" layers, which have no indexer): a full layer given `record` appends each
(request, query block)'s selection mask to it, in order; a shared layer of the same step passes that list as
`reuse` (and no q_idx / w_idx) and attends over exactly those rows of its own latent cache, whose rows then
hold [c | k_pe] only.
"""

from __future__ import annotations

import torch

from atlas.kernels.mla_attention_ref import _attend
from atlas.kernels.paged_attention_ref import gather_positions

_QUERY_BLOCK = 256


def indexer_scores(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, index_scale: float) -> torch.Tensor:
    """q_idx [Q, Hi, D], w [Q, Hi], k_idx [K, D] -> I [Q, K] in float32."""
    s = torch.relu(torch.einsum("qhd,kd->qhk", q_idx.float(), k_idx.float()) * index_scale)
    return torch.einsum("qh,qhk->qk", w.float(), s)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, index_topk: int) -> torch.Tensor:
    """scores [Q, K], visible [Q, K] bool -> selected [Q, K] bool: per row the index_topk visible keys of
    highest score (all visible keys when there are no more than index_topk), ties to the earlier key."""
    masked = scores.masked_fill(~visible, float("-inf"))
    n = min(index_topk, scores.shape[-1])
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :n]
    selected = torch.zeros_like(visible).scatter_(1, order, True)
    return selected & visible


def dsa_attention_ref(
    q_latent: torch.Tensor,  # [T, H, Lkv]: the absorbed nope query
    q_pe: torch.Tensor,  # [T, H, R]: the roped query
    q_idx: torch.Tensor | None,  # [T, Hi, D]: the indexer's roped query (None with `reuse`)
    w_idx: torch.Tensor | None,  # [T, Hi]: the indexer's head weights (weights_proj(x) * Hi^-0.5)
    cache: torch.Tensor,  # [P, bs, Lkv + R + D] ([P, bs, Lkv + R] with `reuse`)
    query_start_loc: list[int],
    seq_lens: list[int],
    page_tables: torch.Tensor,  # [B, max_pages] int32
    scale: float,
    index_topk: int,
    index_scale: float,
    record: list[torch.Tensor] | None = None,
    reuse: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """-> o_latent [T, H, Lkv]: sparse absorbed MLA over each query's index_topk selected latent rows
    (`record`: append the selections; `reuse`: an earlier layer's recorded selections, in place of indexing)."""
    num_tokens, num_heads, lkv = q_latent.shape
    row = lkv + q_pe.shape[-1]  # [c | k_pe]; the indexer key follows
    out = torch.empty(num_tokens, num_heads, lkv, dtype=q_latent.dtype, device=q_latent.device)
    query = torch.cat([q_latent, q_pe], dim=-1)
    device = q_latent.device
    n_block = 0
    for b, seq_len in enumerate(seq_lens):
        start, q_len = query_start_loc[b], query_start_loc[b + 1] - query_start_loc[b]
        if q_len == 0:
            continue
        rows = gather_positions(cache, page_tables[b: b + 1], seq_len)[0]  # [K, width]
        kv, k_idx = rows[:, :row], rows[:, row:]
        k_pos = torch.arange(seq_len, device=device)
        for a in range(0, q_len, _QUERY_BLOCK):
            n = min(_QUERY_BLOCK, q_len - a)
            first = seq_len - q_len + a
            end = first + n  # keys past the block's last query are never visible
            q_pos = torch.arange(first, end, device=device)
            visible = k_pos[None, :end] <= q_pos[:, None]
            rs = slice(start + a, start + a + n)
            if reuse is not None:
                selected = reuse[n_block]
                if selected.shape != visible.shape:
                    raise RuntimeError(f"a shared DSA layer was handed a selection of shape {tuple(selected.shape)} "
                                       f"for a block of {tuple(visible.shape)}: not this step's")
            else:
                selected = select_topk(indexer_scores(q_idx[rs], w_idx[rs], k_idx[:end], index_scale), visible,
                                       index_topk)
            if record is not None:
                record.append(selected)
            n_block += 1
            o = _attend(query[rs][None], kv[None, :end], selected[None], lkv, scale)
            out[rs] = o[0].to(out.dtype)
    return out
