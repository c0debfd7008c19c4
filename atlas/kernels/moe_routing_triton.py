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
def _select_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_lt, scale, norm_floor, norm_eps,
    TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    offs_k = tl.arange(0, BLOCK_K)
    pdl_begin(PDL)
    logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + offs, mask=ok, other=float("-inf")).to(tl.float32)
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
            picked = picked.to(logits_ptr.dtype.element_ty).to(tl.float32)
    elif NORM:
        picked = picked / (tl.maximum(tl.sum(tl.where(k_ok, picked, 0.0), axis=0), norm_floor) + norm_eps)
    out = t.to(tl.int64) * TOPK + offs_k
    tl.store(weights_ptr + out, picked * scale, mask=k_ok)
    tl.store(ids_ptr + out, picked_ids, mask=k_ok)


def select_topk(logits: torch.Tensor, top_k: int, scoring: str, norm: bool = True, scale: float = 1.0,
                bias: torch.Tensor | None = None, norm_floor: float = 0.0, norm_eps: float = 1e-20
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride along E) -> (weights [T, top_k] float32, ids [T, top_k] int64), as the module
    docstring says for `scoring` (softmax, sigmoid, softmax_chosen); bias [E] (float32) joins the choice only;
    norm_floor: the least sum the renormalization divides by (ERNIE's moe_norm_min), norm_eps what it adds to it."""
    t, e = logits.shape
    assert logits.stride(1) == 1 and 1 <= top_k <= e, (logits.stride(), top_k, e)
    assert bias is None or (bias.shape == (e,) and scoring != "softmax_chosen"), (None if bias is None else bias.shape)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    _select_topk_kernel[(t,)](
        logits, bias if bias is not None else logits, weights, ids, e, logits.stride(0), float(scale),
        float(norm_floor), float(norm_eps),
        TOPK=top_k, BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
        SCORING=SCORINGS[scoring], HAS_BIAS=bias is not None, NORM=norm,
        ROUND=logits.dtype != torch.float32, num_warps=4 if e <= 256 else 8,
        **launch_options(logits.device, moe=True),
    )
    return weights, ids
