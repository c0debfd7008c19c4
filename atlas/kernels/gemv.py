"""y = x @ W^T (+ b) for the linear layers: F.linear (cuBLAS on CUDA, the reference everywhere), or
on CUDA the Triton small-M GEMV (kernels/gemv_triton.py), which for a single row also takes the gated
MLP's activation as gate|up's epilogue (`linear(..., act=)`). A batch-1 decode layer is then eight kernels:
RMSNorm, q|k|v, the attention prologue, attention, o, add + RMSNorm, gate|up + activation, down.

Which kernel runs a shape is decided once, at model load on CUDA (`tune_shapes` over the model's `linear_weights`, before CUDA graphs
are captured), from the `gemv` tuning knob (EngineConfig.tuning.gemv, `--tuning gemv=...`):
- "default" (the default): on GPUs of compute capability 9.0 and up (where it was measured: H100/H200), the
  GEMV with one fixed tile config for single rows of every shape, with nothing timed, so the same model
  computes the same bits at every start; cuBLAS elsewhere;
- "auto": cuBLAS and each GEMV config timed per (N, K, dtype) at M = 1 (1.5 s of a cold start), the GEMV
  kept where it wins by 3 %;
- "1": the fastest GEMV config for every shape, however slow (benchmarking); "0": cuBLAS everywhere.
Rows 2-16 (a verify step, a small batch) go to cuBLAS, unless the `gemv_rows` knob names a "dot" tile for their row
count (`rows_choice`; for measuring a verify step's matmuls in the model: BENCHMARKS.md 3.3).
A single decode row through the GEMV rounds otherwise than the same row among a verify step's K + 1
through cuBLAS, so bf16 speculative outputs equal plain decoding's only up to that rounding (as cuBLAS's
own choice of kernel by row count already makes them: README, "Speculative decoding"). Until something
is recorded (CPU runs, tests) `linear` is F.linear.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atlas.config import GEMV_MODES
from atlas.errors import ConfigError
from atlas.kernels.fused_ops import act_and_mul, triton_act_code
from atlas.kernels.streams import capture_stream

logger = logging.getLogger(__name__)

MAX_M = 8  # rows the GEMV takes; larger batches are cuBLAS's
MAX_ROWS_TABLE = 16  # (the gemv_rows knob's largest row count: the "dot" kernel pads x's rows to 16)
# A GEMV must beat cuBLAS by this factor in "auto": near-ties are left to cuBLAS (timing noise).
AUTO_MARGIN = 0.97
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # (the weight dtypes the GEMV kernel takes)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    kind: str = "dot"  # "dot" (tensor cores, rows padded to 16) or "sum" (CUDA cores): gemv_triton.py

    def __str__(self) -> str:
        if self.kind == "w8a8":  # (FP8 rows sent to the large-M path: kernels/fp8_linear.parse_config)
            return "w8a8"
        return f"{self.kind}-n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"


# Candidates timed per shape at load: the fastest of `atlas bench gemv`'s grid on an H200 (BENCHMARKS.md),
# CUDA-core tiles of 4-8 outputs x 1-2K of K, and one tl.dot tile. A "sum" config runs only single rows
# (SUM_MAX_ROWS): its [rows, BLOCK_N, BLOCK_K] products would not fit in registers for more, and more rows
# were not measured; those go to cuBLAS. The first is the default's: the fastest of 47 configs on 8 of the 9
# single-row shapes of an 8B model at TP=1 and TP=2, and within 5 % on the ninth (BENCHMARKS.md, session 25).
CONFIGS = (GemvConfig(4, 2048, 4, 3, "sum"), GemvConfig(4, 2048, 4, 1, "sum"), GemvConfig(8, 1024, 4, 3, "sum"),
           GemvConfig(16, 256, 4, 4))
SUM_MAX_ROWS = 1
DEFAULT_CONFIG = CONFIGS[0]

# (N, K, dtype) -> the GEMV config to run it with; absent: F.linear.
_CHOICES: dict[tuple[int, int, torch.dtype], GemvConfig] = {}
_FORCED: GemvConfig | None = None  # gemv=1: every shape not in _CHOICES


# The default's compute capability floor: the GEMV was measured faster than cuBLAS from here (H200).
DEFAULT_MIN_CAPABILITY = (9, 0)


def decide(times: dict[str | GemvConfig, float], mode: str) -> GemvConfig | None:
    """The kernel for one shape from its measured times ({"cublas": t, GemvConfig: t, ...}, any unit):
    the fastest GEMV config, if mode is '1' or it beats cuBLAS by AUTO_MARGIN in 'auto'; None (cuBLAS)
    otherwise."""
    if mode == "0":
        return None
    gemvs = {c: t for c, t in times.items() if isinstance(c, GemvConfig)}
    if not gemvs:
        return None
    best = min(gemvs, key=gemvs.__getitem__)
    if mode == "1":
        return best
    cublas = times.get("cublas")
    return best if cublas is None or gemvs[best] < AUTO_MARGIN * cublas else None


def record(choices: dict[tuple[int, int, torch.dtype], GemvConfig | None], mode: str) -> None:
    """Replace the registry with `choices` (None entries: cuBLAS); mode '1' also forces the GEMV for
    shapes not measured."""
    global _FORCED
    _CHOICES.clear()
    _CHOICES.update({k: c for k, c in choices.items() if c is not None})
    _FORCED = DEFAULT_CONFIG if mode == "1" else None


def reset() -> None:
    record({}, "0")


def choice(n: int, k: int, dtype: torch.dtype) -> GemvConfig | None:
    return _CHOICES.get((n, k, dtype), _FORCED)


@functools.lru_cache(maxsize=8)
def parse_rows_table(text: str) -> dict[int, GemvConfig]:
    """The `gemv_rows` knob ("8:dot-n16k256w4s4;16:dot-n32k256w4s4") as {rows: config}; a ConfigError naming the
    part that is not ROWS:dot-nNkKwWsS with ROWS in 2..16."""
    table: dict[int, GemvConfig] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        rows, _, config = part.partition(":")
        found = re.fullmatch(r"dot-n(\d+)k(\d+)w(\d+)s(\d+)", config.strip())
        if not rows.strip().isdigit() or found is None:
            raise ConfigError(f"tuning gemv_rows: {part!r} is not ROWS:dot-nNkKwWsS (e.g. 8:dot-n16k256w4s4)")
        key = int(rows)
        if not 2 <= key <= MAX_ROWS_TABLE:
            raise ConfigError(f"tuning gemv_rows: row count {key} is not in 2..{MAX_ROWS_TABLE}")
        n, k, w, st = (int(v) for v in found.groups())
        if not (all(v >= 16 and v & (v - 1) == 0 for v in (n, k)) and w in (1, 2, 4, 8, 16) and st >= 1):
            raise ConfigError(f"tuning gemv_rows: {part!r}: a tl.dot tile takes n and k powers of two from 16, w a "
                              f"power of two up to 16 and s at least 1")
        table[key] = GemvConfig(n, k, w, st, "dot")
    return table


def rows_choice(m: int, text: str) -> GemvConfig | None:
    """The `gemv_rows` table's config for m rows (the next key up), None below 2 rows or above its largest key."""
    if m < 2 or not text:
        return None
    table = parse_rows_table(text)
    key = next((r for r in sorted(table) if r >= m), None)
    return table[key] if key is not None else None


