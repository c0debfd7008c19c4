"""Mixture of experts: DeepSeek-style routing (sigmoid or softmax scores, grouped top-k, correction bias
used for choosing only) and routed experts computed grouped over the tokens sent to them.

Routing runs in float32 (as the reference implementations do). The experts' weights are stacked
([E, 2I, D] gate|up and [E, D, I] down): the (token, expert) pairs are sorted by expert and each
expert's rows go through one matmul, as a single grouped GEMM where PyTorch has one (no host sync, so
it can run inside a CUDA graph) and otherwise one batched matmul per expert that has tokens. On CUDA,
steps of up to the moe_triton_max_tokens tuning knob's tokens (default 64; kernels/settings.py) take Triton
kernels instead (kernels/moe_triton.py), which read each used expert's weights about once (the grouped GEMM
took ~4x that read at one token): one row per (token, choice) pair, unsorted, up to MOE_PAIRS_MAX_TOKENS
tokens, the rows sorted by expert above. At those few tokens (moe_fused_pairs knob), gate|up comes with the
activation as its epilogue and down with the routing weights' sum, and pairs of weight 0 are skipped; and on CUDA
the router's choice is one kernel (moe_fused_routing knob; kernels/moe_routing_triton.py) where experts are not
chosen by groups. Both cut the short kernels a decode step of an MoE model launches by about ten a layer. With the
moe_route_in_experts knob (off: timed slower) FusedExperts.forward_routed makes that choice inside the gate|up kernel
instead, one launch fewer (the MoE blocks that route and run experts on the same rows call it).
Spec: ../shared/specs/mla-mtp-dsa-longcat.md section 2.

Expert biases and gpt-oss's clamped SwiGLU (FusedExperts(bias=True, swiglu=(alpha, limit))): the gate|up bias is
added to each row's gate|up product by its expert id, then the activation (kernels/moe.clamped_swiglu; on CUDA one
Triton kernel with its roundings, fused_ops.clamped_act_and_mul), then the down product takes its expert's bias;
tensor ops between the matmuls, so the grouped GEMM, the Triton kernels and the per-expert loop all serve them (and
CUDA graphs still capture them); the Triton grouped kernel adds the biases in its epilogue. At up to 4 tokens the
fused gate|up kernel adds the bias and applies the clamped activation in its epilogue
(kernels/fused_ops_triton.gated_pair), with the rounding of those tensor ops.

FP8 experts (FusedExperts built inside layers/linear.quantizing of an FP8 scheme with dynamic activations): w13 / w2
in float8_e4m3fn with float32 scales, loaded per expert from the checkpoint's `{gate|up|down}_proj.weight` and their
scales (this rank's part of them). Block-scaled checkpoints (weight_block_size, the DeepSeek-V3 / Qwen3-MoE-FP8
layout): w13_weight_scale_inv [E, 2I / bn, ceil(D / bk)] and w2_weight_scale_inv [E, ceil(D / bn), ceil(I / bk)];
per-channel and per-tensor ones (`.weight_scale`): w13_weight_scale [E, 2I] and w2_weight_scale [E, D], a scale per
row (a piece's per-tensor scale stored for each of its rows, as layers/linear.py does). On CUDA every token count takes the Triton kernels, which scale each FP8 tile by its blocks' scales in registers (no
grouped GEMM, no dequantized copy; no host sync, so CUDA graphs as before; the moe_triton_max_tokens knob does not
apply to them). Elsewhere (CPU, or no Triton) the experts are dequantized per call (FP8 x scale in float32, rounded to
the activation dtype, exactly models/quantization.dequantize_fp8's numbers) and run the grouped path's math: a CPU run
of the FP8 checkpoint gives the logits of the checkpoint of its dequantized weights. The gate and up rows share w13, so
with block scales I (this rank's) must be a multiple of bn, and under tensor parallelism down's columns must split
into whole bk blocks; a split that cuts a block, and experts with biases or another activation (gpt-oss, DeepSeek-V4:
not FP8 families) keep plain weights (the checkpoint's dequantized as they load: the models' keeps_fp8), as do
checkpoints with static activation scales (the experts would not use them: they compute with unquantized
activations). The kernels' FP8 paths have run in Triton's interpreter only so far (not yet on a GPU, nor timed).

MXFP4 experts (FusedExperts(mxfp4=True): gpt-oss's checkpoints, models/gpt_oss.py): w13 uint8 [E, 2I, D / 2]
and w2 uint8 [E, D, I / 2] (two FP4 E2M1 codes a byte, the low nibble the even column) with their E8M0 scales
w13_scales uint8 [E, 2I, D / 32] and w2_scales [E, D, I / 32] beside them, loaded from the checkpoint's
stacked `*_blocks` / `*_scales` (gate and up rows apart as whole rows; under tensor parallelism this rank's
rows of w13 and its whole runs of 32 of w2's columns, bytes and scales together). On CUDA the Triton kernels
read them at every token count (scale=; no grouped GEMM, no host sync: CUDA graphs), gpt-oss's biases and
clamped SwiGLU as for plain experts (the fused gate|up epilogue at up to 4 tokens, _activate between the
grouped kernels above). Elsewhere (the CPU) forward_grouped dequantizes them per call with
kernels/mxfp4.dequantize_mxfp4 itself, then the grouped path's math: the dequantized checkpoint's
logits. mxfp4_unusable says where the form cannot be used (the model then dequantizes them as they load).

Tensor parallelism shards every expert (its intermediate rows of gate|up, its columns of down): each
rank runs all routed experts on all tokens at 1/tp of the width and returns a partial sum, which the
MoE block all-reduces once together with its shared experts. Every rank does the same work whatever the
routing, and the memory per rank is the same 1/tp. With --enable-expert-parallel each rank holds 1/tp of
the experts whole and returns the share of the sum its experts make (the other ranks' pairs weigh 0),
through the same single all-reduce: the same memory, wider matmuls a rank, but the all-reduce waits for
the rank whose experts got the most tokens (no all-to-all dispatch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from atlas.errors import ModelLoadError
from atlas.kernels import gemv, settings, triton_available
from atlas.kernels.fused_ops import act_and_mul, clamped_act_and_mul, triton_act_code
from atlas.kernels.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4
from atlas.layers.linear import (
    FP8,
    Fp8Scheme,
    Linear,
    _fp8_param,
    checkpoint_dtype,
    current_scheme,
    loaded_shape,
    materialize,
    narrow_loaded,
    takes_slices,
)
from atlas.layers.parallel import current

logger = logging.getLogger(__name__)

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")

# (The moe_triton_max_tokens knob's default, 64, is a starting point: at 64 tokens V2-Lite's grouped GEMM took
# ~10 ms a step where reading every expert takes ~6.7 ms; the crossover is still to measure. 0: never.)

# Up to this many tokens the kernels take the (token, choice) pairs unsorted (no argsort, no scatter back,
# no offsets: several small launches a layer fewer); an expert two pairs chose is read twice, ~20 % more
# bytes than the distinct experts' at 4 tokens x 6 of 64 experts (V2-Lite). The moe_pairs_max_tokens knob lowers it.
MOE_PAIRS_MAX_TOKENS = 4


def _pairs_max_tokens() -> int:
    """The most tokens the unsorted-pairs kernels take (MOE_PAIRS_MAX_TOKENS, or fewer by the knob)."""
    return min(MOE_PAIRS_MAX_TOKENS, settings.tuning.moe_pairs_max_tokens)


_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The E8M0 code of --load-format dummy's MXFP4 scales: 2^-13.
MXFP4_DUMMY_SCALE = 127 - 13


def local_intermediate_size(intermediate_size: int) -> int:
    """This rank's rows of each expert's intermediate dimension under the current parallel layout: all of them
    under expert parallelism (whole experts a rank), 1/tp of them otherwise."""
    mp = current()
    if mp.expert_parallel and mp.tp_size > 1:
        return intermediate_size
    if intermediate_size % mp.tp_size:
        raise ValueError(f"the experts' intermediate size {intermediate_size} is not divisible by the "
                         f"tensor-parallel size {mp.tp_size}")
    return intermediate_size // mp.tp_size


MXFP4_ASKED_OFF = "--tuning moe_mxfp4=0 asks for it"


def mxfp4_unusable(hidden_size: int, intermediate_size: int,
                   device: torch.device | None = None) -> str | None:
    """Why experts of this hidden size and (this rank's) intermediate size on `device` cannot take the MXFP4
    form, or None where they can. Each run of 32 columns shares a scale: w13's K (hidden) and w2's K (this
    rank's intermediate slice) must be whole runs, so that a rank's bytes and scales slice together. On CUDA
    the Triton kernels read it (without Triton every step would dequantize every expert: dequantized as they
    load instead); on the CPU forward dequantizes per call, exactly the dequantized model's numbers; elsewhere
    (the meta device of parameter counts) the plain form. With a device, the moe_mxfp4 knob off is a reason too."""
    if hidden_size % MXFP4_BLOCK:
        return f"the hidden size {hidden_size} is not a multiple of {MXFP4_BLOCK}"
    if intermediate_size % MXFP4_BLOCK:
        return (f"the experts' intermediate size per tensor-parallel rank, {intermediate_size}, is not a "
                f"multiple of {MXFP4_BLOCK} (down's scales would not slice whole; --enable-expert-parallel "
                "keeps the experts whole)")
    if device is not None:
        if not settings.tuning.moe_mxfp4:
            return MXFP4_ASKED_OFF
        if device.type == "cuda" and not triton_available():
            return "Triton is not installed (the MXFP4 expert kernels are Triton kernels)"
        if device.type not in ("cuda", "cpu"):
            return f"no MXFP4 expert path on the {device.type} device"
    return None


def dequantize_mxfp4_experts(w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stacked MXFP4 experts uint8 [E, N, K / 2] with E8M0 scales [E, N, K / 32] -> [E, N, K] in dtype:
    exactly kernels/mxfp4.dequantize_mxfp4's numbers (it is that function, over the checkpoint's block
    view)."""
    e, n, half = w.shape
    blocks = w.view(e, n, half // (MXFP4_BLOCK // 2), MXFP4_BLOCK // 2)
    return dequantize_mxfp4(blocks, scales, dtype, w.device, "MXFP4 experts")


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring_func: str = "sigmoid"  # sigmoid (V3) | softmax (V2)
    topk_method: str = "noaux_tc"  # noaux_tc (V3, with correction bias) | greedy | group_limited_greedy (V2)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # The least sum of the chosen scores that norm_topk_prob divides by (ERNIE 4.5's moe_norm_min; 0: none), and the
    # epsilon added to it (LFM2-MoE's 1e-6; else 1e-20, which changes no float32 sum)
    norm_floor: float = 0.0
    norm_eps: float = 1e-20
    # The reference computes the logits in the model dtype (transformers' Qwen3-MoE, Mixtral, Qwen3-Next / Qwen3.5-MoE
    # routers: a bf16 linear, the softmax in float32), so the choice of experts matches it in bf16; else float32
    # (DeepSeek, GLM-4.5, LongCat: the weight kept in float32).
    model_dtype_logits: bool = False

    @property
    def grouped(self) -> bool:
        return self.topk_method in ("noaux_tc", "group_limited_greedy") and self.n_group > 1 and (
            self.topk_group < self.n_group)


def select_experts(logits: torch.Tensor, cfg: RouterConfig, correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32, or the model dtype: scored in float32) -> (weights [T, k] float32, expert ids
    [T, k]).

    Scores are sigmoid or softmax of the logits. The choice uses scores + correction_bias (noaux_tc);
    with groups, only the topk_group best groups (by the sum of their two best choice scores for
    noaux_tc, their best score for group_limited_greedy) are eligible. The weights are the unbiased
    scores of the chosen experts, renormalized to sum 1 if norm_topk_prob, times routed_scaling_factor.
    """
    if not cfg.grouped and fused_routing(logits):
        from atlas.kernels.moe_routing_triton import select_topk

        return select_topk(logits.contiguous(), cfg.top_k, cfg.scoring_func, cfg.norm_topk_prob,
                           cfg.routed_scaling_factor, correction_bias, cfg.norm_floor, cfg.norm_eps)
    logits = logits.float()  # (a no-op for float32 logits; the kernel above scores in float32 too)
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if cfg.grouped:
        t, e = choice.shape
        per_group = choice.view(t, cfg.n_group, e // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = per_group.max(dim=-1).values
        keep = group_scores.topk(cfg.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // cfg.n_group, dim=1), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True).clamp_min(cfg.norm_floor) + cfg.norm_eps)
    return weights * cfg.routed_scaling_factor, ids


def fused_routing(logits: torch.Tensor) -> bool:
    """Whether the router's choice of these logits takes the one-kernel path (moe_fused_routing knob, CUDA, no
    autograd)."""
    tracked = torch.is_grad_enabled() and logits.requires_grad
    return logits.is_cuda and settings.tuning.moe_fused_routing and not tracked and triton_available()


class TopKRouter(nn.Module):
    """`gate.weight` [E, D] (float32, or the model dtype with cfg.model_dtype_logits) and, for noaux_tc,
    `gate.e_score_correction_bias` [E] (float32)."""

    # The logits of a single row through the small-M GEMV (its shape recorded at load like a Linear's): cuBLAS took
    # ~5 us a layer for this small product at batch 1 and, launched without PDL, broke the chain of
    # programmatic-dependent launches around it (BENCHMARKS.md 7.1).
    gemv_weight = True

    def __init__(self, hidden_size: int, cfg: RouterConfig, correction_bias: bool):
        super().__init__()
        self.cfg = cfg
        dtype = None if cfg.model_dtype_logits else torch.float32  # (None: the model's, as it is constructed)
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=dtype))
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.register_parameter("e_score_correction_bias", None)

    @property
    def top_k(self) -> int:
        return self.cfg.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.choose(self.logits(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.linear(x, self.weight) if self.cfg.model_dtype_logits else gemv.linear_widened(x, self.weight)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(logits, self.cfg, self.e_score_correction_bias)

    def kernel_routing(self, logits: torch.Tensor):
        """The choice as a kernel would make it (moe_routing_triton.Routing: select_experts' one-kernel path, the
        same numbers), or None where select_experts does not take that kernel (groups, the knob, the CPU)."""
        if self.cfg.grouped or not fused_routing(logits):
            return None
        from atlas.kernels.moe_routing_triton import Routing

        cfg = self.cfg
        return Routing(logits.contiguous(), cfg.top_k, cfg.scoring_func, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                       self.e_score_correction_bias, cfg.norm_floor, cfg.norm_eps)


def note_mxfp4_scales(model: nn.Module) -> int:
    """After loading: each MXFP4 FusedExperts of the model notes whether every E8M0 scale code of its experts is at
    most MXFP4_FOLD_MAX_SCALE (a block scale of at most 2, as --load-format dummy's 2^-13; a checkpoint with a larger
    one keeps the two multiplies, the same numbers), where the grouped kernel's bf16 pairs take one multiply a pair
    (kernels/moe_triton._mxfp4_bf16_pairs); one host sync for the model. -> how many fold."""
    from atlas.kernels.moe_triton import MXFP4_FOLD_MAX_SCALE

    stacks = [m for m in model.modules() if isinstance(m, FusedExperts) and m.mxfp4]
    if not stacks:
        return 0
    peaks = torch.stack([torch.maximum(m.w13_scales.max(), m.w2_scales.max()) for m in stacks]).tolist()
    for m, peak in zip(stacks, peaks, strict=True):
        m.mxfp4_fold = peak <= MXFP4_FOLD_MAX_SCALE
    return sum(m.mxfp4_fold for m in stacks)


def link_l2_prefetch(model: nn.Module) -> list[tuple[str, str]]:
    """Each MXFP4 FusedExperts -> the next linear layer in the model's module order (the next decoder layer's first
    projection), whose weight its one-token down kernel then asks the L2 for while it runs (the moe_l2_prefetch
    knob: that kernel is bound by its instruction issue, not by its bytes). The (experts, linear) names linked."""
    linked, waiting = [], []
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts) and module.mxfp4:
            waiting.append((name, module))
        elif waiting and isinstance(module, Linear) and isinstance(getattr(module, "weight", None), torch.Tensor):
            for experts_name, experts in waiting:
                object.__setattr__(experts, "l2_prefetch_source", module)
                linked.append((experts_name, name))
            waiting = []
    return linked


def grouped_gemm_available(dtype: torch.dtype, device: torch.device) -> bool:
    """F.grouped_mm exists in recent PyTorch; on CUDA its kernels take bf16 on compute capability 9.0+."""
    if not hasattr(F, "grouped_mm"):
        return False
    return device.type != "cuda" or (dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0))


def _aligned(*tensors: torch.Tensor) -> bool:
    """The grouped GEMM wants 16-byte-aligned strides."""
    return all(s * t.element_size() % 16 == 0 for t in tensors for s in t.stride() if s != 1)


def _grouped_mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Can F.grouped_mm take a [M, K] @ b [E, K, N]?"""
    return (a.dtype == b.dtype and grouped_gemm_available(a.dtype, a.device) and _aligned(a, b)
            and b.shape[-1] * a.element_size() % 16 == 0)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x [M, K] sorted by expert, counts [E] rows per expert, w [E, N, K] -> [M, N] where each
    row is multiplied by its expert's w^T."""
    b = w.transpose(1, 2)
    if x.shape[0] and _grouped_mm_ok(x, b):
        return F.grouped_mm(x, b, offs=counts.cumsum(0, dtype=torch.int32))
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("MoE experts need torch.nn.functional.grouped_mm (recent PyTorch, bf16, an sm90+ GPU) "
                           "to run inside a CUDA graph; use --enforce-eager")
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):  # one batched matmul per expert that has rows
        if n:
            torch.matmul(x[start: start + n], b[e], out=out[start: start + n])
            start += n
    return out


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """Stacked FP8 expert weights [E, N, K] times their block scales [E, ceil(N / bn), ceil(K / bk)] (or, block None,
    their row scales [E, N]) in float32, rounded to dtype: models/quantization.dequantize_fp8's numbers."""
    if block is None:
        return (w.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)
    (bn, bk), (n, k) = block, w.shape[-2:]
    s = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (w.to(torch.float32) * s).to(dtype)


