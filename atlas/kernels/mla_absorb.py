"""MLA's absorbed products at a few query rows: the nope query into latent space through W_UK, and the attended
latents back to per-head values through W_UV (layers/mla.py). The reference is the batched matmul the layer has
always run (cuBLAS on CUDA); the Triton kernels (kernels/mla_absorb_triton.py) take decode and verify steps on
CUDA with the `mla_absorb_gemv` knob: at one row each product is a pair of GEMVs per head (2 MB a layer for
DeepSeek-V2-Lite), where cuBLAS's batched kernel launches without PDL and the values then need a copy into
o_proj's [T, H * V] layout, which the kernel writes directly.
"""

from __future__ import annotations

import torch

from atlas.kernels import settings, triton_available

# At most this many query rows go through the Triton kernels (decode and verify steps; prefill keeps cuBLAS).
MAX_ROWS = 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_triton(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.shape[0] <= MAX_ROWS and x.dtype == w.dtype and x.dtype in _DTYPES
            and settings.tuning.mla_absorb_gemv and triton_available())


def absorb_query_ref(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, P], w_uk [H, P, L] -> q_latent [T, H, L] (a [T, H, L] view of an [H, T, L] tensor)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_values_ref(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [T, H, L], w_uv [H, V, L] -> the per-head values [T, H * V] (o_proj's input)."""
    out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, V]
    return out.transpose(0, 1).reshape(o_latent.shape[0], -1)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """absorb_query_ref's function; through the Triton kernel on CUDA at up to MAX_ROWS rows with the knob."""
    if _use_triton(q_nope, w_uk) and q_nope.stride(2) == 1 and w_uk.stride(2) == 1:
        from atlas.kernels.mla_absorb_triton import absorb_query_triton

        return absorb_query_triton(q_nope, w_uk)
    return absorb_query_ref(q_nope, w_uk)


def expand_values(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """expand_values_ref's function; through the Triton kernel on CUDA at up to MAX_ROWS rows with the knob."""
    if _use_triton(o_latent, w_uv) and o_latent.stride(2) == 1 and w_uv.stride(2) == 1:
        from atlas.kernels.mla_absorb_triton import expand_values_triton

        return expand_values_triton(o_latent, w_uv)
    return expand_values_ref(o_latent, w_uv)
