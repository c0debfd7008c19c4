"""Triton DeepSeek sparse attention (DSA) over the paged latent cache: the lightning indexer's scores, the
top-k selection on the device, and absorbed MLA attention over each query's selected rows. Same function as
kernels/dsa_attention_ref.py (formulas and cache layout there), which the tests compare it against.

Everything is read from device tensors (query starts, lengths, page tables): no host lists, no loop over
requests. Per flat query row t the caller's step gives its request (row_req) and its position p (row_pos: keys
s <= p are visible), computed on the device from query_start_loc and seq_lens (`row_requests_and_positions`).

1. `_dsa_index_scores_kernel`: one program per (query row, BLOCK_S keys): the indexer keys are gathered
   through the page table ([c | k_pe | k_idx] rows: k_idx at offset Lkv + R), the head logits are one [Hi, D]
   x [D, BLOCK_S] product, then I(t, s) = sum_h w[t, h] * ReLU(logit * index_scale) in float32; -inf where
   s > p (and a whole block past p is not read). -> scores [T, S_max] float32.
2. `select_topk_indices`: torch.sort(descending, stable) of each row of the scores, the first min(index_topk,
   S_max) kept, -1 where the score is -inf (a key not visible): the reference's rule (ties to the earlier
   key), so the selected set is the reference's for the same scores. -> indices [T, K] int32, K =
   min(index_topk, S_max), ascending, -1 padded at the end (so a row's output is the same in any batch).
3. `_dsa_sparse_mla_kernel`: one program per (query row, block of heads), an online softmax over the row's
   selected positions (-1 skipped), each [c | k_pe] row gathered through the page table: scores q_lat . c +
   q_pe . k_pe, scaled, values c; float32 accumulation. -> o_latent [T, H, Lkv]. Split (decode steps, as the
   MLA kernel's split-KV: at one query row the unsplit grid is two programs of 64 heads walking all 2,048
   selected rows, 255 us a layer on an H200 where dense MLA's split kernel read as many rows in 17 us): with
   NUM_SPLITS > 1 each program takes one share of the row's index list and writes float32 partials that the
   paged-attention combine kernel merges.

An 8-bit cache (--kv-cache-dtype fp8: float8 e4m3 rows, indexer key included) is read as the MLA kernel reads
it: each tile widened to the queries' dtype, exactly (every e4m3 value is a bf16 and a float32), so the
products are those of the reference over the widened rows.

Top-k sharing (GLM-5's shared layers): on this path a full layer given `record` appends one tensor, its
indices [T, K], and a shared layer given `reuse` attends over reuse[0]'s positions of its own cache (rows
[c | k_pe]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels.mla_attention_triton import combine_split_partials, online_softmax_step
from atlas.kernels.paged_attention_triton import split_scratch

MAX_HEADS_PER_PROGRAM = 64
# The scores of this many (query row, key) pairs at most are held (and sorted) at once: longer steps go in
# chunks of query rows (float32 scores, plus the sort's values and int64 indices: about 16 bytes a pair, so
# 64 MiB at most). The memory planner's profiling step sees this only when its prompt is longer than
# index_topk (a shorter one takes the dense selection): kept small so that what it may miss is small.
SCORE_CHUNK_ELEMENTS = 1 << 22


# Integers that change from step to step (the step's longest context, the index width) are not specialised on:
# no recompiles as lengths grow, and one compiled variant computes every row (a row's result never depends on
# its batch).
@triton.jit(do_not_specialize=["index_scale", "s_max", "stride_st", "stride_bt"])
def _dsa_index_scores_kernel(
    q_ptr, w_ptr, cache_ptr, scores_ptr, page_tables_ptr, row_req_ptr, row_pos_ptr,
    index_scale, s_max,
    stride_qt, stride_qh, stride_wt, stride_slot, stride_st, stride_bt,
    KEY_OFFSET: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    s0 = tl.program_id(1) * BLOCK_S
    req = tl.load(row_req_ptr + t)
    pos = tl.load(row_pos_ptr + t)
    offs_s = s0 + tl.arange(0, BLOCK_S)
    score = tl.full([BLOCK_S], float("-inf"), tl.float32)
    if s0 <= pos:
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < HEADS
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < DIM
        row = t.to(tl.int64)
        q = tl.load(q_ptr + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + row * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        visible = offs_s <= pos
        page = tl.load(page_tables_ptr + req * stride_bt + offs_s // PAGE, mask=visible, other=0)
        slot = page.to(tl.int64) * PAGE + offs_s % PAGE
        k = tl.load(cache_ptr + slot[:, None] * stride_slot + KEY_OFFSET + offs_d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        if IEEE:
            logits = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_S]
        else:
            logits = tl.dot(q, tl.trans(k))
        per_head = tl.maximum(logits * index_scale, 0.0) * w[:, None]
        score = tl.where(visible, tl.sum(per_head, 0), float("-inf"))
    tl.store(scores_ptr + t.to(tl.int64) * stride_st + offs_s, score, mask=offs_s < s_max)


@triton.jit(do_not_specialize=["scale", "num_idx", "stride_it", "stride_bt"])
def _dsa_sparse_mla_kernel(
    ql_ptr, qp_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, idx_ptr, page_tables_ptr,
    row_req_ptr, scale, num_idx,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_slot, stride_ot, stride_oh, stride_it, stride_bt,
    NUM_HEADS: tl.constexpr, PAGE: tl.constexpr, HPB: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, LATENT: tl.constexpr, BLOCK_L: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr, IEEE: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    t = tl.program_id(0)
    head_block = tl.program_id(1)
    req = tl.load(row_req_ptr + t)
    row = t.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    head = head_block * HPB + offs_m
    row_ok = (offs_m < HPB) & (head < NUM_HEADS)
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < LATENT
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < ROPE
    ql = tl.load(ql_ptr + row * stride_qlt + head[:, None] * stride_qlh + offs_l[None, :],
                 mask=row_ok[:, None] & l_ok[None, :], other=0.0)
    qp = tl.load(qp_ptr + row * stride_qpt + head[:, None] * stride_qph + offs_r[None, :],
                 mask=row_ok[:, None] & r_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    idx_begin = 0
    idx_end = num_idx
    if NUM_SPLITS > 1:  # (this split's share of the index list, in whole BLOCK_N tiles)
        split = tl.program_id(2)
        chunk = tl.cdiv(tl.cdiv(num_idx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        idx_begin = split * chunk
        idx_end = tl.minimum(num_idx, idx_begin + chunk)
    for n in range(idx_begin, idx_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + row * stride_it + offs_n, mask=offs_n < idx_end, other=-1)
        ok = idx >= 0
        page = tl.load(page_tables_ptr + req * stride_bt + idx // PAGE, mask=ok, other=0)
        slot = page.to(tl.int64) * PAGE + idx % PAGE
        # (an 8-bit cache is widened to the queries' type here, exactly)
        c = tl.load(cache_ptr + slot[:, None] * stride_slot + offs_l[None, :],
                    mask=ok[:, None] & l_ok[None, :], other=0.0).to(ql.dtype)
        kp = tl.load(cache_ptr + slot[:, None] * stride_slot + LATENT + offs_r[None, :],
                     mask=ok[:, None] & r_ok[None, :], other=0.0).to(ql.dtype)
        if IEEE:
            qk = (tl.dot(ql, tl.trans(c), input_precision="ieee")
                  + tl.dot(qp, tl.trans(kp), input_precision="ieee"))
        else:
            qk = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(kp))
        qk = tl.where(ok[None, :] & row_ok[:, None], qk * scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, c, m_i, l_i, acc, IEEE)
    if NUM_SPLITS > 1:
        # Partials laid out [row, head, split] (+ [LATENT] for acc), contiguous, as the combine kernel reads.
        part = (row * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * LATENT + offs_l[None, :], acc, mask=row_ok[:, None] & l_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_l[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & l_ok[None, :])


def row_requests_and_positions(num_tokens: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each flat query row's request and position, on the device (no host sync): -> (row_req [T] int32,
    row_pos [T] int32). Rows past query_start_loc[-1] (padding) get request 0 and position -1: no key is
    visible."""
    device = query_start_loc.device
    t = torch.arange(num_tokens, device=device, dtype=torch.int64)
    qsl = query_start_loc.to(torch.int64)
    num_reqs = seq_lens.shape[0]
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
    real = req < num_reqs
    req = req.clamp(max=num_reqs - 1)
    pos = seq_lens.to(torch.int64)[req] - (qsl[req + 1] - t)
    pos = torch.where(real, pos, -1)
    req = torch.where(real, req, 0)
    return req.to(torch.int32), pos.to(torch.int32)


