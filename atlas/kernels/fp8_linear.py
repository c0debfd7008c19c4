"""y = x @ W^T (+ b) with W stored in float8_e4m3fn and float32 scales: the FP8 linear layers' matmul.

A weight's scales come in one of two layouts (layers/linear.py, `Fp8Scheme`):
- block: scale [ceil(N / bn), ceil(K / bk)], one per bn x bk tile of W (the DeepSeek-V3 / Qwen -FP8 layout;
  `block = (bn, bk)`, 128 x 128 in the published checkpoints);
- channel: scale [N], one per output row (per-channel checkpoints; a per-tensor scale is stored as its
  per-channel expansion, which computes the same).
W's value is W8[n, k] * scale[n // bn, k // bk] (channel: scale[n]).

The reference (`fp8_linear_ref`, what runs on CPU and wherever no kernel applies) dequantizes W, the product
in float32 rounded to the activation dtype, and multiplies with F.linear: exactly what loading the checkpoint
dequantized computes. On CUDA (`fp8_linear`), by the table of tuned choices below (GEMV_CONFIGS ... BLOCK_GEMM_TILE,
measured by `atlas bench fp8` / tools/gpu_fp8_tune.sh):
- a few rows (decode; GEMV_CONFIGS per row count): a "sum" config runs the CUDA-core GEMV reading W in FP8
  (`fp8_gemv_triton`, up to 8 rows), each weight in float32, the partial sums of a scale group scaled once,
  float32 accumulation: the reference's products without its rounding of W to bf16; with `act` (gate|up) the
  activation is its epilogue. An "rt" config runs the GEMV in row tiles (`fp8_gemv_row_tiles_triton`, up to 4
  rows: the same products, each W row of a program a tile in the layout of x's, fewer instructions a weight; the
  activation its epilogue at one row). An "xs" config runs its faster form where the scale blocks hold its tiles
  (`fp8_gemv_xs_triton`: each step's scale multiplies the activations, one reduction at the end). A "dot"
  config runs the W8A16 kernel, a "w8a8" config the large-M path below (the default for 2-8 rows);
- up to SMALL_M rows (8: decode batches, a verify step of one sequence) where the table names no kernel: a Triton W8A16 kernel (`fp8_w8a16_triton`) that
  dequantizes each W tile to the activation dtype in registers (the reference's rounding) and multiplies on
  the tensor cores, float32 accumulation;
- more rows (prefill, larger decode batches; from 16 rows the W8A16 kernel re-read the activations once for every
  16 columns and ran 2-4x slower than bf16 on the Qwen3-8B shape): W8A8 on FP8 tensor cores, the activations quantized as they arrive by one Triton kernel
  (`quantize_activations`; the reference is `quantize_rows`): block layout, cuBLASLt's 1 x 128 (activations) by
  128 x 128 (weights) block scaling through torch._scaled_mm (`blockwise_scaled_mm`; Hopper, cuBLASLt 12.9+,
  probed once) where it applies and BLOCK_LARGE_M says so, else a Triton GEMM with activations quantized per
  1 x bk group (`fp8_block_gemm_triton`); channel layout, torch._scaled_mm (cuBLASLt) with row-wise scales,
  activations quantized per token (or with the checkpoint's static input_scale where it has one). These round
  the activations to FP8 (about 2^-4 relative per element), so they approximate the reference; the CUDA tests
  state the tolerance.
No path syncs with the host, and every shape is static: CUDA graphs capture them as they are.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atlas.errors import ConfigError, ModelLoadError
from atlas.kernels.fused_ops import act_and_mul, triton_act_code
from atlas.kernels.gemv import GemvConfig

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448

# ---- The tuned choices, in one place ------------------------------------------------------------------------------
# tools/gpu_fp8_tune.sh times the candidates on the GPU (atlas/bench/fp8.py) and its summary prints this block as the
# run found it best; paste it here. Kernel configs are strings: "sum-n4k2048w4s3" = fp8_gemv_triton (CUDA cores) with
# BLOCK_N 4, 2048 columns a step, 4 warps, 3 stages; "dot-n16k128w4s4" = fp8_w8a16_triton (tensor cores) with BLOCK_N
# 16, BLOCK_K 128, 4 warps, 4 stages ("f16-...": the same with W8 and x multiplied in float16, the scale after the
# dot); "m64n128w4s3g8" = the Triton W8A8 GEMM's BLOCK_M, BLOCK_N, warps, stages, GROUP_M.
# Decode rows -> the small-M kernel (row counts between the keys take the next key up; above the largest key, up to
# SMALL_M, W8A16_CONFIG).
# One row takes the row tiles: in the Qwen3-8B model (block FP8, batch 1) 2.77 ms a step against the "sum" GEMV's 3.53
# and bf16's 4.21 in one run (session 64, BENCHMARKS 2.6); two W rows a program (n2) rather than four: 1.3 % shorter
# steps on an H100 (session 77: 3.185 against 3.227 ms) and 1.2 % on the H200 (session 64: 2.734 against 2.768).
# Rows 2-8 take W8A8: in the Qwen3-8B model the W8A16 kernel ran 10.9-14.2 ms a step there against W8A8's 4.3-4.8
# (bf16 4.4-4.6), though the kernel sweep alone ranked it first (session 57, BENCHMARKS 2.6).
GEMV_CONFIGS: dict[int, str] = {1: "rt-n2k2048w4s1", 2: "w8a8", 4: "w8a8", 8: "w8a8"}
GEMV_SHAPE_CONFIGS: dict[tuple[int, int, int], str] = {}  # (rows key, N, K) -> config: per-shape overrides
W8A16_CONFIG = "dot-n16k128w4s4"
SMALL_M = 8  # rows up to which the W8A16 kernel runs (above: W8A8, which at 16-64 rows ran 2-4x faster; BENCHMARKS 2.6)
# Block-scaled weights above SMALL_M: "scaled_mm" (cuBLASLt's 1 x 128 by 128 x 128 block scaling through
# torch._scaled_mm, where it applies: `blockwise_scaled_mm_fits`) or "triton" (fp8_block_gemm_triton everywhere).
BLOCK_LARGE_M = "scaled_mm"
BLOCK_GEMM_TILE = "m64n128w4s3g8"
# -------------------------------------------------------------------------------------------------------------------

# torch._scaled_mm's shape rule (cuBLASLt FP8): K and N multiples of 16
_SCALED_MM_ALIGN = 16
# cuBLASLt block scaling: the activations' scales [M, K / 128] M-major, their column stride (M) padded to 16 bytes
BLOCKWISE_ROWS_ALIGN = 4


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
    """W8 x scale in float32, rounded to `dtype`."""
    return (weight.to(torch.float32) * expand_scale(scale, tuple(weight.shape[-2:]), block)).to(dtype)


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype, name: str = "weight") -> torch.Tensor:
    """A checkpoint's block-scaled weight (float8, [..., rows, cols]) x its scales ([..., ceil(rows/br),
    ceil(cols/bc)]) in `dtype`; scales of another shape are a malformed checkpoint (ModelLoadError naming `name`)."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    expected = (*weight.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expected:
        raise ModelLoadError(f"malformed FP8 checkpoint: {name}_scale_inv has shape {tuple(scale_inv.shape)}, but "
                             f"{name} {tuple(weight.shape)} in blocks of {br}x{bc} needs {expected}")
    return dequantize(weight, scale_inv, block, dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: F.linear with the dequantized weight."""
    return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / FP8_MAX, IEEE-rounded on every device: PyTorch's CUDA division by a Python number multiplies by its
    rounded reciprocal (one rounding more, a last-bit difference from the CPU and from the Triton quantizers)."""
    return amax / torch.full_like(amax, FP8_MAX)


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
        scale = _over_fp8_max(amax.clamp(min=1e-12))
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    groups = -(-k // group)
    padded = F.pad(xf, (0, groups * group - k)).view(m, groups, group)
    scale = _over_fp8_max(padded.abs().amax(dim=-1).clamp(min=1e-12))
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
    return _w8a8_product(q, s, group, weight, scale, block, bias, x.dtype).view(*x.shape[:-1], weight.shape[0])


def _w8a8_product(q: torch.Tensor, s: torch.Tensor, group: int | None, weight: torch.Tensor, scale: torch.Tensor,
                  block: tuple[int, int] | None, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """w8a8_ref's product of quantized activations (q [M, K] FP8, s [M, K / group] or [M, 1]) with the FP8 weight, in
    float32, rounded to dtype: [M, N]."""
    xd = q.to(torch.float32) * (s.repeat_interleave(group, dim=1)[:, :q.shape[1]] if group else s)
    y = xd @ (weight.to(torch.float32) * expand_scale(scale, tuple(weight.shape), block)).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(dtype)


def parse_config(text: str) -> GemvConfig:
    """A small-M kernel config from its name ("sum-n4k2048w4s3", "xs-n16k128w4s3", "dot-n16k128w4s4",
    "f16-n16k128w4s4", "rt-n4k2048w4s1": GemvConfig's str; "rt" is the GEMV in row tiles,
    fp8_gemv_row_tiles_triton (BLOCK_N W rows a program, k columns a step; over 4 rows "sum" runs); "xs" is the
    CUDA-core GEMV with the scale on the activations, fp8_gemv_xs_triton; "f16" is the W8A16 kernel's float16
    variant, fp8_w8a16_triton's f16; "w8a8": these rows take the large-M path, activations quantized, as above
    SMALL_M)."""
    if text == "w8a8":
        return GemvConfig(0, 0, 0, 0, "w8a8")
    found = re.fullmatch(r"(sum|rt|xs|dot|f16)-n(\d+)k(\d+)w(\d+)s(\d+)", text)
    if found is None:
        raise ValueError(f"an FP8 small-M config is kind-nNkKwWsS (e.g. sum-n4k2048w4s3) or w8a8, not {text!r}")
    kind, n, k, w, st = found.groups()
    cfg = GemvConfig(int(n), int(k), int(w), int(st), kind)
    # (tile sizes a kernel cannot compile or run are refused here, at start-up, not at the first decode step)
    if not (_pow2(cfg.block_k) and _pow2(cfg.num_warps) and cfg.num_stages >= 1):
        raise ValueError(f"{text!r}: k and w must be powers of two and s at least 1")
    if kind == "rt" and not (cfg.block_n in (1, 2, 4) and cfg.block_k >= 16):
        raise ValueError(f"{text!r}: the row tiles take n 1, 2 or 4 and k of at least 16 (e.g. rt-n4k2048w4s1)")
    return cfg


def parse_tile(text: str) -> dict[str, int]:
    """The Triton W8A8 GEMM's tile from its name ("m64n128w4s3g8") as fp8_block_gemm_triton's keywords."""
    found = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)g(\d+)", text)
    if found is None:
        raise ValueError(f"a W8A8 GEMM tile is mMnNwWsSgG (e.g. m64n128w4s3g8), not {text!r}")
    m, n, w, st, g = (int(v) for v in found.groups())
    return dict(block_m=m, block_n=n, num_warps=w, num_stages=st, group_m=g)


@functools.lru_cache(maxsize=8)
def parse_gemv_table(text: str) -> dict[int, str]:
    """The `fp8_gemv` tuning knob ("1:xs-n8k128w4s4;8:dot-n16k128w4s4") as a GEMV_CONFIGS-like table."""
    table: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        rows, _, config = part.partition(":")
        try:
            key = int(rows)
            parse_config(config)
        except ValueError as e:
            raise ConfigError(f"tuning fp8_gemv: {part!r} is not ROWS:CONFIG (e.g. 1:xs-n8k128w4s4): {e}") from None
        if not 1 <= key <= 64:
            raise ConfigError(f"tuning fp8_gemv: row count {key} is not in 1..64 (SMALL_M)")
        table[key] = config
    return table


def small_m_config(m: int, n: int, k: int) -> GemvConfig | None:
    """The GEMV_CONFIGS (or GEMV_SHAPE_CONFIGS) entry for m rows of an N x K weight, or the `fp8_gemv` tuning
    knob's where it is set; None above its largest key."""
    from atlas.kernels import settings

    override = settings.tuning.fp8_gemv
    table = parse_gemv_table(override) if override else GEMV_CONFIGS
    key = next((r for r in sorted(table) if r >= m), None)
    if key is None:
        return None
    return parse_config(table[key] if override else GEMV_SHAPE_CONFIGS.get((key, n, k), table[key]))


def quantize_activations(x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None,
                         scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows, by one Triton kernel on CUDA (kernels/fp8_linear_triton.py) where it applies."""
    from atlas.kernels import triton_available

    if x.is_cuda and triton_available() and x.stride(-1) == 1 and x.dim() == 2:
        from atlas.kernels import fp8_linear_triton as kt

        if group is None:
            return kt.quantize_rows_triton(x, static_scale, scale_ub)
        if group & (group - 1) == 0:
            return kt.quantize_groups_triton(x, group)
    return quantize_rows(x, group, static_scale, scale_ub)


@functools.cache
def e4m3_capable(device: torch.device) -> bool:
    """Whether this GPU converts and multiplies E4M3 in hardware (compute capability 8.9 and newer)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, block) -> bool:
    return (block is None and hasattr(torch, "_scaled_mm") and x.dtype == torch.bfloat16  # (row-wise: bf16 out)
            and weight.shape[0] % _SCALED_MM_ALIGN == 0 and weight.shape[1] % _SCALED_MM_ALIGN == 0
            and e4m3_capable(x.device))


def blockwise_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16, unit stride) @ (W8 [N, K] with 128 x 128 block scales [ceil(N / 128), ceil(K / 128)])^T
    (+ bias) -> [M, N] bf16 by cuBLASLt's block scaling (torch._scaled_mm; compute capability 9.x, cuBLASLt 12.9+):
    the activations quantized per 1 x 128 group by one kernel, their scales M-major ([M, K / 128] with strides
    (1, M): what `_scaled_mm` takes as BlockWise1x128), rows padded to a multiple of 4 (zeros) so that stride is
    16-byte aligned; the weight as W^T [K, N] (column-major, a view) with its scales transposed (a view, [K / 128,
    N / 128] of strides (1, K / 128): BlockWise128x128). Computes what w8a8_ref does, summed by cuBLASLt."""
    m = x.shape[0]
    if x.is_cuda:
        from atlas.kernels import fp8_linear_triton as kt

        q, s = kt.quantize_groups_triton(x, 128, pad_rows_to=BLOCKWISE_ROWS_ALIGN, m_major=True)
    else:  # (the layout by PyTorch ops: for checking the shapes off the GPU)
        rows = quantized_rows_ref(x)
        q, s = rows.q, rows.scale
    return _blockwise_mm(q, s, m, weight, scale, bias, x.dtype)


def _blockwise_mm(q: torch.Tensor, s: torch.Tensor, m: int, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """blockwise_scaled_mm's product of activations already quantized in its layout (q [M', K], s M-major [M', K /
    128], M' = m padded to BLOCKWISE_ROWS_ALIGN) -> [m, N] in dtype."""
    if not q.is_cuda:  # (the reference: cuBLASLt's block scaling is CUDA's)
        return _w8a8_product(q[:m], s[:m], 128, weight, scale, (128, 128), bias, dtype)
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.t(), out_dtype=dtype)
    if y.shape[0] != m:
        y = y[:m]
    return y + bias if bias is not None else y


