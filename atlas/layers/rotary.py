"""Rotary position embeddings: plain, linear, llama3, YaRN and LongRoPE scaling.

cos/sin are precomputed in float32 for every position up to the context length and indexed by the
flat `positions` tensor, so prefill, decode and verify rows need no special casing.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from atlas.config import RopeConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.kernels.fused_ops import apply_rope

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(dim: int, theta: float, p: dict) -> torch.Tensor:
    inv_freq = _base_inv_freq(dim, theta)
    factor = p["factor"]
    low_freq_factor = p.get("low_freq_factor", 1.0)
    high_freq_factor = p.get("high_freq_factor", 4.0)
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, p: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_factors(p: dict, key: str, half: int) -> torch.Tensor:
    factors = p.get(key)
    if (not isinstance(factors, list) or len(factors) != half
            or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)):
        raise ModelLoadError(f"malformed checkpoint: the longrope scaling's {key} must be a list of {half} positive "
                             f"numbers (one a rotary frequency), got {factors!r}")
    return torch.tensor(factors, dtype=torch.float32)


def _longrope_inv_freq(dim: int, theta: float, p: dict, max_position_embeddings: int,
                       context_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 / Phi-4): each frequency divided by its own factor, the long ones when the engine's context
    reaches past original_max_position_embeddings and the short ones otherwise, chosen once for the whole serve
    (transformers switches per call on the longest position, so a sequence crossing the original length would
    hold keys rotated both ways; a fixed choice keeps the cache consistent, as vLLM chooses); cos / sin scaled by
    sqrt(1 + ln(factor) / ln(original length)) unless the config gives attention_factor."""
    for key in ("short_mscale", "long_mscale"):
        if p.get(key) is not None:
            raise UnsupportedModelError(f"the longrope scaling's {key} is not supported (transformers' Phi-3 reads "
                                        "attention_factor instead); remove it or give attention_factor")
    orig = p["original_max_position_embeddings"]
    factors = _longrope_factors(p, "long_factor" if context_len > orig else "short_factor", dim // 2)
    factor = p.get("factor") or max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    inv_freq = 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


def rope_inv_freq(rotary_dim: int, rope: RopeConfig, max_position_embeddings: int,
                  context_len: int = 0) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2], scale applied to cos/sin) for this RoPE config; context_len is the
    longest sequence the engine serves (LongRoPE picks its factors by it)."""
    p = rope.params
    if rope.rope_type == "default":
        return _base_inv_freq(rotary_dim, rope.theta), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rotary_dim, rope.theta) / p["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rotary_dim, rope.theta, p), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, rope.theta, p, max_position_embeddings)
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(rotary_dim, rope.theta, p, max_position_embeddings, context_len)
    raise UnsupportedModelError(
        f"rope type {rope.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hk, D] at flat `positions` [T].

    neox style rotates the two halves of the rotary dims (rotate_half); the interleaved (GPT-J) style
    rotates adjacent pairs. Only the first `rotary_dim` dims rotate (partial rotary). The rotation itself is
    kernels/fused_ops.apply_rope, which the fused attention prologue's reference shares.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, max_position_embeddings: int,
                 is_neox_style: bool = True):
        super().__init__()
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.is_neox_style = is_neox_style
        inv_freq, mscale = rope_inv_freq(self.rotary_dim, rope, max_position_embeddings, context_len=max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_cache", freqs.cos() * mscale, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * mscale, persistent=False)

    def identity(self) -> RotaryEmbedding:
        """Tables of this one's shape that rotate nothing (cos 1, sin 0: a layer without RoPE through the same
        kernels, its values unchanged bit for bit)."""
        same = copy.copy(self)  # (nn.Module's attributes and buffers, then the buffers replaced)
        same._buffers = dict(self._buffers)
        same.cos_cache = torch.ones_like(self.cos_cache)
        same.sin_cache = torch.zeros_like(self.sin_cache)
        return same

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RoPE on x [..., H, D] at positions [...] of any leading shape (batched, differentiable uses
        such as training; the serving paths index flat positions through `forward` or the fused kernels)."""
        cos = self.cos_cache[positions].unsqueeze(-2).to(x.dtype)
        sin = self.sin_cache[positions].unsqueeze(-2).to(x.dtype)
        return apply_rope(x, cos, sin, self.rotary_dim, self.is_neox_style)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cos/sin: [T, 1, rotary_dim/2], cast to the activation dtype as the reference models do.
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return (apply_rope(q, cos, sin, self.rotary_dim, self.is_neox_style),
                apply_rope(k, cos, sin, self.rotary_dim, self.is_neox_style))