def dsa_index_scores(q_idx: torch.Tensor, w_idx: torch.Tensor, cache: torch.Tensor, page_tables: torch.Tensor,
                     row_req: torch.Tensor, row_pos: torch.Tensor, s_max: int, key_offset: int,
                     index_scale: float) -> torch.Tensor:
    """q_idx [T, Hi, D], w_idx [T, Hi], cache [P, page, width] (the indexer key at key_offset:key_offset + D)
    -> scores [T, s_max] float32, -inf where a key is past the row's position (or past s_max)."""
    num_tokens, heads, dim = q_idx.shape
    num_pages, page, width = cache.shape
    assert key_offset + dim == width and q_idx.stride(-1) == 1 and w_idx.stride(-1) == 1
    flat = cache.view(num_pages * page, width)
    scores = torch.empty(num_tokens, s_max, dtype=torch.float32, device=q_idx.device)
    if num_tokens == 0 or s_max == 0:
        return scores
    launch = index_scores_launch(heads, dim, q_idx.dtype == torch.float32)
    grid = (num_tokens, triton.cdiv(s_max, launch["BLOCK_S"]))
    _dsa_index_scores_kernel[grid](
        q_idx, w_idx, flat, scores, page_tables, row_req, row_pos,
        index_scale, s_max,
        q_idx.stride(0), q_idx.stride(1), w_idx.stride(0), flat.stride(0), scores.stride(0),
        page_tables.stride(0),
        KEY_OFFSET=key_offset, PAGE=page, **launch,
    )
    return scores


