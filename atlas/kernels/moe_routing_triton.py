"""The router's choice in one Triton kernel: router logits [T, E] -> (routing weights [T, k] float32, expert ids
[T, k] int64), one program a token.

Why: at one token, layers/moe.select_experts is about ten small kernels (scores, top-k, gather, sum, divide,
scale), each a few microseconds, in every MoE layer of a decode step. Here the E logits of a token sit in one
program's registers: scores, k rounds of arg-max (the chosen expert masked out after each), the weights, one store.

Modes (SCORING): softmax or sigmoid scores over all E experts (the choice by score + correction bias when there
is one; the weights the unbiased scores of the chosen, renormalized to sum 1 with NORM, times `scale`), as
select_experts without expert groups; or softmax over the k chosen logits only (gpt-oss's router), rounded to
ROUND_DTYPE's precision as the reference's softmax in the model dtype rounds. Ties go to the lower expert index
(torch.topk leaves their order unspecified). The reference is layers/moe.select_experts (and models/gpt_oss.py's
router); layers/moe.py dispatches.

At a few tokens the router's matmul joins it (route_tokens): a decode step's router was three kernels a layer (the
hidden state cast to float32, cuBLAS's float32 product with the [E, D] gate, the choice), about 0.44 ms of a 3.2 ms
Qwen3-30B-A3B step on an H200. Programs (token, slice of experts) write their logits, count themselves in on an
atomic counter per token, and the last one in reads all E logits back and makes the choice; it leaves the counter
at 0 for the next launch, which is what lets a CUDA graph replay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin

SOFTMAX, SIGMOID, SOFTMAX_CHOSEN = 0, 1, 2
SCORINGS = {"softmax": SOFTMAX, "sigmoid": SIGMOID, "softmax_chosen": SOFTMAX_CHOSEN}


@triton.jit
def _choose(t, logits, offs, ok, bias_ptr, weights_ptr, ids_ptr, scale, round_ptr,
            TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SCORING: tl.constexpr,
            HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr):
    """Token t's choice from its float32 logits [BLOCK_E] (-inf past E): weights and ids stored at row t."""
    offs_k = tl.arange(0, BLOCK_K)
    if SCORING == 0:
        e = tl.exp(logits - tl.max(logits, axis=0))
        scores = e / tl.sum(e, axis=0)
    elif SCORING == 1:
        scores = tl.sigmoid(logits)
    else:
        scores = logits
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    picked = tl.zeros([BLOCK_K], tl.float32)
    picked_ids = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOPK):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, offs, BLOCK_E), axis=0)  # (the lowest index among equals)
        value = tl.sum(tl.where(offs == idx, scores, 0.0), axis=0)
        picked = tl.where(offs_k == j, value, picked)
        picked_ids = tl.where(offs_k == j, idx.to(tl.int64), picked_ids)
        choice = tl.where(offs == idx, float("-inf"), choice)
    k_ok = offs_k < TOPK
    if SCORING == 2:
        e = tl.where(k_ok, tl.exp(picked - tl.max(tl.where(k_ok, picked, float("-inf")), axis=0)), 0.0)
        picked = e / tl.sum(e, axis=0)
        if ROUND:
            picked = picked.to(round_ptr.dtype.element_ty).to(tl.float32)
    elif NORM:
        picked = picked / (tl.sum(tl.where(k_ok, picked, 0.0), axis=0) + 1e-20)
    out = t.to(tl.int64) * TOPK + offs_k
    tl.store(weights_ptr + out, picked * scale, mask=k_ok)
    tl.store(ids_ptr + out, picked_ids, mask=k_ok)


@triton.jit
def _select_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_lt, scale,
    TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    pdl_begin(PDL)
    logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + offs, mask=ok, other=float("-inf")).to(tl.float32)
    _choose(t, logits, offs, ok, bias_ptr, weights_ptr, ids_ptr, scale, logits_ptr,
            TOPK, BLOCK_E, BLOCK_K, SCORING, HAS_BIAS, NORM, ROUND)


