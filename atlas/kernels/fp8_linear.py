"""y = x @ W^T (+ b) with W stored in float8_e4m3fn and float32 scales: the FP8 linear layers' matmul.

A weight's scales come in one of two layouts (layers/linear.py, `Fp8Scheme`):
- block: scale [ceil(N / bn), ceil(K / bk)], one per bn x bk tile of W (the DeepSeek-V3 / Qwen -FP8 layout;
  `block = (bn, bk)`, 128 x 128 in the published checkpoints);
- channel: scale [N], one per output row (per-channel checkpoints; a per-tensor scale is stored as its
  per-channel expansion, which computes the same).
W's value is W8[n, k] * scale[n // bn, k // bk] (channel: scale[n]).

The reference (`fp8_linear_ref`, what runs on CPU and wherever no kernel applies) dequantizes W, the product
in float32 rounded to the activation dtype, and multiplies with F.linear: exactly what loading the checkpoint
dequantized computes. On CUDA (`fp8_linear`):
- one row (batch-1 decode): the Triton GEMV reading W in FP8 (`fp8_gemv_triton`), each weight scaled in
  float32, float32 accumulation: the reference's products without its rounding of W to bf16;
- up to SMALL_M rows (decode batches, speculative verifies): a Triton W8A16 kernel (`fp8_w8a16_triton`) that
  dequantizes each W tile to the activation dtype in registers (the reference's rounding) and multiplies on
  the tensor cores, float32 accumulation;
- more rows (prefill): W8A8 on FP8 tensor cores, the activations quantized as they arrive: block layout, a
  Triton GEMM with activations quantized per 1 x bk group (`fp8_block_gemm_triton`); channel layout,
  torch._scaled_mm (cuBLASLt) with row-wise scales, activations quantized per token (or with the
  checkpoint's static input_scale where it has one). These round the activations to FP8 (about 2^-4
  relative per element), so they approximate the reference; the CUDA tests state the tolerance.
No path syncs with the host, and every shape is static: CUDA graphs capture them as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SMALL_M = 64  # rows up to which the W8A16 kernel runs (memory-bound: reading W in FP8 is what counts)
# torch._scaled_mm's shape rule (cuBLASLt FP8): K and N multiples of 16
_SCALED_MM_ALIGN = 16


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """The per-element float32 scale of a [N, K] weight: block scales repeated over their tiles (edge tiles
    cut), channel scales along the rows."""
    rows, cols = shape
    if block is None:
        return scale.to(torch.float32).reshape(rows, 1).expand(rows, cols)
    br, bc = block
    s = scale.to(torch.float32).repeat_interleave(br, dim=-2)[..., :rows, :]
    return s.repeat_interleave(bc, dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """W8 x scale in float32, rounded to `dtype` (models/quantization.dequantize_block_fp8 computes the same)."""
    return (weight.to(torch.float32) * expand_scale(scale, tuple(weight.shape[-2:]), block)).to(dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: F.linear with the dequantized weight."""
    return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)


def quantize_rows(x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None,
                  scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (FP8 values, float32 scales) with x ~= values * scale: per row ([M, 1]), per 1 x group
    tile ([M, ceil(K / group)]), or, with static_scale (a checkpoint's input_scale, one number), that scale for
    every row ([M, 1]). scale_ub caps a dynamic scale's amax (fbgemm_fp8's activation_scale_ub)."""
    xf = x.to(torch.float32)
    m, k = xf.shape
    if static_scale is not None:
        scale = static_scale.to(torch.float32).reshape(1, 1).expand(m, 1)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()
    if group is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        scale = amax.clamp(min=1e-12) / FP8_MAX
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    groups = -(-k // group)
    padded = F.pad(xf, (0, groups * group - k)).view(m, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, groups * group)[:, :k]
    return q.to(FP8).contiguous(), scale


def w8a8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
             scale_ub: float | None = None) -> torch.Tensor:
    """What the W8A8 paths compute, in float32: the activations quantized as they quantize them (per 1 x bk group
    for the block layout, per token or with the static input_scale for channel), times the FP8 weight with its
    scales; the result rounded to x's dtype. (The CUDA tests compare those kernels with this.)"""
    group = block[1] if block is not None else None
    q, s = quantize_rows(x.reshape(-1, x.shape[-1]), group, input_scale if block is None else None, scale_ub)
    xd = q.to(torch.float32) * (s.repeat_interleave(group, dim=1)[:, :x.shape[-1]] if group else s)
    y = xd @ (weight.to(torch.float32) * expand_scale(scale, tuple(weight.shape), block)).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


@functools.cache
def _fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, block) -> bool:
    return (block is None and hasattr(torch, "_scaled_mm") and x.dtype == torch.bfloat16  # (row-wise: bf16 out)
            and weight.shape[0] % _SCALED_MM_ALIGN == 0 and weight.shape[1] % _SCALED_MM_ALIGN == 0
            and _fp8_tensor_cores(x.device))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
               scale_ub: float | None = None) -> torch.Tensor:
    """x [..., K] @ (W8 [N, K] with its scales)^T (+ bias) in x's dtype, by the path of the module docstring.
    input_scale (channel layout): the checkpoint's static activation scale, used where activations are
    quantized (W8A8); scale_ub: a cap on dynamic activation scales (fbgemm_fp8)."""
    from atlas.kernels import triton_available

    if not (x.is_cuda and triton_available() and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.numel()):
        return fp8_linear_ref(x, weight, scale, block, bias)
    from atlas.kernels import fp8_linear_triton as kt

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 1:
        y = kt.fp8_gemv_triton(x2, weight, scale, block, bias)
    elif m <= SMALL_M or x.dtype == torch.float32 or (block is not None and (block[1] < 32 or block[1] & (block[1] - 1))):
        # (an FP8 tl.dot takes K tiles of 32 and more, a power of two: other scale blocks dequantize, whatever M)
        y = kt.fp8_w8a16_triton(x2, weight, scale, block, bias)
    elif block is not None:
        q, s = quantize_rows(x2, block[1])
        y = kt.fp8_block_gemm_triton(q, s, weight, scale, block, bias, x.dtype)
    elif _scaled_mm_fits(x2, weight, block):
        q, s = quantize_rows(x2, None, input_scale, scale_ub)
        y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.view(1, -1), out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
    else:
        y = fp8_linear_ref(x2, weight, scale, block, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A floating-point weight [N, K] -> (FP8 values, float32 scale per output row [N]): amax / 448 per row
    (--quantization fp8)."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