def index_scores_launch(heads: int, dim: int, fp32: bool) -> dict:
    """The scores kernel's tile constexprs and launch options (all heads in one tile: the [Hi, D] query is
    read once)."""
    block_h = max(16, triton.next_power_of_2(heads))
    return dict(HEADS=heads, BLOCK_H=block_h, DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
                BLOCK_S=32 if fp32 or block_h > 64 else 64, IEEE=fp32, num_warps=4)


def sparse_mla_launch(num_heads: int, latent: int, rope: int, fp32: bool) -> dict:
    """The sparse MLA kernel's tile constexprs and launch options: up to 64 heads a program (fp32 tiles of a
    512-wide latent are twice the bytes: as the MLA kernel, 16 keys a tile and no pipelining there)."""
    hpb = min(triton.next_power_of_2(num_heads), MAX_HEADS_PER_PROGRAM)
    block_m = max(16, hpb)
    return dict(NUM_HEADS=num_heads, HPB=hpb, BLOCK_M=block_m, BLOCK_N=16 if fp32 else 32, LATENT=latent,
                BLOCK_L=max(16, triton.next_power_of_2(latent)), ROPE=rope,
                BLOCK_R=max(16, triton.next_power_of_2(rope)),
                IEEE=fp32, num_warps=4 if block_m <= 32 else 8, **({"num_stages": 1} if fp32 else {}))


def select_topk_indices(scores: torch.Tensor, index_topk: int) -> torch.Tensor:
    """scores [T, S] (-inf: not visible) -> indices [T, min(index_topk, S)] int32 of each row's highest
    scores, ties to the earlier key (a stable sort, as the reference), in ascending order, then -1 for a row
    with fewer visible keys. (Ascending: the attention kernel then sums a row's keys in the same order
    whichever way the batch was formed, as the dense selection of a short step lists them: a row's output does
    not depend on its batch.)"""
    width = scores.shape[-1]
    n = min(index_topk, width)
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    picked = torch.where(values[:, :n] == float("-inf"), width, order[:, :n])
    picked = torch.sort(picked, dim=-1).values
    return torch.where(picked == width, -1, picked).to(torch.int32)