def _gemv_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 widen: bool = False) -> GemvConfig | None:
    """The GEMV config to run x @ weight^T with, or None for F.linear (widen: linear_widened's product)."""
    from atlas.kernels import settings

    if settings.tuning.gemv_rows and x.is_cuda and x.numel() and x.numel() // x.shape[-1] >= 2:
        cfg = rows_choice(x.numel() // x.shape[-1], settings.tuning.gemv_rows)
        return cfg if cfg is not None and _takes(cfg, x, weight, bias, widen) else None
    if not ((_CHOICES or _FORCED is not None) and x.is_cuda and x.numel() <= MAX_M * x.shape[-1] and x.numel()):
        return None
    cfg = choice(weight.shape[0], weight.shape[1], weight.dtype)
    if cfg is not None and (cfg.kind != "sum" or x.numel() <= SUM_MAX_ROWS * x.shape[-1]) and _takes(cfg, x, weight,
                                                                                                      bias, widen):
        return cfg
    return None


def _takes(cfg: GemvConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           widen: bool = False) -> bool:
    """Whether the GEMV runs this product: x's dtype (with widen, a narrower x against a float32 W, which the "sum"
    kind widens as it loads it), contiguous W, the bias in x's dtype, nothing for autograd (the GEMV has no
    backward)."""
    same = x.dtype == weight.dtype or (widen and cfg.kind == "sum" and weight.dtype == torch.float32 and bias is None
                                       and x.dtype in DTYPES)
    return (same and weight.is_contiguous() and weight.dtype in DTYPES
            and (bias is None or bias.dtype == x.dtype)
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           act: str | None = None, push=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV where the registry says so. With `act` (an HF hidden_act
    name) weight is [gate | up] and the result act(gate) * up (fused_ops.act_and_mul), the GEMV's epilogue where
    a "sum" config runs it, a kernel of its own otherwise. push: the PeerAllReduce (kernels/peer_all_reduce.py)
    that all-reduces the result next; where a "sum" config runs and it takes the result, the GEMV sends the
    rows to the peers itself (gemv_triton's push). out (without bias and act): the result is written there
    (cuBLAS writes it in place; the GEMV's few rows are copied) and returned."""
    assert out is None or (bias is None and act is None)
    from atlas.kernels import settings

    cfg = _gemv_config(x, weight, bias)
    # (a config of the gemv_rows knob: the activation after it; a registry "dot" tile with one: cuBLAS, as before)
    rows_table = cfg is not None and bool(settings.tuning.gemv_rows) and x.numel() >= 2 * x.shape[-1]
    if cfg is not None and act is not None and not rows_table and not (
            cfg.kind == "sum" and weight.shape[0] % 2 == 0 and cfg.block_n % 2 == 0):
        cfg = None  # (a "dot" config has no epilogue: cuBLAS, then the activation kernel)
    if cfg is None:
        if out is not None:
            return torch.matmul(x, weight.t(), out=out)
        y = F.linear(x, weight, bias)
        return act_and_mul(y, act) if act is not None else y
    from atlas.kernels.gemv_triton import gemv_triton

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if cfg.kind != "sum" or act is not None:
        push = None  # (only the "sum" kernel without an activation has the push epilogue)
    fused_act = act is not None and cfg.kind == "sum"
    y = gemv_triton(x2, weight, bias, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.kind,
                    act=triton_act_code(act) if fused_act else None, push=push)
    if act is not None and not fused_act:
        y = act_and_mul(y, act)
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if out is None else out.copy_(y)


def linear_widened(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x.float(), weight) for a float32 weight (the routers that score in float32). A single row that the
    registry gives a "sum" config goes to that GEMV with x as it is: it widens x as it loads it, so the products and
    their sums are those after the cast, and the cast's own launch (which PDL's chain did not reach) is gone."""
    assert weight.dtype == torch.float32
    cfg = _gemv_config(x, weight, None, widen=True) if x.dtype != weight.dtype else None
    if cfg is None:  # (else a "sum" config: _takes widens for no other)
        return linear(x.float(), weight)
    from atlas.kernels.gemv_triton import gemv_triton

    y = gemv_triton(x.reshape(-1, x.shape[-1]).contiguous(), weight, None, cfg.block_n, cfg.block_k, cfg.num_warps,
                    cfg.num_stages, cfg.kind)
    return y.view(*x.shape[:-1], y.shape[-1])


# --------------------------------------------------------------------------------------------------
# Load-time measurement (CUDA)
# --------------------------------------------------------------------------------------------------

def graph_time_ms(fn, weights: list[torch.Tensor], replays: int = 7) -> float:
    """Device time of one fn(w) call as a decode step pays it: a CUDA graph calls fn once per weight in
    turn (a model's layers of one shape; together many times the L2, so each is read from HBM), and the
    median replay is divided by their number. Timing single launches instead would count the host's
    launch cost, which a graph does not pay and which is larger for a Triton launch than for cuBLAS."""
    for w in weights[:2]:  # compiles, cuBLAS heuristics
        fn(w)
    side = capture_stream()  # (the one every capture uses: cuBLAS keeps a workspace per stream)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up on the capture stream before capture, as torch.cuda.graphs asks)
        fn(weights[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for w in weights:
            fn(w)
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    del graph
    return times[len(times) // 2] / len(weights)


def measure(weights: list[torch.Tensor], configs: Iterable[GemvConfig] = CONFIGS, rows: int = 1,
            replays: int = 7) -> dict[str | GemvConfig, float]:
    """Milliseconds of cuBLAS and of each GEMV config at M = rows over weights of one (N, K, dtype)
    (`graph_time_ms`: pass enough weights to exceed the L2 several times)."""
    from atlas.kernels.gemv_triton import gemv_triton

    w0 = weights[0]
    x = torch.randn(rows, w0.shape[1], dtype=w0.dtype, device=w0.device)
    times: dict[str | GemvConfig, float] = {"cublas": graph_time_ms(lambda w: F.linear(x, w), weights, replays)}
    for cfg in configs:
        times[cfg] = graph_time_ms(lambda w, c=cfg: gemv_triton(x, w, None, c.block_n, c.block_k, c.num_warps,
                                                                c.num_stages, c.kind), weights, replays)
    return times


@torch.inference_mode()
def tune_shapes(groups: dict[tuple[int, int, torch.dtype], list[torch.Tensor]], mode: str) -> dict:
    """Measure (mode 'auto' or '1') and record the kernel for each weight shape of `groups` ((N, K, dtype) -> the
    CUDA weights of that shape: `layers.linear.linear_weights(model)`; none leaves the registry empty). `mode`: the
    gemv tuning knob, 'default', '0', '1' or 'auto' (module docstring). Returns {shape: (choice, times)}, empty
    where nothing was timed."""
    if mode not in GEMV_MODES:
        raise ValueError(f"GEMV mode must be one of {', '.join(GEMV_MODES)}, not {mode!r}")
    if mode == "default" and groups:
        device = next(iter(groups.values()))[0].device
        mode = "fixed" if torch.cuda.get_device_capability(device) >= DEFAULT_MIN_CAPABILITY else "0"
    if mode == "0" or not groups:
        record({}, "0")
        if groups:
            logger.info("small-M GEMV off: cuBLAS for every linear layer")
        return {}
    from atlas.kernels import triton_available

    if not triton_available():
        record({}, "0")
        return {}
    if mode == "fixed":
        record(dict.fromkeys(groups, DEFAULT_CONFIG), "0")
        logger.info("small-M GEMV (default): %s for single rows of every linear layer", DEFAULT_CONFIG)
        return {}
    results, choices = {}, {}
    for shape, weights in groups.items():
        times = measure(weights)
        choices[shape] = decide(times, mode)
        results[shape] = (choices[shape], times)
    torch.cuda.empty_cache()
    record(choices, mode)
    parts = []
    for (n, k, dtype), (cfg, times) in results.items():
        best = min((t for c, t in times.items() if c != "cublas"), default=float("nan"))
        parts.append(f"{n}x{k} {str(dtype).removeprefix('torch.')}: "
                     f"{'GEMV ' + str(cfg) if cfg else 'cuBLAS'} (GEMV {1000 * best:.1f} us, "
                     f"cuBLAS {1000 * times['cublas']:.1f} us)")
    logger.info("small-M GEMV (gemv=%s, M <= %d): %s", mode, MAX_M, "; ".join(parts))
    return results
