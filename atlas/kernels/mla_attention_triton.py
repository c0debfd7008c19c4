"""Triton absorbed MLA attention over the paged latent cache, for every kind of step: prefill chunks over
a cached prefix, decodes and speculative verify rows (causal, with each request's offset).

One program handles BLOCK_Q consecutive query tokens of one request and HEADS_PER_PROGRAM of its query
heads: the key is the same latent row for every head (MQA), so each cached row is read once per head
block. Scores are q_lat . c + q_pe . k_pe (the latent and rope parts of the row, two dots); the values
are the latents c, so the output is the attention-weighted latent per head (the caller maps it through
W_UV). The PyTorch reference it is tested against is kernels/mla_attention_ref.py. An 8-bit cache
(--kv-cache-dtype fp8: the same row in float8 e4m3) is read at half the bytes and widened to the queries'
type tile by tile, so the products are those of a 16-bit cache holding the rounded values.

Split-KV: a decode request has one program per head block, which alone walks its whole context (at batch
1 one SM of 132 works: slower than the eager reference at 8K tokens, BENCHMARKS.md). With NUM_SPLITS > 1
each program's key range is cut into that many chunks, one program each, which write float32 partials
(running max, sum, latent accumulator) that the GQA kernel's combine kernel merges, as
kernels/paged_attention_triton.py does for GQA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels import settings
from atlas.kernels.paged_attention_triton import _paged_attention_combine_kernel, split_scratch
from atlas.kernels.pdl import launch_options

MAX_HEADS_PER_PROGRAM = 64


# Integer arguments that change from step to step are not specialised on (no recompiles as tables grow).
@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key tile of the online softmax: the masked scores qk [rows, keys] (-inf where hidden) and the tile's values
    v [keys, width] fold into the running max m_i, sum l_i and weighted values acc -> (m_i, l_i, acc). A row that has
    seen no visible key keeps max -inf and adds nothing. (The DSA kernel takes it too.)"""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["scale", "stride_bt"])
