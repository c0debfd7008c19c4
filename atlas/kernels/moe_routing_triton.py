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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atlas.kernels.pdl import launch_options
from atlas.kernels.pdl_triton import pdl_begin

SOFTMAX, SIGMOID, SOFTMAX_CHOSEN = 0, 1, 2
SCORINGS = {"softmax": SOFTMAX, "sigmoid": SIGMOID, "softmax_chosen": SOFTMAX_CHOSEN}


@triton.jit
def route_token(
    logits_ptr, bias_ptr, t, E, stride_lt, scale, norm_floor, norm_eps, TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr,
):
    """Token t's choice as the module docstring says -> (weights [BLOCK_K] float32 times scale, expert ids
    [BLOCK_K] int64), choice j at index j (entries from TOPK on are unused). Shared by the router's kernel below and
    the routed experts' gate|up kernel that chooses for itself (kernels/moe_triton.py)."""
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    offs_k = tl.arange(0, BLOCK_K)
    logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + offs, mask=ok, other=float("-inf")).to(tl.float32)
    top = 0.0
    total = 1.0
    if SCORING == 0:
        top = tl.max(logits, axis=0)
        total = tl.sum(tl.exp(logits - top), axis=0)
    scores, choice = _scored(logits, bias_ptr, offs, ok, top, total, SCORING, HAS_BIAS)
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
    return picked * scale, picked_ids


