"""Fused elementwise ops of a decoder layer: RMSNorm (with the residual add fused in), the attention
prologue (per-head q/k RMSNorm, RoPE and the K/V cache write in one launch), MLA's prologue (the latent's
RMSNorm, RoPE of q_pe and k_pe, the latent cache row's write in one launch) and the gated activations.

Each public function runs the Triton kernel (kernels/fused_ops_triton.py) on CUDA when triton imports
and the shape is one the kernel takes, and the PyTorch reference (the `*_ref` function beside it)
otherwise. Both compute the Hugging Face numerics: values are computed in float32 and rounded to the
activation dtype at the same points as the unfused PyTorch ops (HF's RMSNorm, RotaryEmbedding and
act(gate) * up) and kernels/paged_attention_ref.write_kv_cache, which the tests use as the oracle.

Conventions shared by both paths:
- Outputs are fresh tensors (out of place), so the ops are safe inside CUDA graphs.
- `slot_mapping[t] < 0` means "do not write row t into the KV cache" (a padding row); its q is still
  computed. The reference handles it without a host sync too.
- Hidden states are rows over the last dim: any leading shape, unit stride on the last dim (a row
  stride other than the width is fine for 2-D inputs; other layouts are copied first).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from atlas.kernels import settings, triton_available
from atlas.kernels.mla_attention_ref import write_latent_cache
from atlas.kernels.paged_attention_ref import as_bits, load_rows, store_rows, to_cache_dtype, write_kv_cache

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TRITON_HIDDEN = 65536  # one row per program in registers; wider rows use the reference
MAX_TRITON_HEAD_DIM = 256

# Gated activation kinds: HF `hidden_act` names -> our kind (layers/activation.py refuses any other).
ACT_KINDS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}
_ACT_FNS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _DTYPES and triton_available()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, width] tensor with unit column stride (a view when possible)."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(1) == 1 else x.contiguous()


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalised in float32, rounded to x.dtype, then scaled by the weight."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def scaled_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                        residual: torch.Tensor | None = None):
    """RMSNorm scaled in float32 by (weight + offset), rounded once to x's dtype (Gemma's and Qwen3-Next's
    zero-centred norms: offset 1; gpt-oss's: 0); with `residual`, (that of x + residual, x + residual), the sum in
    the activation dtype."""
    if residual is not None:
        total = x + residual
        return scaled_rms_norm_ref(total, weight, eps, offset), total
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + offset if offset else weight.float()
    return (x32 * w).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the activation dtype."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool) -> torch.Tensor:
    """RoPE on the first rotary_dim dims of x [..., H, D]; the rest pass through. cos / sin [..., 1, rotary_dim/2]
    in x's dtype. is_neox: rotate the two halves of the rotary dims (HF's rotate_half); else adjacent pairs
    (GPT-J). The one PyTorch RoPE: layers/rotary.RotaryEmbedding and the attention prologue's reference below
    both call it (the Triton prologue rounds as it does)."""
    rot, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        rotated = rot * cos2 + torch.cat([-x2, x1], dim=-1) * sin2
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    if rotary_dim >= x.shape[-1]:  # (by width, not by numel: a tensor of zero heads keeps its head_dim)
        return rotated
    return torch.cat([rotated, passthrough], dim=-1)


def write_kv_cache_ref(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """kernels.paged_attention_ref.write_kv_cache, except that rows with a slot < 0 are not written.

    On CUDA without a host sync (so it can be captured in a CUDA graph): a skipped row re-writes the
    first valid row (same slot, same value); when no row is valid, slot 0 is written with its own
    contents.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    if not slot_mapping.is_cuda:
        # On the CPU a host decision costs nothing: write the valid rows only (a third of the indexing).
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        write_kv_cache(kv_cache, key, value, slot_mapping)
        return
    valid = slot_mapping >= 0
    first_valid = valid.to(torch.int32).argmax()
    rows = torch.where(valid, torch.arange(num_tokens, device=slot_mapping.device), first_valid)
    slots = slot_mapping[rows]
    any_valid = (slots >= 0)[:, None, None]
    slots = slots.clamp(min=0)
    for plane, rows_in in ((0, key), (1, value)):
        new = as_bits(to_cache_dtype(rows_in[rows], kv_cache.dtype))
        kept = as_bits(load_rows(kv_cache, plane, slots))
        store_rows(kv_cache, plane, slots, torch.where(any_valid, new, kept).view(kv_cache.dtype))