def dsa_sparse_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_tables: torch.Tensor,
                   row_req: torch.Tensor, indices: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None, num_splits: int = 1,
                   scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q_latent [T, H, Lkv], q_pe [T, H, R], cache [P, page, >= Lkv + R] (the latent row first), indices [T,
    K] (positions within each row's request, -1: none) -> o_latent [T, H, Lkv]: softmax attention over the
    indexed rows; a row with none is 0. `num_splits` > 1: each row's index list in that many shares, merged by
    the combine kernel (module docstring); `scratch`: float32 (m, l, acc) partials of at least T*H*S elements
    (acc: x latent), allocated here when None."""
    num_tokens, num_heads, latent = q_latent.shape
    rope = q_pe.shape[-1]
    num_pages, page, width = cache.shape
    assert width >= latent + rope and q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1
    assert indices.shape[0] == num_tokens and indices.stride(-1) == 1
    flat = cache.view(num_pages * page, width)
    if out is None:
        out = torch.empty(num_tokens, num_heads, latent, dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0:
        return out
    launch = sparse_mla_launch(num_heads, latent, rope, q_latent.dtype == torch.float32)
    grid = (num_tokens, triton.cdiv(num_heads, launch["HPB"]), num_splits)
    if num_splits > 1:
        part_m, part_l, part_acc = scratch or split_scratch(num_tokens, num_heads, latent, num_splits, out.device)
    else:
        part_m = part_l = part_acc = out  # (unused)
    _dsa_sparse_mla_kernel[grid](
        q_latent, q_pe, flat, out, part_m, part_l, part_acc, indices, page_tables, row_req,
        scale, indices.shape[1],
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), flat.stride(0),
        out.stride(0), out.stride(1), indices.stride(0), page_tables.stride(0),
        PAGE=page, NUM_SPLITS=num_splits, **launch,
    )
    if num_splits > 1:
        combine_split_partials((part_m, part_l, part_acc), out, num_splits)
    return out


def dsa_select(q_idx: torch.Tensor, w_idx: torch.Tensor, cache: torch.Tensor, page_tables: torch.Tensor,
               row_req: torch.Tensor, row_pos: torch.Tensor, max_seq_len: int, key_offset: int,
               index_topk: int, index_scale: float) -> torch.Tensor:
    """The indexer's selection for every query row: -> indices [T, min(index_topk, max_seq_len)] int32, -1
    padded. When no request has more than index_topk keys every visible key is selected (the reference's dense
    case) and nothing is scored; longer steps score and sort in chunks of query rows
    (SCORE_CHUNK_ELEMENTS)."""
    num_tokens = row_pos.shape[0]
    if max_seq_len <= index_topk:
        keys = torch.arange(max_seq_len, device=row_pos.device, dtype=torch.int32)
        return torch.where(keys[None, :] <= row_pos[:, None], keys[None, :], -1)
    chunk = max(1, SCORE_CHUNK_ELEMENTS // max_seq_len)
    parts = []
    for a in range(0, num_tokens, chunk):
        rows = slice(a, min(a + chunk, num_tokens))
        scores = dsa_index_scores(q_idx[rows], w_idx[rows], cache, page_tables, row_req[rows], row_pos[rows],
                                  max_seq_len, key_offset, index_scale)
        parts.append(select_topk_indices(scores, index_topk))
    if not parts:
        return torch.empty(0, index_topk, dtype=torch.int32, device=row_pos.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def dsa_attention_triton(
    q_latent: torch.Tensor,  # [T, H, Lkv]
    q_pe: torch.Tensor,  # [T, H, R]
    q_idx: torch.Tensor | None,  # [T, Hi, D] (None with `reuse`)
    w_idx: torch.Tensor | None,  # [T, Hi] float32
    cache: torch.Tensor,  # [P, bs, Lkv + R + D] ([P, bs, Lkv + R] with `reuse`)
    query_start_loc: torch.Tensor,  # [B+1] int32 (device)
    seq_lens: torch.Tensor,  # [B] int32 (device)
    page_tables: torch.Tensor,  # [B, max_pages] int32 (device)
    max_seq_len: int,  # a bound on seq_lens (the step's longest)
    scale: float,
    index_topk: int,
    index_scale: float,
    record: list[torch.Tensor] | None = None,
    reuse: list[torch.Tensor] | None = None,
    num_splits: int = 1,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """dsa_attention_ref's function from device tensors: -> o_latent [T, H, Lkv]. `record`: append the step's
    indices [T, K]; `reuse`: [indices] recorded by this step's full layer, in place of indexing. `num_splits`,
    `scratch`: dsa_sparse_mla's."""
    num_tokens, _, lkv = q_latent.shape
    row_req, row_pos = row_requests_and_positions(num_tokens, query_start_loc, seq_lens)
    if reuse is not None:
        if len(reuse) != 1 or reuse[0].dtype != torch.int32 or reuse[0].shape[0] != num_tokens:
            shapes = [(tuple(s.shape), s.dtype) for s in reuse]
            raise RuntimeError(f"a shared DSA layer was handed selections {shapes} for {num_tokens} query "
                               "rows: not this step's indices (or the reference's masks)")
        indices = reuse[0]
    else:
        indices = dsa_select(q_idx, w_idx, cache, page_tables, row_req, row_pos, max_seq_len,
                             lkv + q_pe.shape[-1], index_topk, index_scale)
    if record is not None:
        record.append(indices)
    return dsa_sparse_mla(q_latent, q_pe, cache, page_tables, row_req, indices, scale, num_splits=num_splits,
                          scratch=scratch)