def _mla_attention_kernel(
    ql_ptr, qp_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    page_tables_ptr, seq_lens_ptr, query_start_loc_ptr, prog_req_ptr, prog_q0_ptr,
    scale,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_slot, stride_ot, stride_oh, stride_bt,
    NUM_HEADS: tl.constexpr, PAGE: tl.constexpr, HPB: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LATENT: tl.constexpr, BLOCK_L: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    head_block = tl.program_id(1)
    req = tl.load(prog_req_ptr + pid)
    q0 = tl.load(prog_q0_ptr + pid)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # position of the request's first query row

    offs_m = tl.arange(0, BLOCK_M)
    t = q0 + offs_m // HPB  # query index within the request
    head = head_block * HPB + offs_m % HPB
    row_ok = (offs_m < BLOCK_Q * HPB) & (t < q_len) & (head < NUM_HEADS)
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < LATENT
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < ROPE
    rows = (q_start + t).to(tl.int64)
    ql = tl.load(ql_ptr + rows[:, None] * stride_qlt + head[:, None] * stride_qlh + offs_l[None, :],
                 mask=row_ok[:, None] & l_ok[None, :], other=0.0)
    qp = tl.load(qp_ptr + rows[:, None] * stride_qpt + head[:, None] * stride_qph + offs_r[None, :],
                 mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    q_pos = ctx + t

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)

    kv_end = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)
    kv_begin = 0
    if NUM_SPLITS > 1:
        # This split's share of [0, kv_end), in whole BLOCK_N tiles.
        split = tl.program_id(2)
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_begin = split * chunk
        kv_end = tl.minimum(kv_end, kv_begin + chunk)
    # Software-pipelined over the latent tiles (NUM_STAGES > 1), as the GQA kernel is.
    for n in tl.range(kv_begin, kv_end, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        page = tl.load(page_tables_ptr + req * stride_bt + offs_n // PAGE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE + offs_n % PAGE
        # (an 8-bit cache is widened to the queries' type here, exactly: every e4m3 value is a bf16 and an fp32)
        c = tl.load(cache_ptr + slot[:, None] * stride_slot + offs_l[None, :], mask=n_ok[:, None] & l_ok[None, :],
                    other=0.0).to(ql.dtype)
        kp = tl.load(cache_ptr + slot[:, None] * stride_slot + LATENT + offs_r[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(ql.dtype)
        if IEEE:
            qk = tl.dot(ql, tl.trans(c), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            qk = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(kp))
        qk = qk * scale
        visible = n_ok[None, :] & row_ok[:, None] & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, c, m_i, l_i, acc, IEEE)
    if NUM_SPLITS > 1:
        # Partials laid out [token, head, split] (+ [LATENT] for acc), contiguous, as the combine kernel reads.
        part = (rows * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * LATENT + offs_l[None, :], acc, mask=row_ok[:, None] & l_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & l_ok[None, :])


def mla_attention_triton(
    q_latent: torch.Tensor,  # [T, H, Lkv] (unit stride on the last dim)
    q_pe: torch.Tensor,  # [T, H, R]
    cache: torch.Tensor,  # [P, page, Lkv + R], in the queries' dtype or float8 e4m3 (--kv-cache-dtype fp8)
    query_start_loc: torch.Tensor,  # [B+1] int32 (device)
    seq_lens: torch.Tensor,  # [B] int32 (device)
    page_tables: torch.Tensor,  # [B, max_pages] int32 (device)
    prog_req: torch.Tensor,
    prog_q0: torch.Tensor,
    block_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int = 1,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """`num_splits` > 1 (a power of two; decode steps, block_q 1) splits each program's key range (module docstring); `scratch`:
    float32 (m, l, acc) partials of at least T*H*S (acc: x latent) elements, allocated here when None.
    `num_stages`: latent tiles in flight (default the mla_kv_stages knob for decode programs in 16-bit, else 1)."""
    num_tokens, num_heads, latent = q_latent.shape
    rope = q_pe.shape[-1]
    # (Split-KV is for decode steps: their programs hold at most 64 query rows, whose tiles leave shared
    # memory for the partials' pipelining; 128-row prefill tiles of a 512-wide latent do not.)
    assert num_splits == 1 or block_q == 1, "split-KV runs decode steps only (block_q 1)"
    num_pages, page, width = cache.shape
    assert width == latent + rope and q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1
    flat = cache.view(num_pages * page, width)
    if out is None:
        out = torch.empty(num_tokens, num_heads, latent, dtype=q_latent.dtype, device=q_latent.device)
    fp32 = q_latent.dtype == torch.float32
    # The query tile [BLOCK_M, latent] and a key tile share an SM's 227 KiB of shared memory (H200). fp32
    # tiles of a 512-wide latent are twice the bytes, so fp32 (the exactness path) keeps at most 64 query
    # rows (fewer heads a program when a head count that is not a power of two pads the rows out) and
    # takes 16 keys a tile without pipelining.
    max_rows = 64 if fp32 else 128
    hpb = min(triton.next_power_of_2(num_heads), MAX_HEADS_PER_PROGRAM)
    while hpb > 1 and block_q * hpb > max_rows:
        hpb //= 2
    block_m = max(16, triton.next_power_of_2(block_q * hpb))
    grid = (prog_req.numel(), triton.cdiv(num_heads, hpb), num_splits)
    tuning = {"num_stages": 1} if fp32 else {}
    if num_stages is None:  # (a prefill tile's 128 query rows of 512 leave no shared memory for more stages)
        num_stages = settings.tuning.mla_kv_stages if block_q == 1 and block_m <= 64 and not fp32 else 1
    if num_splits > 1:
        part_m, part_l, part_acc = scratch or split_scratch(num_tokens, num_heads, latent, num_splits, out.device)
    else:
        part_m = part_l = part_acc = out  # (unused)
    _mla_attention_kernel[grid](
        q_latent, q_pe, flat, out, part_m, part_l, part_acc,
        page_tables, seq_lens, query_start_loc, prog_req, prog_q0,
        scale,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), flat.stride(0),
        out.stride(0), out.stride(1), page_tables.stride(0),
        NUM_HEADS=num_heads, PAGE=page, HPB=hpb, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=16 if fp32 else 32,
        LATENT=latent, BLOCK_L=max(16, triton.next_power_of_2(latent)), ROPE=rope,
        BLOCK_R=max(16, triton.next_power_of_2(rope)), IEEE=fp32, NUM_SPLITS=num_splits, NUM_STAGES=num_stages,
        num_warps=4 if block_m <= 32 else 8, **tuning,
    )
    if num_splits > 1:
        combine_split_partials((part_m, part_l, part_acc), out, num_splits)
    return out


def combine_split_partials(partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor,
                           num_splits: int) -> None:
    """A split step's float32 (m, l, acc) partials, laid out [row, head, split] (+ [latent]), merged into out
    [T, H, latent] by the GQA kernel's combine kernel (this kernel's and the DSA kernel's splits)."""
    num_tokens, num_heads, latent = out.shape
    _paged_attention_combine_kernel[(num_tokens, num_heads)](
        *partials, out, out.stride(0), out.stride(1), out,
        HEAD_DIM=latent, BLOCK_D=triton.next_power_of_2(latent), NUM_SPLITS=num_splits,
        HAS_SINKS=False, num_warps=4 if latent * num_splits >= 2048 else 2, **launch_options(out.device),
    )