@triton.jit
def _scores_at(row, bias_ptr, cols, E, top, total, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr):
    """_scored of the experts at cols, loaded from row (the token's logits pointer)."""
    ok = cols < E
    logits = tl.load(row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    return _scored(logits, bias_ptr, cols, ok, top, total, SCORING, HAS_BIAS)


@triton.jit
def _scored(logits, bias_ptr, cols, ok, top, total, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(scores, choice) of the float32 logits of the experts at cols (top and total: softmax's max and sum of
    exponentials, used when SCORING is softmax); the choice adds the correction bias, -inf outside ok."""
    if SCORING == 0:
        scores = tl.exp(logits - top) / total
    elif SCORING == 1:
        scores = tl.sigmoid(logits)
    else:
        scores = logits
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return scores, tl.where(ok, choice, float("-inf"))


@triton.jit
def route_pair(
    logits_ptr, bias_ptr, t, j, E, stride_lt, scale, norm_floor, norm_eps, TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr,
):
    """route_token's choice j of token t alone -> (its weight times scale, its expert id int64), by ranks instead of
    TOPK rounds: an expert's rank is how many experts come before it (a greater choice, or an equal one at a lower
    index: the order of route_token's rounds), choice j is the expert of rank j and the chosen are those of rank
    below TOPK. The comparison runs RANK_TILE / BLOCK_E columns at a time (their scores recomputed from the logits,
    the same numbers), so it holds few registers: for kernels whose every program chooses (the routed experts' gate|up),
    where route_token's three reductions a round would be the programs' latency. The same experts as route_token;
    the renormalizing sum adds the chosen in expert order (route_token: in choice order)."""
    offs = tl.arange(0, BLOCK_E)
    row = logits_ptr + t.to(tl.int64) * stride_lt
    top = 0.0
    total = 1.0
    if SCORING == 0:
        logits = tl.load(row + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
        top = tl.max(logits, axis=0)
        total = tl.sum(tl.exp(logits - top), axis=0)
    scores, choice = _scores_at(row, bias_ptr, offs, E, top, total, SCORING, HAS_BIAS)
    CHUNK: tl.constexpr = RANK_TILE // BLOCK_E if BLOCK_E >= 64 else BLOCK_E
    rank = tl.zeros([BLOCK_E], tl.int32)
    for c0 in tl.static_range(0, BLOCK_E, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        _, other = _scores_at(row, bias_ptr, cols, E, top, total, SCORING, HAS_BIAS)
        before = (other[None, :] > choice[:, None]) | ((other[None, :] == choice[:, None]) &
                                                       (cols[None, :] < offs[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
    ok = offs < E
    chosen = ok & (rank < TOPK)
    picked = ok & (rank == j)
    expert = tl.sum(tl.where(picked, offs, 0), axis=0)
    value = tl.sum(tl.where(picked, scores, 0.0), axis=0)
    if SCORING == 2:
        best = tl.max(tl.where(chosen, scores, float("-inf")), axis=0)
        value = tl.exp(value - best) / tl.sum(tl.where(chosen, tl.exp(scores - best), 0.0), axis=0)
        if ROUND:
            value = value.to(logits_ptr.dtype.element_ty).to(tl.float32)
    elif NORM:
        value = value / (tl.maximum(tl.sum(tl.where(chosen, scores, 0.0), axis=0), norm_floor) + norm_eps)
    return value * scale, expert.to(tl.int64)


# route_pair's comparisons at once (sm_90 compile at 4 warps: the gate|up kernel stays at 64 registers a thread for 64
# and 128 experts; a whole [64, 64] comparison took 111, half the programs an SM), and the experts it takes at most
# (Qwen3-MoE's 128)
RANK_TILE = tl.constexpr(2048)
MAX_RANKED_EXPERTS = 128


@triton.jit
def _select_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_lt, scale, norm_floor, norm_eps,
    TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    pdl_begin(PDL)
    picked, picked_ids = route_token(logits_ptr, bias_ptr, t, E, stride_lt, scale, norm_floor, norm_eps, TOPK,
                                     BLOCK_E, BLOCK_K, SCORING, HAS_BIAS, NORM, ROUND)
    out = t.to(tl.int64) * TOPK + offs_k
    tl.store(weights_ptr + out, picked, mask=offs_k < TOPK)
    tl.store(ids_ptr + out, picked_ids, mask=offs_k < TOPK)


@dataclass(frozen=True)
class Routing:
    """A router's choice still to be made in a kernel: logits [T, E] (unit stride along E) and how select_topk
    chooses from them (its arguments). The routed experts' gate|up kernel takes one to choose for itself
    (kernels/moe_triton.moe_pairs_routed_gate_up_act)."""

    logits: torch.Tensor
    top_k: int
    scoring: str
    norm: bool = True
    scale: float = 1.0
    bias: torch.Tensor | None = None
    norm_floor: float = 0.0
    norm_eps: float = 1e-20

    def __post_init__(self):
        e = self.logits.shape[1]
        assert self.logits.dim() == 2 and self.logits.stride(1) == 1 and 1 <= self.top_k <= e, (
            self.logits.shape, self.logits.stride(), self.top_k)
        assert self.bias is None or (self.bias.shape == (e,) and self.scoring != "softmax_chosen"), (
            None if self.bias is None else self.bias.shape)

    def args(self) -> tuple:
        """route_token's runtime arguments after t: logits, bias (the logits where none), E, stride, scale, floor,
        eps."""
        lg = self.logits
        return (lg, self.bias if self.bias is not None else lg, lg.shape[1], lg.stride(0), float(self.scale),
                float(self.norm_floor), float(self.norm_eps))

    def constexprs(self) -> dict:
        """route_token's compile-time arguments but TOPK."""
        return dict(BLOCK_E=triton.next_power_of_2(self.logits.shape[1]), BLOCK_K=triton.next_power_of_2(self.top_k),
                    SCORING=SCORINGS[self.scoring], HAS_BIAS=self.bias is not None, NORM=self.norm,
                    ROUND=self.logits.dtype != torch.float32)


def select_topk(logits: torch.Tensor, top_k: int, scoring: str, norm: bool = True, scale: float = 1.0,
                bias: torch.Tensor | None = None, norm_floor: float = 0.0, norm_eps: float = 1e-20
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride along E) -> (weights [T, top_k] float32, ids [T, top_k] int64), as the module
    docstring says for `scoring` (softmax, sigmoid, softmax_chosen); bias [E] (float32) joins the choice only;
    norm_floor: the least sum the renormalization divides by (ERNIE's moe_norm_min), norm_eps what it adds to it."""
    routing = Routing(logits, top_k, scoring, norm, scale, bias, norm_floor, norm_eps)
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    lg, b, e, stride, scale, floor, eps = routing.args()
    _select_topk_kernel[(t,)](
        lg, b, weights, ids, e, stride, scale, floor, eps, TOPK=top_k, **routing.constexprs(),
        num_warps=4 if e <= 256 else 8, **launch_options(logits.device, moe=True),
    )
    return weights, ids
