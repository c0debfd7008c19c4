"""The MXFP4 weight format (OCP microscaling; gpt-oss's routed experts), its reference: FP4 E2M1 codes, two a byte,
with an E8M0 exponent per run of 32 elements. The loaders (models/) and the MoE layer's reference path (layers/moe.py)
dequantize through here; kernels/moe_triton.py decodes the same bytes in registers to the same values."""

from __future__ import annotations

import torch

from atlas.errors import ModelLoadError, UnsupportedModelError

# FP4 E2M1 (OCP microscaling formats): code -> value; bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # elements sharing one E8M0 scale


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "weight") -> None:
    """Raise ModelLoadError unless blocks and scales are uint8 [..., rows, groups, 16] and
    [..., rows, groups]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(f"malformed MXFP4 checkpoint: {name}_blocks and {name}_scales must be uint8, "
                             f"got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != MXFP4_BLOCK // 2 or (
            tuple(blocks.shape[:-1]) != tuple(scales.shape)):
        raise ModelLoadError(f"malformed MXFP4 checkpoint: {name}_blocks {tuple(blocks.shape)} and "
                             f"{name}_scales {tuple(scales.shape)} must be [..., rows, groups, 16] and "
                             "[..., rows, groups]")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, device: torch.device | str,
                     name: str = "weight") -> torch.Tensor:
    """MXFP4 tensors as gpt-oss's checkpoints store them -> [..., rows, cols] in `dtype` on `device`.

    blocks: uint8 [..., rows, cols / 32, 16], two FP4 E2M1 codes a byte (the low nibble the element before the
    high one); scales: uint8 [..., rows, cols / 32], E8M0 exponents (2^(s - 127)) of each run of 32 elements along
    cols. Exact: each value is FP4 value x 2^(s - 127), computed in float32 (where all are exact), then cast to
    `dtype`; a value that the cast would change (beyond float16's range, say) is refused, as is the E8M0 NaN code
    255. Dequantized one leading index (one expert) at a time on `device`, so the float32 temporary stays small."""
    check_mxfp4(blocks, scales, name)
    *lead, rows, groups, _ = blocks.shape
    blocks, scales = blocks.reshape(-1, rows, groups, MXFP4_BLOCK // 2), scales.reshape(-1, rows, groups)
    out = torch.empty(blocks.shape[0], rows, groups * MXFP4_BLOCK, dtype=dtype, device=device)
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    for i in range(blocks.shape[0]):
        b = blocks[i].to(device)
        s = scales[i].to(device)
        if bool((s == 255).any()):
            raise ModelLoadError(f"malformed MXFP4 checkpoint: {name}_scales holds the E8M0 NaN code 255")
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).view(rows, groups, MXFP4_BLOCK).long()
        values = torch.ldexp(lut[codes], s.to(torch.int32).sub(127)[..., None]).view(rows, groups * MXFP4_BLOCK)
        out[i].copy_(values)
        if dtype != torch.float32 and not torch.equal(out[i].float(), values):
            raise UnsupportedModelError(
                f"{name}: MXFP4 values of this checkpoint do not fit {str(dtype).removeprefix('torch.')} exactly "
                "(its range is too narrow for their scales); serve it with --dtype bfloat16 or float32")
    return out.view(*lead, rows, groups * MXFP4_BLOCK)