def quantized_rows_ref(x: torch.Tensor, group: int = 128) -> QuantizedRows:
    """x [M, K] as QuantizedRows by PyTorch ops (quantize_rows in `blockwise_scaled_mm`'s layout): what the fused
    kernels write, for the CPU."""
    pad = -x.shape[0] % BLOCKWISE_ROWS_ALIGN
    q, s = quantize_rows(F.pad(x, (0, 0, 0, pad)), group)
    return QuantizedRows(q, s.t().contiguous().t(), x.shape[0], x.dtype)


@dataclass(frozen=True)
class QuantizedRows:
    """Activations quantized by the kernel that produced them, for a block-scaled FP8 layer's cuBLASLt path (the
    fp8_fused_quant tuning knob): an RMSNorm or the gated activation writes its rows in FP8 per 1 x 128 group
    instead of in the model dtype, and the layer's matmul skips its own quantization launch. q [M', K] FP8 and scale
    [M', K / 128] float32 M-major, in `blockwise_scaled_mm`'s layout (M' = rows padded to BLOCKWISE_ROWS_ALIGN,
    the padding rows zeros); `rows` [M] real rows; `dtype` the activations' dtype (the matmul's output's). The
    values and scales are those quantize_groups_triton gives for the unfused kernel's output, bit for bit."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.q.shape[1]

    @property
    def device(self) -> torch.device:
        return self.q.device


def takes_quantized_rows(m: int, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                         dtype: torch.dtype, device: torch.device) -> bool:
    """Whether fp8_linear of m rows of `dtype` on this block-scaled weight takes QuantizedRows: the fp8_fused_quant
    knob is on and these rows take the cuBLASLt block path (`fp8_linear`'s branch for them: the small-M table says
    w8a8, or no table row and more than SMALL_M rows; 128 x 128 blocks, bf16, `blockwise_scaled_mm_fits`)."""
    from atlas.kernels import settings, triton_available

    if not (settings.tuning.fp8_fused_quant and device.type == "cuda" and dtype == torch.bfloat16 and m > 0
            and block is not None and BLOCK_LARGE_M == "scaled_mm" and triton_available()):
        return False
    cfg = small_m_config(m, *weight.shape)
    if not ((cfg is None and m > SMALL_M) or (cfg is not None and cfg.kind == "w8a8")):
        return False
    return _blockwise_fits(dtype, device, weight, scale, block, probe=True)


_BLOCKWISE_OK: dict[int, bool] = {}


def blockwise_scaled_mm_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm does 1 x 128 by 128 x 128 block scaling on this device: tried once (eagerly) on a
    small problem against w8a8_ref; refused (compute capability other than 9.x, cuBLASLt older than 12.9, a torch
    without it) or wrong, it is False and the Triton GEMM runs. During a CUDA graph capture nothing is tried."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _BLOCKWISE_OK:
        return _BLOCKWISE_OK[index]
    if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return False
    ok = False
    if hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device)[0] == 9:
        try:
            g = torch.Generator().manual_seed(7)
            w = torch.randn(256, 512, generator=g)
            s = w.view(2, 128, 4, 128).abs().amax(dim=(1, 3)) / FP8_MAX
            w8 = (w.view(2, 128, 4, 128) / s[:, None, :, None]).view(256, 512).to(FP8)
            x = torch.randn(50, 512, generator=g).to(device, torch.bfloat16)
            w8, s = w8.to(device), s.to(device)
            got = blockwise_scaled_mm(x, w8, s).float()
            want = w8a8_ref(x, w8, s, (128, 128)).float()
            err = float((got - want).abs().max() / want.abs().max())
            ok = err < 2 ** -6
            if not ok:
                logger.warning("torch._scaled_mm block scaling is off by %.3g here: the Triton FP8 GEMM runs", err)
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
            logger.info("torch._scaled_mm has no 1x128/128x128 block scaling here (%s): the Triton FP8 GEMM runs",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
    _BLOCKWISE_OK[index] = ok
    return ok


def blockwise_scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             block: tuple[int, int] | None, probe: bool = True) -> bool:
    """Whether `blockwise_scaled_mm` takes this problem: 128 x 128 blocks, bf16 activations, N and K multiples of
    16, the weight scales' row stride ceil(K / 128) a multiple of 4 floats (16 bytes) and contiguous, and (probe)
    the device does it."""
    return _blockwise_fits(x.dtype, x.device, weight, scale, block, probe)


def _blockwise_fits(dtype: torch.dtype, device: torch.device, weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None, probe: bool) -> bool:
    """blockwise_scaled_mm_fits for activations of `dtype` on `device`."""
    if block is None or tuple(block) != (128, 128) or dtype != torch.bfloat16 or not hasattr(torch, "_scaled_mm"):
        return False
    n, k = weight.shape
    groups = -(-k // 128)
    if n % _SCALED_MM_ALIGN or k % _SCALED_MM_ALIGN or groups % 4 or not scale.is_contiguous() \
            or tuple(scale.shape) != (-(-n // 128), groups) or not weight.is_contiguous():
        return False
    return not probe or (device.type == "cuda" and blockwise_scaled_mm_available(device))


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
               scale_ub: float | None = None, act: str | None = None,
               quantize_act: bool = False) -> torch.Tensor | QuantizedRows:
    """x [..., K] @ (W8 [N, K] with its scales)^T (+ bias) in x's dtype, by the path of the module docstring.
    input_scale (channel layout): the checkpoint's static activation scale, used where activations are
    quantized (W8A8); scale_ub: a cap on dynamic activation scales (fbgemm_fp8). act (an HF hidden_act name):
    W is [gate | up] and the result act(gate) * up [..., N / 2], the GEMV's epilogue where a "sum" config runs,
    fused_ops.act_and_mul after the matmul otherwise. x as QuantizedRows (takes_quantized_rows said so): the
    cuBLASLt block path on its values. quantize_act (the next layer takes QuantizedRows of these rows): where the
    activation is a kernel of its own, it writes QuantizedRows [rows, N / 2]."""
    from atlas.kernels import triton_available

    if isinstance(x, QuantizedRows):
        y = _blockwise_mm(x.q, x.scale, x.rows, weight, scale, bias, x.dtype)
        return _activate(y, act, quantize_act) if act is not None else y

    # (scale blocks narrower than 16 columns, which no published checkpoint has, are below every kernel's K tile:
    # the reference's dequantize-and-multiply)
    if not (x.is_cuda and triton_available() and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.numel()) or (block is not None and block[1] < 16):
        y = fp8_linear_ref(x, weight, scale, block, bias)
        return act_and_mul(y, act) if act is not None else y
    from atlas.kernels import fp8_linear_triton as kt

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n, k = weight.shape
    cfg = small_m_config(m, n, k)
    w8a8 = cfg is not None and cfg.kind == "w8a8"
    if w8a8:
        cfg = None
    if cfg is not None and cfg.kind == "rt":
        code = triton_act_code(act) if act is not None else None
        if m <= kt.ROW_TILES_MAX_ROWS and kt.fp8_gemv_row_tiles_fits(block, cfg.block_n):
            # (the activation is the one-row kernel's epilogue; with more rows, or a tile it does not fit, after it)
            fused = code is not None and m == 1 and n % 2 == 0 and kt.fp8_gemv_row_tiles_fits(block, cfg.block_n,
                                                                                               code)
            y = kt.fp8_gemv_row_tiles_triton(x2, weight, scale, block, bias, cfg.block_n, cfg.block_k,
                                             cfg.num_warps, cfg.num_stages, act=code if fused else None)
            if act is not None and not fused:
                y = act_and_mul(y, act)
            return y.view(*x.shape[:-1], n // 2 if act is not None else n)
        cfg = parse_config(f"sum-n4k{kt.GEMV_COLS}w{kt.GEMV_WARPS}s{kt.GEMV_STAGES}")  # (the CUDA-core GEMV)
    if cfg is not None and cfg.kind == "xs" and m <= kt.GEMV_MAX_ROWS:
        code = triton_act_code(act) if act is not None else None
        if kt.fp8_gemv_xs_fits(weight, block, cfg.block_n, cfg.block_k, code):
            y = kt.fp8_gemv_xs_triton(x2, weight, scale, block, bias, cfg.block_n, cfg.block_k, cfg.num_warps,
                                      cfg.num_stages, act=code)
            return y.view(*x.shape[:-1], n // 2 if act is not None else n)
        cfg = parse_config(W8A16_CONFIG)  # (a layout whose blocks do not hold the tile: the W8A16 kernel)
    if cfg is not None and cfg.kind == "sum" and (block is None or _pow2(block[1])) and m <= kt.GEMV_MAX_ROWS:
        fused = act is not None and n % 2 == 0 and cfg.block_n % 2 == 0
        y = kt.fp8_gemv_triton(x2, weight, scale, block, bias, cfg.block_n, cfg.block_k, cfg.num_warps,
                               cfg.num_stages, act=triton_act_code(act) if fused else None)
        if fused:
            return y.view(*x.shape[:-1], n // 2)
    elif (not w8a8 and (cfg is not None or m <= SMALL_M)) or x.dtype == torch.float32 or (
            block is not None and (block[1] < 32 or not _pow2(block[1]))):
        # (an FP8 tl.dot takes K tiles of 32 and more, a power of two: other scale blocks dequantize, whatever M)
        c = cfg if cfg is not None and cfg.kind != "sum" else parse_config(W8A16_CONFIG)
        y = kt.fp8_w8a16_triton(x2, weight, scale, block, bias, c.block_n, c.block_k, c.num_warps, c.num_stages,
                                f16=c.kind == "f16")
    elif block is not None:
        if BLOCK_LARGE_M == "scaled_mm" and blockwise_scaled_mm_fits(x2, weight, scale, block):
            y = blockwise_scaled_mm(x2, weight, scale, bias)
        else:
            q, s = quantize_activations(x2, block[1])
            y = kt.fp8_block_gemm_triton(q, s, weight, scale, block, bias, x.dtype, **parse_tile(BLOCK_GEMM_TILE))
    elif _scaled_mm_fits(x2, weight, block):
        q, s = quantize_activations(x2, None, input_scale, scale_ub)
        y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.view(1, -1), out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
    else:
        y = fp8_linear_ref(x2, weight, scale, block, bias)
    y = y.view(*x.shape[:-1], n)
    return _activate(y, act, quantize_act) if act is not None else y


def _activate(y: torch.Tensor, act: str, quantize: bool) -> torch.Tensor | QuantizedRows:
    """act(gate) * up of a [gate | up] product: fused_ops.act_and_mul, or (quantize, bf16 rows) one kernel that writes
    the result as QuantizedRows (on CUDA; the PyTorch ops elsewhere)."""
    if not (quantize and y.dim() == 2 and y.dtype == torch.bfloat16 and (y.shape[1] // 2) % 128 == 0):
        return act_and_mul(y, act)
    if not y.is_cuda:  # (the reference)
        return quantized_rows_ref(act_and_mul(y, act))
    from atlas.kernels.fused_ops_triton import act_and_mul_quant_triton

    q, s = act_and_mul_quant_triton(y, triton_act_code(act), pad_rows_to=BLOCKWISE_ROWS_ALIGN)
    return QuantizedRows(q, s, y.shape[0], y.dtype)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A floating-point weight [N, K] -> (FP8 values, float32 scale per output row [N]): amax / 448 per row
    (--quantization fp8)."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