class FusedExperts(nn.Module):
    """The routed experts, stacked: w13 [E, 2I, D] (gate rows, then up rows) and w2 [E, D, I].

    Checkpoints store them per expert (`experts.{e}.gate_proj.weight` ...); `weight_loader` takes the
    shard id (expert, "gate" | "up" | "down"). Under tensor parallelism each rank holds intermediate rows
    r * I / tp .. of every expert, and forward returns this rank's partial sum (the caller all-reduces)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str, bias: bool = False,
                 swiglu: tuple[float, float] | None = None, silu_limit: float | None = None,
                 mxfp4: bool = False):
        """bias: b13 [E, 2I] (gate rows, then up rows) and b2 [E, D], added by expert to each row's products;
        swiglu (alpha, limit): gpt-oss's clamped SwiGLU in place of act(gate) * up; silu_limit: DeepSeek-V4's
        silu(gate clamped) * up clamped (kernels/moe.limited_silu_and_mul); mxfp4: the MXFP4 form (module
        docstring; the caller checks mxfp4_unusable first)."""
        super().__init__()
        mp = current()
        self.full_intermediate_size = intermediate_size
        # Expert parallelism (--enable-expert-parallel): this rank holds experts first .. first + local - 1
        # whole; otherwise every expert, 1/tp of its intermediate rows.
        self.expert_parallel = mp.expert_parallel and mp.tp_size > 1
        if self.expert_parallel:
            if num_experts % mp.tp_size:
                raise ValueError(f"the {num_experts} routed experts are not divisible by the tensor-parallel size "
                                 f"{mp.tp_size} (--enable-expert-parallel)")
            self.num_local_experts = num_experts // mp.tp_size
            self.first_expert = mp.tp_rank * self.num_local_experts
            self.tp_rank = 0  # (whole experts: no slice of the intermediate dimension)
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.tp_rank = mp.tp_rank
        intermediate_size = local_intermediate_size(intermediate_size)
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.act = act
        self.plain_dtype = torch.get_default_dtype()
        self.fp8 = self._fp8_scheme(current_scheme(), bias or swiglu is not None or silu_limit is not None,
                                    hidden_size)
        self.mxfp4 = mxfp4
        # (every E8M0 scale code of the experts at most MXFP4_FOLD_MAX_SCALE: set once they are loaded,
        #  note_mxfp4_scales; the grouped kernel then scales a bf16 pair by one multiply)
        self.mxfp4_fold = False
        if mxfp4:
            reason = mxfp4_unusable(hidden_size, intermediate_size)
            if reason is not None or self.fp8 is not None:
                raise ValueError(f"MXFP4 experts: {reason or 'not inside an FP8 scheme'}")
        dtype = FP8 if self.fp8 is not None else torch.uint8 if mxfp4 else None
        # (MXFP4: two FP4 codes a byte along K, the low nibble the even column)
        pack = 2 if mxfp4 else 1
        plain = self.fp8 is None and not mxfp4
        e = self.num_local_experts
        self.w13 = nn.Parameter(torch.empty(e, 2 * intermediate_size, hidden_size // pack, dtype=dtype),
                                requires_grad=plain)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, intermediate_size // pack, dtype=dtype),
                               requires_grad=plain)
        self.w13.weight_loader = self._load
        self.w2.weight_loader = self._load
        self.fp8_pieces = 0  # FP8 weight pieces loaded
        self.loaded_scales: set[tuple[int, str]] = set()
        if self.fp8 is not None:
            e, i = self.num_local_experts, intermediate_size
            if self.fp8.block is not None:
                bn, bk = self.fp8.block
                shapes = ((e, 2 * i // bn, -(-hidden_size // bk)), (e, -(-hidden_size // bn), -(-i // bk)))
            else:  # (per channel, or per tensor stored per row as Linear does)
                shapes = ((e, 2 * i), (e, hidden_size))
            for w, shape in zip(("w13", "w2"), shapes, strict=True):
                self.register_parameter(f"{w}_{self.fp8.scale_name}", _fp8_param(
                    torch.ones(shape, dtype=torch.float32), self._load_scale, fill=1e-3 / 448))
        if mxfp4:  # (one E8M0 scale a run of MXFP4_BLOCK columns)
            i = intermediate_size
            for w, shape in (("w13", (e, 2 * i, hidden_size // MXFP4_BLOCK)),
                             ("w2", (e, hidden_size, i // MXFP4_BLOCK))):
                p = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
                p.weight_loader = self._load
                # (--load-format dummy: random codes times 2^-13, |w| <= 6 * 2^-13 < 1e-3 as plain ones)
                p.dummy_fill = MXFP4_DUMMY_SCALE
                self.register_parameter(f"{w}_scales", p)
        self.swiglu = swiglu
        self.silu_limit = silu_limit
        if bias:
            self.b13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size))
            self.b2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size))
            self.b13.weight_loader = self._load
            self.b2.weight_loader = self._load
        else:
            self.b13 = self.b2 = None
        # The down bias joins the sum once: on the rank of the first slice of every expert's intermediate
        # dimension (every rank under expert parallelism, each for its own whole experts).
        self.adds_down_bias = self.tp_rank == 0
        self.loaded: set[tuple[int, str]] = set()
        # The linear layer whose weight the one-token down kernel asks the L2 for (link_l2_prefetch; a plain
        # attribute, not a submodule: it is another layer's)
        object.__setattr__(self, "l2_prefetch_source", None)

    def _fp8_scheme(self, scheme: Fp8Scheme | None, extras: bool, hidden_size: int) -> Fp8Scheme | None:
        """The scheme the experts keep their weights in (constructed inside `quantizing`): one with dynamic
        activations, per row (channel / tensor) or block-scaled with blocks this rank's slices do not cut; None (plain
        weights, which take the checkpoint's dequantized as they load: the models' keeps_fp8) for static activation
        schemes, for experts with biases or another activation, and for a split that cuts the scale blocks
        (logged)."""
        if scheme is None or extras or scheme.activations != "dynamic":
            return None
        if scheme.block is None:  # (a scale per output row: any slice of rows or columns keeps its scales whole)
            return scheme
        bn, bk = scheme.block
        i, full = self.intermediate_size, self.full_intermediate_size
        # (gate and up rows are stacked in w13: each part must span whole row blocks; down's columns are this rank's
        # slice of the intermediate dimension: whole column blocks, or all of them)
        if i % bn or (i != full and i % bk):
            logger.warning("the routed experts' intermediate size %d (this rank's %d) does not split into the "
                           "checkpoint's %dx%d FP8 scale blocks (%s): the experts are dequantized as they load "
                           "(their memory and speed are those of the %s model)", full, i, bn, bk,
                           "gate|up rows" if i % bn else "down's columns under tensor parallelism",
                           str(torch.get_default_dtype()).removeprefix("torch."))
            return None
        return scheme

    def _check_weight_dtype(self, loaded, shard) -> None:
        """An FP8 module takes FP8 pieces; a plain one (nothing FP8 loaded yet: experts the quantizer left out) turns
        it back into a plain module; a mix is refused."""
        if self.fp8 is None:
            return
        dtype = checkpoint_dtype(loaded)
        if dtype == "float8_e4m3fn":
            self.fp8_pieces += 1
        elif dtype in ("float16", "bfloat16", "float32") and not self.fp8_pieces:
            self.unquantize()
        else:
            raise ModelLoadError(f"malformed FP8 checkpoint: routed expert piece {shard!r} is {dtype}, other pieces "
                                 "of the same experts are float8_e4m3fn: Atlas does not load experts of mixed dtypes")

    def unquantize(self) -> None:
        """Turn FP8 or MXFP4 experts (nothing loaded yet) into plain ones of the model's dtype."""
        e, i, hidden = self.num_local_experts, self.intermediate_size, self.w2.shape[1]
        for p, shape in ((self.w13, (e, 2 * i, hidden)), (self.w2, (e, hidden, i))):
            p.data = torch.empty(shape, dtype=self.plain_dtype, device=p.device)
        for name in ("w13_weight_scale_inv", "w2_weight_scale_inv", "w13_weight_scale", "w2_weight_scale",
                     "w13_scales", "w2_scales"):
            self._parameters.pop(name, None)
        self.fp8 = None
        self.mxfp4 = False
        self.dropped_scales = True

    @takes_slices
    def _load_scale(self, param: nn.Parameter, loaded, shard: tuple[int, str]) -> None:
        """An expert piece's scales (`{gate|up|down}_proj.weight_scale_inv` per block, or `.weight_scale` per row
        or tensor): this rank's of them."""
        if self.fp8 is None:
            raise ModelLoadError(f"malformed FP8 checkpoint: routed expert piece {shard!r} has FP8 scales, but the "
                                 "experts' weights came in a floating-point dtype")
        expert, kind = shard
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        if self.fp8.block is None:
            self._load_row_scale(param, loaded, local, kind)
            self.loaded_scales.add(shard)
            return
        bn, bk = self.fp8.block
        i, full = self.intermediate_size, self.full_intermediate_size
        hidden = self.w2.shape[1]
        if kind == "down":
            expected = (-(-hidden // bn), -(-full // bk))
            start, size, dim = self.tp_rank * i // bk, -(-i // bk), 1
            target = self.w2_weight_scale_inv.data[local]
        else:
            expected = (-(-full // bn), -(-hidden // bk))
            start, size, dim = self.tp_rank * i // bn, i // bn, 0
            target = self.w13_weight_scale_inv.data[local, (0 if kind == "gate" else size):][:size]
        if loaded_shape(loaded) != expected:
            raise ValueError(f"weight_scale_inv of shape {loaded_shape(loaded)}, but the expert's {kind} weight in "
                             f"blocks of {bn}x{bk} needs {expected}")
        target.copy_(narrow_loaded(loaded, dim, start, size))
        self.loaded_scales.add(shard)

    def _load_row_scale(self, param: nn.Parameter, loaded, local: int, kind: str) -> None:
        """A per-channel ([rows] or [rows, 1]) or per-tensor (one number, stored for every row) scale of a piece."""
        i, full = self.intermediate_size, self.full_intermediate_size
        rows = self.w2.shape[1] if kind == "down" else full
        target = param.data[local] if kind == "down" else param.data[local, (0 if kind == "gate" else i):][:i]
        shape = loaded_shape(loaded)
        if len(shape) == 0 or (len(shape) <= 2 and all(d == 1 for d in shape)):
            target.fill_(float(materialize(loaded).reshape(-1)[0]))
        elif shape in ((rows,), (rows, 1)):
            start = 0 if kind == "down" else self.tp_rank * i
            target.copy_(narrow_loaded(loaded, 0, start, target.shape[0]).reshape(-1))
        else:
            raise ValueError(f"{self.fp8.scale_name} of shape {shape}: expected one number or one per each of the "
                             f"{rows} rows of the expert's {kind} weight")

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in `dtype`: FP8 experts dequantized (the reference path: each FP8 value times its block's scale
        in float32, rounded to dtype, as models/quantization.dequantize_fp8 computes), MXFP4 ones as
        kernels/mxfp4.dequantize_mxfp4 computes, plain ones as they are."""
        if self.mxfp4:
            return (dequantize_mxfp4_experts(self.w13, self.w13_scales, dtype),
                    dequantize_mxfp4_experts(self.w2, self.w2_scales, dtype))
        if self.fp8 is None:
            return self.w13, self.w2
        return (dequantize_experts(self.w13, self.scale_of(self.w13), self.fp8.block, dtype),
                dequantize_experts(self.w2, self.scale_of(self.w2), self.fp8.block, dtype))

    def scale_of(self, w: torch.Tensor) -> torch.Tensor:
        """The FP8 scales of w13 or w2."""
        return getattr(self, f"{'w13' if w is self.w13 else 'w2'}_{self.fp8.scale_name}")

    def scales(self, w: torch.Tensor) -> dict:
        """The kernels' scale arguments of w13 or w2: FP8's scales and blocks, MXFP4's E8M0 scales (none for
        plain weights)."""
        if self.mxfp4:
            return dict(scale=self.w13_scales if w is self.w13 else self.w2_scales)
        if self.fp8 is None:
            return {}
        return dict(scale=self.scale_of(w), block=self.fp8.block)

    @takes_slices
    def _load(self, param: nn.Parameter, loaded, shard: tuple[int, str] | str) -> None:
        if isinstance(shard, str):
            if self.fp8 is not None:
                raise ModelLoadError("stacked expert tensors (every expert at once) are not loaded into FP8 experts")
            self._load_stacked(param, materialize(loaded), shard)
            return
        if self.mxfp4:
            raise ModelLoadError(f"per-expert tensors ({shard!r}) are not loaded into MXFP4 experts "
                                 "(gpt-oss's stack every expert in one tensor)")
        if param is self.w13 or param is self.w2:
            self._check_weight_dtype(loaded, shard)
        expert, kind = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside the {self.num_experts} routed experts of the config")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert (expert parallelism): its slice is never read
        i, full = self.intermediate_size, self.full_intermediate_size
        target = {"gate": lambda: self.w13.data[local, :i], "up": lambda: self.w13.data[local, i:],
                  "down": lambda: self.w2.data[local]}[kind]()
        dim = 1 if kind == "down" else 0  # the intermediate dimension of the checkpoint tensor
        expected = list(target.shape)
        expected[dim] = full
        if loaded_shape(loaded) != tuple(expected):
            raise ValueError(f"shape mismatch: expected {tuple(expected)}, got {loaded_shape(loaded)}")
        target.copy_(narrow_loaded(loaded, dim, self.tp_rank * i, i))
        self.loaded.add(shard)

    def _load_stacked(self, param: nn.Parameter, t: torch.Tensor, layout: str) -> None:
        """Every expert's tensor at once (gpt-oss's checkpoints): w13 [E, 2I, D] / b13 [E, 2I] with gate and up
        rows interleaved (layout "interleaved": gate at even rows; "halves": gate rows, then up rows), w2 [E, D, I],
        b2 [E, D]. This rank's experts, and of each its slice of the intermediate dimension."""
        if layout not in ("interleaved", "halves"):
            raise ValueError(f"unknown layout {layout!r} of stacked expert weights")
        full, i = self.full_intermediate_size, self.intermediate_size
        names = {id(self.w13): "w13", id(self.w2): "w2", id(self.b13): "b13", id(self.b2): "b2"}
        if self.mxfp4:
            names |= {id(self.w13_scales): "w13_scales", id(self.w2_scales): "w2_scales"}
        name = names[id(param)]
        if name in ("w13", "w2"):
            self._check_stacked_dtype(t, name)
        # (MXFP4 weights and scales: K packed two codes a byte, or one scale a run of 32 columns; their rows
        # are whole, so gate / up and this rank's rows move as rows, never nibbles)
        pack = {"w13": 2, "w2": 2, "w13_scales": MXFP4_BLOCK, "w2_scales": MXFP4_BLOCK}.get(name, 1) if (
            self.mxfp4) else 1
        local = param.shape[0]
        expected = (self.num_experts, *param.shape[1:])
        if name in ("w13", "b13", "w13_scales"):
            expected = (self.num_experts, 2 * full, *param.shape[2:])
        elif name in ("w2", "w2_scales"):
            expected = (self.num_experts, param.shape[1], full // pack)
        if tuple(t.shape) != expected:
            raise ValueError(f"shape mismatch: expected {expected}, got {tuple(t.shape)}")
        t = t.narrow(0, self.first_expert, local)
        start = self.tp_rank * i
        if name in ("w13", "b13", "w13_scales"):
            gate, up = (t[:, 0::2], t[:, 1::2]) if layout == "interleaved" else (t[:, :full], t[:, full:])
            param.data[:, :i].copy_(gate.narrow(1, start, i))
            param.data[:, i:].copy_(up.narrow(1, start, i))
        elif name in ("w2", "w2_scales"):  # (MXFP4: start and i are multiples of 32, mxfp4_unusable)
            param.data.copy_(t.narrow(2, start // pack, i // pack))
        else:
            param.data.copy_(t)
        experts = range(self.first_expert, self.first_expert + local)
        kinds = {"w13": ("gate", "up"), "w2": ("down",), "b13": ("gate_bias", "up_bias"),
                 "b2": ("down_bias",), "w13_scales": ("gate_scales", "up_scales"),
                 "w2_scales": ("down_scales",)}[name]
        self.loaded.update((e, k) for e in experts for k in kinds)

    def _check_stacked_dtype(self, t: torch.Tensor, name: str) -> None:
        """MXFP4 experts take uint8 codes; a floating-point tensor that comes before any (a checkpoint whose
        experts are stored unquantized) turns them into plain experts; a mix is refused, as are codes for
        plain experts."""
        if t.dtype == torch.uint8 and not self.mxfp4:
            raise ModelLoadError(f"stacked expert tensor {name} holds uint8 (MXFP4 codes?), but these "
                                 "experts hold floating-point weights")
        if not self.mxfp4 or t.dtype == torch.uint8:
            return
        if any(k in self.loaded for k in ((self.first_expert, "gate"), (self.first_expert, "down"))):
            raise ModelLoadError(f"stacked expert tensor {name} is {t.dtype}, other expert tensors of the "
                                 "same layer are MXFP4: Atlas does not load experts of mixed dtypes")
        logger.info("stacked expert tensor %s is %s although the checkpoint says MXFP4: these experts hold "
                    "it in %s", name, t.dtype, self.plain_dtype)
        self.unquantize()

    def graph_safe(self) -> bool:
        """Whether forward takes the grouped GEMM (no host sync) for these weights."""
        w = self.w13
        if self.fp8 is not None or self.mxfp4:  # (on CUDA the Triton kernels at every token count)
            return w.device.type == "cuda" and triton_available()
        return grouped_gemm_available(w.dtype, w.device) and _aligned(w, self.w2) and (
            self.intermediate_size * w.element_size() % 16 == 0 and w.shape[-1] * w.element_size() % 16 == 0)

    def missing_shards(self) -> list[str]:
        experts = range(self.first_expert, self.first_expert + self.num_local_experts)
        kinds = ("gate", "up", "down") + (("gate_bias", "up_bias", "down_bias") if self.b13 is not None else ())
        missing = [f"{e}.{k.removesuffix('_bias')}_proj.{'bias' if k.endswith('_bias') else 'weight'}"
                   for e in experts for k in kinds if (e, k) not in self.loaded]
        if self.fp8 is not None:  # (an FP8 weight is not loaded until its scales are)
            missing += [f"{e}.{k}_proj.{self.fp8.scale_name}" for e in experts for k in ("gate", "up", "down")
                        if (e, k) in self.loaded and (e, k) not in self.loaded_scales]
        if self.mxfp4:
            missing += [f"{e}.{k}_proj_scales" for e in experts for k in ("gate", "up", "down")
                        if (e, f"{k}_scales") not in self.loaded]
        return missing

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, D], routing weights [T, k] and expert ids [T, k] -> sum_k weight_k * expert_k(x) [T, D]."""
        t = ids.shape[0]
        if t == 0:
            return torch.zeros_like(x)
        if self.expert_parallel:
            # This rank's share of the sum: the pairs routed to another rank's experts get weight 0 and are
            # pointed at a local expert (computed and dropped: the shapes stay the same on every rank, with
            # no host sync); the MoE block all-reduces the shares.
            local = ids - self.first_expert
            mine = (local >= 0) & (local < self.num_local_experts)
            ids, weights = torch.where(mine, local, 0), torch.where(mine, weights, 0.0)
        if self._takes_triton(x, t):
            return self.forward_triton(x, weights, ids)
        return self.forward_grouped(x, weights, ids)

    def forward_routed(self, x: torch.Tensor, router: TopKRouter) -> torch.Tensor:
        """forward of router's choice for x. At a few tokens on CUDA (moe_route_in_experts knob) the choice is made
        inside the gate|up kernel from the router's logits (kernels/moe_triton.moe_pairs_routed_gate_up_act: the
        router kernel's numbers, one launch fewer a layer); elsewhere the router chooses, then forward."""
        logits = router.logits(x)
        routing = router.kernel_routing(logits) if self._routes_in_gate_up(x) else None
        if routing is None:
            return self(x, *router.choose(logits))
        from atlas.kernels.moe_triton import moe_pairs_routed_gate_up_act

        act, alpha, limit = self._fused_activation()
        tiles = self._pairs_tiles()
        h, weights, ids = moe_pairs_routed_gate_up_act(
            x.contiguous(), self.w13, routing, act, bias=self.b13, alpha=alpha, limit=limit, **self.scales(self.w13),
            **tiles.get("gate_up", {}))
        return self._pairs_down(h, ids, weights, tiles)

    def _routes_in_gate_up(self, x: torch.Tensor) -> bool:
        """Whether forward would take the fused pairs kernels and _moe_gate_up_act_kernel among them (not a row-tiles
        kernel) for x, with no expert parallelism (its choices are remapped to local experts first), at up to
        MAX_RANKED_EXPERTS experts (route_pair's comparison)."""
        from atlas.kernels.moe_routing_triton import MAX_RANKED_EXPERTS

        t = x.shape[0]
        if not (settings.tuning.moe_route_in_experts and t > 0 and self._fused_pairs(t) and not self.expert_parallel
                and self.w13.shape[0] <= MAX_RANKED_EXPERTS and self._takes_triton(x, t)):
            return False
        from atlas.kernels.moe_triton import gate_up_takes_row_tiles

        return not gate_up_takes_row_tiles(x, self.w13, self.scales(self.w13).get("block"),
                                           self._fused_activation()[0], self.b13)

    def _takes_triton(self, x: torch.Tensor, tokens: int) -> bool:
        # (The kernels have no backward: anything autograd would track stays with the grouped path.)
        tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (x, self.w13, self.w2))
        if self.fp8 is not None or self.mxfp4:  # (the kernels dequantize in registers at every token count)
            return x.is_cuda and x.dtype in _TRITON_DTYPES and not tracked and triton_available()
        # (Above the knob's tokens the grouped GEMM; inside a CUDA graph where it cannot run (fp32 or fp16 weights,
        #  or before sm90) the Triton kernels at every token count instead: the per-expert fallback syncs the host.)
        large_ok = tokens <= settings.tuning.moe_triton_max_tokens or (
            x.is_cuda and torch.cuda.is_current_stream_capturing() and not self.graph_safe())
        return (x.is_cuda and large_ok and x.dtype == self.w13.dtype == self.w2.dtype
                and x.dtype in _TRITON_DTYPES and not tracked and triton_available())

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """forward through grouped_matmul (the grouped GEMM, or one matmul per expert)."""
        w13, w2 = self.dequantized(x.dtype)
        return self._sorted_experts(x, weights, ids, lambda rows, w, groups: grouped_matmul(
            rows, w13 if w is self.w13 else w2, groups), offsets=False)

    def forward_triton(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """forward through the Triton kernels: pairs for up to MOE_PAIRS_MAX_TOKENS tokens, grouped above.
        Any device Triton runs on (the CPU interpreter in tests); x and the weights of one dtype."""
        from atlas.kernels.moe_triton import moe_combine, moe_grouped_matmul, moe_pairs_matmul

        t, k = ids.shape
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self._fused_pairs(t):
            from atlas.kernels.moe_triton import moe_pairs_gate_up_act

            tiles = self._pairs_tiles()
            weights = weights.float()
            act, alpha, limit = self._fused_activation()
            h = moe_pairs_gate_up_act(x, self.w13, ids, weights, act, bias=self.b13, alpha=alpha, limit=limit,
                                      **self.scales(self.w13), **tiles.get("gate_up", {}))
            return self._pairs_down(h, ids, weights, tiles)
        if t <= _pairs_max_tokens():  # rows already in (token, choice) order
            experts = ids.reshape(-1)
            h = self._activate(moe_pairs_matmul(x, self.w13, ids, k, **self.scales(self.w13)), experts)
            y = moe_pairs_matmul(h, self.w2, ids, 1, **self.scales(self.w2))
            return self._combine(self._down_bias(y, experts), weights, x.dtype)
        # (the kernel adds the expert biases onto its rounded products: the gather and add kernels' numbers)
        if settings.tuning.moe_grouped_gather:  # (rows read and written by index: no copies in expert order)
            order, rows, groups = self._sort_rows(ids)
            epilogue = settings.tuning.moe_grouped_act  # (the activation in gate|up's kernel: no [M, 2I] products)
            act = dict(zip(("act", "alpha", "limit"), self._fused_activation(), strict=True)) if epilogue else {}
            h = moe_grouped_matmul(x, self.w13, groups, bias=self._expert_bias(self.w13), rows=rows, **act,
                                   **self.scales(self.w13), fold=self._folds())
            if not epilogue:
                h = self._activate(h, None, bias_added=True)
            y = moe_grouped_matmul(h, self.w2, groups, bias=self._expert_bias(self.w2), out_rows=order,
                                   **self.scales(self.w2), fold=self._folds())
            return moe_combine(y, weights.float(), x.dtype)
        return self._sorted_experts(x, weights, ids, lambda rows, w, groups: moe_grouped_matmul(
            rows, w, groups, bias=self._expert_bias(w), **self.scales(w), fold=self._folds()), offsets=True,
            adds_biases=True)

    def _folds(self) -> bool:
        """Whether the grouped kernel scales MXFP4 pairs by one multiply (mxfp4_fold, under the moe_mxfp4_fold knob)."""
        return self.mxfp4_fold and settings.tuning.moe_mxfp4_fold

    def _expert_bias(self, w: torch.Tensor) -> torch.Tensor | None:
        """The bias [E, N] of the projection w (w13 or w2) that this rank adds, or None."""
        if w is self.w13:
            return self.b13
        return self.b2 if self.adds_down_bias else None

    @staticmethod
    def _fused_pairs(tokens: int) -> bool:
        """Whether forward_triton takes the fused pairs kernels at this many tokens (the moe_fused_pairs knob)."""
        return tokens <= _pairs_max_tokens() and settings.tuning.moe_fused_pairs

    @staticmethod
    def _pairs_tiles() -> dict:
        """The moe_pairs_tiles knob's tiles of the fused pairs kernels (empty: the kernels' own)."""
        from atlas.kernels.moe_triton import parse_pairs_tiles

        return parse_pairs_tiles(settings.tuning.moe_pairs_tiles)

    def _pairs_down(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tiles: dict) -> torch.Tensor:
        """The fused pairs path's down projection with the routing weights' sum (and the down bias)."""
        from atlas.kernels.moe_triton import moe_pairs_down_combine

        source = self.l2_prefetch_source
        return moe_pairs_down_combine(h, self.w2, ids, weights, self._expert_bias(self.w2), **self.scales(self.w2),
                                      **tiles.get("down", {}), prefetch=None if source is None else source.weight)

    def _sorted_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, matmul,
                        offsets: bool, adds_biases: bool = False) -> torch.Tensor:
        """The (token, choice) rows sorted by expert through matmul(rows, w, groups) for gate|up and down,
        then put back in order and combined; groups: rows per expert, or their offsets [E + 1]. adds_biases: matmul
        adds each row's expert bias itself (the gate|up bias, and the down bias where this rank adds it)."""
        t, k = ids.shape
        order, groups = self._sort(ids, offsets)
        rows = x.index_select(0, order // k)
        experts = ids.reshape(-1).index_select(0, order) if self.b13 is not None and not adds_biases else None
        h = self._activate(matmul(rows, self.w13, groups), experts, bias_added=adds_biases)
        y = matmul(h, self.w2, groups)
        y = y if adds_biases else self._down_bias(y, experts)
        return self._combine(torch.empty_like(y).index_copy_(0, order, y), weights, x.dtype)

    def _activate(self, h: torch.Tensor, experts: torch.Tensor | None, bias_added: bool = False) -> torch.Tensor:
        """The gate|up products h [M, 2I] of rows whose experts are `experts` [M] -> the activation [M, I] (the
        bias of each row's expert added first, where the experts have biases and the product has not them)."""
        if self.b13 is not None and not bias_added:
            h = h + self.b13.index_select(0, experts)
        if self.swiglu is not None:
            return clamped_act_and_mul(h, "clamped_swiglu", *self.swiglu)
        if self.silu_limit is not None:
            return clamped_act_and_mul(h, "limited_silu", 1.0, self.silu_limit)
        return act_and_mul(h, self.act)

    def _fused_activation(self) -> tuple[int, float, float | None]:
        """_activate as the fused gate|up kernel's (ACT code, alpha, limit): its epilogue adds the gate|up bias and
        rounds after each operation as _activate's ops do."""
        from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU

        if self.swiglu is not None:
            return ACT_CLAMPED_SWIGLU, *self.swiglu
        if self.silu_limit is not None:
            return ACT_LIMITED_SILU, 1.0, self.silu_limit
        return triton_act_code(self.act), 1.0, None

    def _down_bias(self, y: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
        bias = self._expert_bias(self.w2)
        return y if bias is None else y + bias.index_select(0, experts)

    def _sort(self, ids: torch.Tensor, offsets: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(The (token, choice) pairs ordered by expert, rows per expert [E] or, with offsets, their offsets
        [E + 1].)"""
        flat = ids.reshape(-1)
        # One-byte keys where the ids fit: a radix sort's passes go with its keys' width (gpt-oss-20b at 256
        # requests on an H100: 27 us a layer on int64 keys; the step 1.04-1.08x faster, BENCHMARKS.md 7.3).
        order = torch.argsort(flat.to(torch.uint8) if self.num_local_experts <= 256 else flat, stable=True)
        counts = torch.zeros(self.num_local_experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        return order, torch.cat([counts.new_zeros(1), counts.cumsum(0)]) if offsets else counts

    def _sort_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """_sort's order and offsets with the rows they read (order // k): in one kernel with the moe_expert_sort knob
        (kernels/moe_triton.expert_sort: the same order, a decode step's pairs), else the sort's kernels. Triton
        paths only (forward_triton)."""
        from atlas.kernels.moe_triton import EXPERT_SORT_MAX_EXPERTS, EXPERT_SORT_MAX_PAIRS, expert_sort

        if (settings.tuning.moe_expert_sort and self.num_local_experts <= EXPERT_SORT_MAX_EXPERTS
                and ids.numel() <= EXPERT_SORT_MAX_PAIRS):
            return expert_sort(ids, self.num_local_experts)
        order, offsets = self._sort(ids, offsets=True)
        return order, order // ids.shape[1], offsets

    @staticmethod
    def _combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y [T * k, D] in (token, choice) order -> sum_j weights[t, j] * y[t, j] in float32, in dtype."""
        t, k = weights.shape
        return (y.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(dim=1).to(dtype)