def qk_norm_rope_kv_write_ref(
    qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None, eps: float, rotary_dim: int, is_neox: bool,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """What LlamaAttention.forward does between qkv_proj and attention (split, optional q/k RMSNorm,
    RoPE, write_kv_cache), with slots < 0 skipped. Returns q [T, Hq, D]."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    rows = qkv.shape[0]  # (explicit: q may have no heads, as for a drafter's context K/V)
    q = q.reshape(rows, num_heads, head_dim)
    k = k.reshape(rows, num_kv_heads, head_dim)
    v = v.reshape(rows, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    q, k = apply_rope(q, cos, sin, rotary_dim, is_neox), apply_rope(k, cos, sin, rotary_dim, is_neox)
    write_kv_cache_ref(kv_cache, k, v, slot_mapping)
    return q.contiguous()


def mla_prologue_ref(
    q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, num_heads: int, nope_dim: int, rotary_dim: int, is_neox: bool,
    cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """What MLA attention does between its projections and the absorbed product (layers/mla.py): q [T, H * (P + R)]
    (each head's nope dims, then its R rope dims), kv_a [T, Lkv + R] (the latent c, then the shared rope key); c
    through RMSNorm (kv_a_layernorm), q_pe and k_pe through RoPE on their first rotary_dim dims, the row [c | k_pe]
    written to the latent cache [pages, block, Lkv + R] at slot_mapping (a slot < 0 is not written). Returns the
    roped q_pe [T, H, R] (contiguous)."""
    t = q.shape[0]
    rope_dim = kv_a.shape[-1] - norm_weight.shape[0]
    q_pe = q.reshape(t, num_heads, nope_dim + rope_dim)[..., nope_dim:]
    c, k_pe = kv_a.split([norm_weight.shape[0], rope_dim], dim=-1)
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    q_pe = apply_rope(q_pe, cos, sin, rotary_dim, is_neox)
    k_pe = apply_rope(k_pe.reshape(t, 1, rope_dim), cos, sin, rotary_dim, is_neox)
    write_latent_cache(cache, rms_norm_ref(c, norm_weight, eps), k_pe[:, 0], slot_mapping)
    return q_pe.contiguous()


def act_and_mul_ref(x: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """act(gate) * up for x = [gate | up] along the last dim (the gated MLP's activation)."""
    gate, up = x.chunk(2, dim=-1)
    return _ACT_FNS[_act_kind(kind)](gate) * up


# --------------------------------------------------------------------------------------------------
# Public functions: Triton on CUDA, else the reference
# --------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm over the last dim of x [..., H]; weight [H]. Returns a fresh tensor of x's shape."""
    if _use_triton(x) and weight.dtype in _DTYPES and x.shape[-1] <= MAX_TRITON_HIDDEN:
        from atlas.kernels.fused_ops_triton import rms_norm_triton

        return rms_norm_triton(as_rows(x), weight.contiguous(), eps).view(x.shape)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add of a decoder layer fused into the next
    norm. Both outputs are fresh tensors; the inputs are not modified."""
    if (_use_triton(x) and weight.dtype in _DTYPES and residual.dtype == x.dtype and residual.shape == x.shape
            and x.shape[-1] <= MAX_TRITON_HIDDEN):
        from atlas.kernels.fused_ops_triton import rms_norm_triton

        out, new_residual = rms_norm_triton(as_rows(x), weight.contiguous(), eps, residual=as_rows(residual))
        return out.view(x.shape), new_residual.view(x.shape)
    return add_rms_norm_ref(x, residual, weight, eps)


def scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                    residual: torch.Tensor | None = None):
    """scaled_rms_norm_ref's function: one Triton launch on CUDA (the residual add fused in), the reference
    elsewhere."""
    if (_use_triton(x) and weight.dtype in _DTYPES and x.shape[-1] <= MAX_TRITON_HIDDEN
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))):
        from atlas.kernels.fused_ops_triton import rms_norm_triton

        if residual is None:
            return rms_norm_triton(as_rows(x), weight.contiguous(), eps, weight_offset=offset).view(x.shape)
        out, total = rms_norm_triton(as_rows(x), weight.contiguous(), eps, residual=as_rows(residual),
                                     weight_offset=offset)
        return out.view(x.shape), total.view(x.shape)
    return scaled_rms_norm_ref(x, weight, eps, offset, residual)


def qk_norm_rope_kv_write(
    qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None, eps: float, rotary_dim: int, is_neox: bool,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The attention prologue in one launch.

    qkv [T, (Hq + 2 Hkv) * D]: the fused projection output (q heads | k heads | v heads).
    positions [T] (int64 or int32); cos_cache / sin_cache [max_pos, rotary_dim // 2] (any float dtype,
    scale included). q_norm_weight / k_norm_weight [D] (both or neither): per-head RMSNorm before RoPE.
    RoPE on the first rotary_dim dims of each q and k head, rotate_half (is_neox) or interleaved pairs.
    k (normed, roped) and v go to kv_cache [2, pages, block_size, Hkv, D] at slot_mapping [T]; a slot < 0
    is not written. Returns q [T, Hq, D] (fresh, contiguous).
    """
    has_norm = q_norm_weight is not None
    if (_use_triton(qkv) and kv_cache.dtype in (*_DTYPES, torch.float8_e4m3fn) and head_dim <= MAX_TRITON_HEAD_DIM
            and (not has_norm or (q_norm_weight.dtype == qkv.dtype and k_norm_weight.dtype == qkv.dtype))
            and kv_cache.stride(4) == 1 and kv_cache.stride(1) == kv_cache.shape[2] * kv_cache.stride(2)):
        from atlas.kernels.fused_ops_triton import qk_norm_rope_kv_write_triton

        return qk_norm_rope_kv_write_triton(
            as_rows(qkv), positions, cos_cache, sin_cache, num_heads, num_kv_heads, head_dim,
            q_norm_weight.contiguous() if has_norm else None, k_norm_weight.contiguous() if has_norm else None,
            eps, rotary_dim, is_neox, kv_cache, slot_mapping)
    return qk_norm_rope_kv_write_ref(qkv, positions, cos_cache, sin_cache, num_heads, num_kv_heads, head_dim,
                                     q_norm_weight, k_norm_weight, eps, rotary_dim, is_neox, kv_cache,
                                     slot_mapping)


MAX_TRITON_LATENT = 4096  # (the latent row is one program's tile)


def mla_prologue(
    q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, num_heads: int, nope_dim: int, rotary_dim: int, is_neox: bool,
    cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """mla_prologue_ref's function in one launch on CUDA (a decode step's MLA layer otherwise runs some thirty small
    PyTorch kernels here; the mla_fused_prologue knob), the reference elsewhere. Returns q_pe [T, H, R], fresh and
    contiguous."""
    rope_dim = kv_a.shape[-1] - norm_weight.shape[0]
    if (_use_triton(q) and settings.tuning.mla_fused_prologue and kv_a.dtype == q.dtype
            and norm_weight.dtype == q.dtype and rotary_dim == rope_dim
            and cache.dtype in (*_DTYPES, torch.float8_e4m3fn) and cache.dim() == 3 and cache.is_contiguous()
            and q.dim() == 2 and q.stride(1) == 1 and kv_a.dim() == 2 and kv_a.stride(1) == 1
            and norm_weight.shape[0] <= MAX_TRITON_LATENT and rope_dim % 2 == 0):
        from atlas.kernels.fused_ops_triton import mla_prologue_triton

        return mla_prologue_triton(q, kv_a, positions, cos_cache, sin_cache, norm_weight.contiguous(), eps,
                                   num_heads, nope_dim, is_neox, cache, slot_mapping)
    return mla_prologue_ref(q, kv_a, positions, cos_cache, sin_cache, norm_weight, eps, num_heads, nope_dim,
                            rotary_dim, is_neox, cache, slot_mapping)


def _act_kind(kind: str) -> str:
    try:
        return ACT_KINDS[kind]
    except KeyError:
        raise ValueError(f"gated activation {kind!r} is not supported; supported: "
                         f"{', '.join(sorted(ACT_KINDS))}") from None


def act_and_mul(x: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """act(gate) * up for x [..., 2I] = [gate | up] -> [..., I]. `kind` is an HF hidden_act name:
    silu/swish, gelu (erf), gelu_pytorch_tanh/gelu_new/gelu_tanh (tanh approximation), relu."""
    kind = _act_kind(kind)
    if _use_triton(x):
        from atlas.kernels.fused_ops_triton import act_and_mul_triton

        return act_and_mul_triton(as_rows(x), triton_act_code(kind)).view(*x.shape[:-1], x.shape[-1] // 2)
    return act_and_mul_ref(x, kind)


def clamped_act_and_mul(x: torch.Tensor, kind: str, alpha: float, limit: float) -> torch.Tensor:
    """The clamped gated activations of x [..., 2I] = [gate | up] -> [..., I]: gpt-oss's SwiGLU (kind
    "clamped_swiglu", alpha and limit) and DeepSeek-V4's SiLU ("limited_silu", limit), whose references are
    kernels/moe.py's clamped_swiglu and limited_silu_and_mul. One Triton kernel on CUDA, rounding after each
    operation as those PyTorch ops do (some seven launches of them); the ops themselves elsewhere."""
    from atlas.kernels.moe import clamped_swiglu, limited_silu_and_mul

    if kind not in ("clamped_swiglu", "limited_silu"):
        raise ValueError(f"clamped activation {kind!r} is not supported; supported: clamped_swiglu, limited_silu")
    if _use_triton(x):
        from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU, act_and_mul_triton

        act = ACT_CLAMPED_SWIGLU if kind == "clamped_swiglu" else ACT_LIMITED_SILU
        return act_and_mul_triton(as_rows(x), act, alpha=alpha, limit=limit).view(*x.shape[:-1], x.shape[-1] // 2)
    return clamped_swiglu(x, alpha, limit) if kind == "clamped_swiglu" else limited_silu_and_mul(x, limit)


def triton_act_code(kind: str) -> int:
    """The Triton kernels' code (fused_ops_triton.ACT_*) of a gated activation's HF name."""
    from atlas.kernels.fused_ops_triton import ACT_GELU, ACT_GELU_TANH, ACT_RELU, ACT_SILU

    return {"silu": ACT_SILU, "gelu_tanh": ACT_GELU_TANH, "gelu": ACT_GELU, "relu": ACT_RELU}[_act_kind(kind)]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return act_and_mul(x, "silu")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return act_and_mul(x, "gelu_tanh")
