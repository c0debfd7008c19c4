"""Triton paged attention for every kind of step: prefill chunks over a cached prefix, decodes and
speculative verify rows, causal or not (the DFlash drafter's block), with an optional sliding window or chunk.

One program handles BLOCK_Q consecutive query tokens of one request and all query heads that share
one KV head (GQA packing), so each K/V page is read once per KV head: decode is memory-bound and
this keeps it at one pass over the cache. Keys are read through the request's page table.
The PyTorch reference it is tested against is kernels/paged_attention_ref.py.

Split-KV ("flash-decoding"): with few programs (a small decode batch has one per request and KV head,
far fewer than the GPU has SMs) the kernel also splits each program's key range into NUM_SPLITS
chunks, one program each, which write unnormalised partials (running max m, sum l, accumulator) in
float32; `_paged_attention_combine_kernel` merges them. Sequence lengths live on the device (CUDA
graphs replay them), so each split derives its chunk from seq_len in the kernel; a split past the end
writes m = -inf, l = 0.

Attention sinks (gpt-oss; HAS_SINKS): each query head's sink logit joins its row's softmax as one more score with
a zero value. An unsplit program folds it into its running max and sum once, after its last key tile; under
split-KV the combine kernel does, once per row (never a split: each would add it again).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels import settings
from atlas.kernels.paged_attention_ref import v_transposed
from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin

# Key tiles in flight in the main loop (software pipelining) for decode-sized programs: the kv_stages tuning
# knob (kernels/settings.py; default 3), 1 turns it off. Measured on an H200 at the 8B layer shape
# (tools/gqa_kernel_bench.py, BENCHMARKS.md): 3 tiles of 64 keys take decode attention from 0.55-0.73 of the
# copy bandwidth to 0.94-1.0 at 64-256 requests and 1-2K tokens. Wider programs (verify rows, prefill tiles) keep at most 2 in flight and float32 none, so
# that their shared memory (K and V tiles a stage beside the query tile) stays well inside an SM's.
# Keys a tile of an unsplit program: the kv_block_n knob (a power of two from 16) sets it, for measuring; 0 (the
# default): `kv_block_n`'s choice.


def kv_block_n(page: int, block_m: int, cache_dtype: torch.dtype) -> int:
    """Keys a tile of an unsplit program: 64, or the page where pages are larger; 128 for a decode-sized program
    (block_m <= 16) over an 8-bit cache, whose tiles cost more instructions a key than bf16's (the fp16 widening)
    so that a longer tile spreads each tile's fixed work over twice the keys (session 23, with the 8-bit V still
    key-major: 9 % faster at 256 requests x 1,024 tokens, 18 % at 64 x 1,024, no slower at 256 x 256;
    BENCHMARKS.md). An 8-bit tile is a whole number of pages (its V is read page by page)."""
    if settings.tuning.kv_block_n:
        return settings.tuning.kv_block_n
    if cache_dtype.itemsize == 1 and block_m <= 16 and page <= 128:
        return 128
    return 64 if page <= 64 else page


def kv_stages(block_m: int, dtype: torch.dtype) -> int:
    """Key tiles in flight for a program of block_m query rows in `dtype`."""
    if dtype == torch.float32:
        return 1
    stages = settings.tuning.kv_stages
    return stages if block_m <= 16 else min(stages, 2)


# Integer arguments that change from step to step must not be specialised on (Triton would compile a
# new variant whenever, e.g., the page-table width crosses a multiple of 16, stalling a live server).
@triton.jit(do_not_specialize=["scale", "window", "attn_chunk", "softcap", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, counts_ptr,
    page_tables_ptr, seq_lens_ptr, query_start_loc_ptr, prog_req_ptr, prog_q0_ptr, sinks_ptr,
    scale, window, attn_chunk, softcap,
    stride_qt, stride_qh, stride_kslot, stride_kh, stride_ot, stride_oh, stride_bt,
    PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    NUM_STAGES: tl.constexpr, DOT_F16: tl.constexpr, V_T: tl.constexpr, PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr, SOFTCAP: tl.constexpr, FUSED_COMBINE: tl.constexpr,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(prog_req_ptr + pid)
    q0 = tl.load(prog_q0_ptr + pid)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # position of the request's first query row

    offs_m = tl.arange(0, BLOCK_M)
    t = q0 + offs_m // GROUP  # query index within the request
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (t < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + t)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx + t
    if DOT_F16:
        # An 8-bit cache under bf16 queries: the products run in fp16, which e4m3 converts to natively (to bf16
        # it goes through fp32; measured 2-3 % slower a step). bf16 q values are exact in fp16 from 2^-14 to
        # 65504; tinier ones round (negligible in a dot product) and larger ones are clamped.
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    kv_end = seq_len
    if CAUSAL:
        kv_end = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)
    # A sliding window: the first key any row of this program sees is kv_lo (its first row's window start). The
    # loop starts at the tile holding it, and keys below it are never loaded, not even masked out after the load:
    # the pages that hold only such keys may have gone back to the pool (a windowed model's page release) and hold
    # another sequence's rows by now.
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx + q0 - window + 1, 0)
    if USE_CHUNK:
        # Chunked attention (Llama 4's local layers): a row sees the keys of its own chunk of `attn_chunk`
        # positions; the program's first row's chunk starts at kv_lo, and the keys below it are never loaded either
        # (a chunked layer's pages below its chunk may have gone back to the pool, as a window's).
        kv_lo = ((ctx + q0) // attn_chunk) * attn_chunk
    kv_begin = (kv_lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        # This split's share of [kv_begin, kv_end), in whole BLOCK_N tiles (kv_begin is tile-aligned).
        split = tl.program_id(2)
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_begin = kv_begin + split * chunk
        kv_end = tl.minimum(kv_end, kv_begin + chunk)
    # Software-pipelined over the key tiles (NUM_STAGES > 1): the next tiles' page ids, K and V are in flight
    # while this one is reduced, which a decode program (little arithmetic a tile) needs to approach the
    # copy bandwidth.
    for n in tl.range(kv_begin, kv_end, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        if USE_WINDOW or USE_CHUNK:
            n_ok = n_ok & (offs_n >= kv_lo)
        page = tl.load(page_tables_ptr + req * stride_bt + offs_n // PAGE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE + offs_n % PAGE
        kv_off = slot[:, None] * stride_kslot + kvh * stride_kh + offs_d[None, :]
        # (an 8-bit cache is widened to the products' type here: the tile is read at half the bytes)
        k = tl.load(k_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale
        if SOFTCAP:
            # Gemma 2's score soft-capping, softcap * tanh(score / softcap), with tanh from one exp of -2|x| (no
            # overflow either way)
            ratio = qk / softcap
            decay = tl.exp(-2.0 * tl.abs(ratio))
            tanh_abs = (1.0 - decay) / (1.0 + decay)
            qk = softcap * tl.where(ratio < 0, -tanh_abs, tanh_abs)
        visible = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        if USE_CHUNK:
            visible = visible & (offs_n[None, :] >= (q_pos[:, None] // attn_chunk) * attn_chunk)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_T:
            # An 8-bit cache's V plane is [pages, kv heads, dim, PAGE]: the tile is read as [pages, dim, PAGE]
            # (PAGE keys contiguous, which lets Triton copy it asynchronously and feed P.V without byte-wise
            # shared-memory loads), whole pages at a time: keys past the end carry p = 0, and every stored
            # value is finite (saturating stores, zeroed pages).
            NP: tl.constexpr = BLOCK_N // PAGE
            pidx = tl.multiple_of(n, BLOCK_N) // PAGE + tl.arange(0, NP)
            p_ok = pidx * PAGE < kv_end
            if USE_WINDOW or USE_CHUNK:
                p_ok = p_ok & ((pidx + 1) * PAGE > kv_lo)
            pages = tl.load(page_tables_ptr + req * stride_bt + pidx, mask=p_ok, other=0)
            offs_p = tl.arange(0, PAGE)
            vt_off = (pages.to(tl.int64)[:, None, None] * (PAGE * stride_kslot) + kvh * (HEAD_DIM * PAGE)
                      + offs_d[None, :, None] * PAGE + offs_p[None, None, :])
            vt = tl.load(v_ptr + vt_off, mask=p_ok[:, None, None] & d_ok[None, :, None], other=0.0)
            v = tl.reshape(tl.permute(vt, (0, 2, 1)), (BLOCK_N, BLOCK_D)).to(q.dtype)
        else:
            v = tl.load(v_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if NUM_SPLITS > 1:
        # Partials are laid out [token, head, split] (+ [D] for acc), contiguous.
        num_heads = tl.num_programs(1) * GROUP
        part = ((q_start + t) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        if FUSED_COMBINE:
            # The last split of this (program, KV head) to finish merges its rows' partials (the combine kernel's
            # arithmetic, the splits summed in order) and sets its count back to 0 for the next call.
            tl.debug_barrier()  # (every thread's partials stored before the count says this split is done)
            count_ptr = counts_ptr + pid * tl.num_programs(1) + kvh
            done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            if done == NUM_SPLITS - 1:
                tl.store(count_ptr, 0)
                _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sinks_ptr, part - split, q_start + t,
                              head, row_ok, offs_d, d_ok, stride_ot, stride_oh, HEAD_DIM, BLOCK_M, BLOCK_D,
                              NUM_SPLITS, HAS_SINKS)
    else:
        if HAS_SINKS:
            # The sink: one more score, exp(sink - m) in the sum, nothing in the accumulator.
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_sink = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_sink)  # (0 where the row saw no key)
            l_i = l_i * alpha + tl.exp(sink - m_sink)
            acc = acc * alpha[:, None]
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + t)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sinks_ptr, first, row, head, row_ok, offs_d, d_ok,
                  stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Rows `row` x `head` ([BLOCK_M]) of the output from their NUM_SPLITS partials (at `first` + split): each
    rescaled to the common max and normalised, the head's sink logit one more score (HAS_SINKS). Loads bypass L1:
    the other splits' programs wrote the partials."""
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(part_m_ptr + first + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, m_s)
    sink = m_max  # (unused without sinks)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_M], tl.float32)
    merged = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(part_m_ptr + first + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_l_ptr + first + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_safe))  # an empty split weighs nothing
        total += w * l_s
        acc_s = tl.load(part_acc_ptr + (first + s)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        merged += w[:, None] * acc_s
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    out = merged / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_attention_combine_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ot, stride_oh, sinks_ptr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One (token, head) per program: rescales each split's partial to the common max and normalises (with the
    head's sink logit, HAS_SINKS, as one more score: added here once, not by the splits)."""
    pdl_begin(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    part = (row * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m = tl.load(part_m_ptr + part)
    s = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    sink = m_max  # (unused without sinks)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))  # an empty split weighs nothing
    total = tl.sum(w * s, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, P, page, Hkv, D]
    query_start_loc: torch.Tensor,  # [B+1] int32 (device)
    seq_lens: torch.Tensor,  # [B] int32 (device)
    page_tables: torch.Tensor,  # [B, max_pages] int32 (device)
    prog_req: torch.Tensor,
    prog_q0: torch.Tensor,
    block_q: int,
    block_m: int,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int = 1,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_stages: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sinks` [Hq]: attention-sink logits (module docstring); `chunk_size`: each row sees only the keys of its
    chunk (positions [p // C * C, p]), Llama 4's chunked local attention; `softcap`: scores soft-capped to
    softcap * tanh(score / softcap) before the softmax (Gemma 2). `num_splits` > 1 (a power of two) splits each program's key range (see the module docstring);
    `scratch` is (m, l, acc) float32 partials of at least T*Hq*S (acc: x D) elements, allocated here
    when None. `num_stages` (key tiles in flight), `block_n` (keys a tile) and `num_warps` override the defaults
    (kv_stages; the tile by page size and split; 4 warps up to 64 rows), for measuring them. `counts` (split-KV
    only: int32 zeros, one a program and KV head, left zero after the call): the last split of each program merges
    the partials itself, and no combine kernel runs (the attention_fused_combine knob)."""
    num_tokens, num_heads, head_dim = query.shape
    _, num_pages, page, num_kv_heads, _ = kv_cache.shape
    k_cache = kv_cache[0].view(num_pages * page, num_kv_heads, head_dim)
    v_cache = kv_cache[1].view(num_pages * page, num_kv_heads, head_dim)
    if out is None:
        out = torch.empty_like(query)
    v_t = v_transposed(kv_cache.dtype)
    if num_splits > 1:
        # Small tiles: a short context still spreads over several splits.
        block_n = block_n or (max(32, page) if v_t else 32)
        if scratch is None:
            scratch = split_scratch(num_tokens, num_heads, head_dim, num_splits, query.device)
        part_m, part_l, part_acc = scratch
    else:
        block_n = block_n or kv_block_n(page, block_m, kv_cache.dtype)
        part_m = part_l = part_acc = out  # (unused)
    assert not v_t or block_n % page == 0, f"an 8-bit cache's tiles are whole pages: {block_n} keys, pages of {page}"
    grid = (prog_req.numel(), num_kv_heads, num_splits)
    fused = num_splits > 1 and counts is not None
    if fused:
        assert counts.dtype == torch.int32 and counts.numel() >= grid[0] * grid[1], "a count a program and KV head"
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, part_m, part_l, part_acc, counts if fused else seq_lens,
        page_tables, seq_lens, query_start_loc, prog_req, prog_q0, sinks if sinks is not None else out,
        scale, sliding_window or 0, chunk_size or 1, softcap or 1.0,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        page_tables.stride(0),
        PAGE=page, GROUP=num_heads // num_kv_heads, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=causal,
        USE_WINDOW=sliding_window is not None, IEEE=query.dtype == torch.float32, NUM_SPLITS=num_splits,
        NUM_STAGES=kv_stages(block_m, query.dtype) if num_stages is None else num_stages,
        DOT_F16=kv_cache.dtype.itemsize == 1 and query.dtype == torch.bfloat16, V_T=v_t, HAS_SINKS=sinks is not None,
        USE_CHUNK=chunk_size is not None, SOFTCAP=softcap is not None, FUSED_COMBINE=fused,
        num_warps=num_warps or (4 if block_m <= 64 else 8), **launch_options(query.device),
    )
    if num_splits > 1 and not fused:
        _paged_attention_combine_kernel[(num_tokens, num_heads)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), sinks if sinks is not None else out,
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits,
            HAS_SINKS=sinks is not None, num_warps=4 if head_dim * num_splits >= 2048 else 2, **launch_options(query.device),
        )
    return out


def split_scratch(num_tokens: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 (m, l, acc) partials for a split-KV call (no zeroing needed: every entry is written)."""
    rows = num_tokens * num_heads * num_splits
    buf = torch.empty(rows * (head_dim + 2), dtype=torch.float32, device=device)
    return buf[:rows], buf[rows: 2 * rows], buf[2 * rows:]