@triton.jit
def _route_kernel(
    x_ptr, w_ptr, bias_ptr, logits_ptr, count_ptr, weights_ptr, ids_ptr, E, D, stride_xt, scale,
    TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ES: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, s): token t's float32 logits of experts [s * BLOCK_ES, (s + 1) * BLOCK_ES) from its hidden state
    and the float32 gate [E, D]; the last of the token's SPLITS programs to finish makes the choice."""
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_ES + tl.arange(0, BLOCK_ES)
    row_ok = rows < E
    cols = tl.arange(0, BLOCK_D)
    pdl_begin(PDL)
    acc = tl.zeros([BLOCK_ES], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        c_ok = c < D
        x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + c, mask=c_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * D + c[None, :], mask=row_ok[:, None] & c_ok[None, :],
                    other=0.0)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(logits_ptr + t.to(tl.int64) * E + rows, acc, mask=row_ok)
    # (acq_rel: this program's logits are visible before its count, and the last one sees every program's)
    arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if arrived == SPLITS - 1:
        offs = tl.arange(0, BLOCK_E)
        ok = offs < E
        logits = tl.load(logits_ptr + t.to(tl.int64) * E + offs, mask=ok, other=float("-inf"), volatile=True)
        tl.store(count_ptr + t, 0)
        _choose(t, logits, offs, ok, bias_ptr, weights_ptr, ids_ptr, scale, logits_ptr,
                TOPK, BLOCK_E, BLOCK_K, SCORING, HAS_BIAS, NORM, False)


def select_topk(logits: torch.Tensor, top_k: int, scoring: str, norm: bool = True, scale: float = 1.0,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride along E) -> (weights [T, top_k] float32, ids [T, top_k] int64), as the module
    docstring says for `scoring` (softmax, sigmoid, softmax_chosen); bias [E] (float32) joins the choice only."""
    t, e = logits.shape
    assert logits.stride(1) == 1 and 1 <= top_k <= e, (logits.stride(), top_k, e)
    assert bias is None or (bias.shape == (e,) and scoring != "softmax_chosen"), (None if bias is None else bias.shape)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    _select_topk_kernel[(t,)](
        logits, bias if bias is not None else logits, weights, ids, e, logits.stride(0), float(scale),
        TOPK=top_k, BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
        SCORING=SCORINGS[scoring], HAS_BIAS=bias is not None, NORM=norm,
        ROUND=logits.dtype != torch.float32, num_warps=4 if e <= 256 else 8,
        **launch_options(logits.device, moe=True),
    )
    return weights, ids


#: most tokens route_tokens takes (its counters' length): past a few tokens the gate's re-read per token loses to
#: one matmul
ROUTE_MAX_TOKENS = 8
_EXPERTS_A_PROGRAM = 8
_BLOCK_D = 512


def route_tokens(x: torch.Tensor, gate: torch.Tensor, counts: torch.Tensor, top_k: int, scoring: str,
                 norm: bool = True, scale: float = 1.0, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states x [T, D] (T <= ROUTE_MAX_TOKENS, unit stride along D) and the float32 gate [E, D] -> (weights
    [T, top_k] float32, ids [T, top_k] int64): select_topk of x.float() @ gate.T (softmax or sigmoid scores) in one
    launch. counts: int32 [ROUTE_MAX_TOKENS] zeros, the caller's own (the kernel leaves them at 0)."""
    t, d = x.shape
    e = gate.shape[0]
    assert 1 <= t <= ROUTE_MAX_TOKENS and x.stride(1) == 1 and gate.is_contiguous() and gate.shape[1] == d, (
        tuple(x.shape), x.stride(), tuple(gate.shape))
    assert gate.dtype == torch.float32 and scoring in ("softmax", "sigmoid") and 1 <= top_k <= e
    assert counts.dtype == torch.int32 and counts.numel() >= t
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    splits = triton.cdiv(e, _EXPERTS_A_PROGRAM)
    _route_kernel[(t, splits)](
        x, gate, bias if bias is not None else gate, logits, counts, weights, ids, e, d, x.stride(0), float(scale),
        TOPK=top_k, BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_ES=_EXPERTS_A_PROGRAM, BLOCK_D=_BLOCK_D, SPLITS=splits, SCORING=SCORINGS[scoring],
        HAS_BIAS=bias is not None, NORM=norm, num_warps=4, **launch_options(x.device, moe=True),
    )
    return weights, ids
