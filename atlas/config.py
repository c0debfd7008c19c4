"""Configuration: `EngineConfig` (every engine flag, its default and validation) and `ModelConfig`
(a typed view of a Hugging Face config.json).

The CLI flags and the keyword arguments of `LLM(...)` are both generated from `EngineConfig`'s fields,
so the two can never drift apart. Flag names follow vLLM where vLLM has one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas.errors import ConfigError, ModelLoadError
from atlas.sampling_params import DEFAULT_MAX_LOGPROBS

DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # (vLLM's names)


def human_int(value: str) -> int:
    """A count as vLLM's --max-model-len takes it: 4096, or with a suffix, k / m / g for powers of 1000 and K / M / G
    for powers of 1024 (4k = 4,000, 4K = 4,096, 25.6k = 25,600)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a count: {value!r} (e.g. 4096, 4k = 4,000, 4K = 4,096)")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    result = float(number) * scale
    if not suffix and "." in number or result != int(result):
        raise argparse.ArgumentTypeError(f"not a whole count: {value!r}")
    return int(result)
#: --kv-cache-dtype values (vLLM's names): auto keeps the model dtype; fp8 = fp8_e4m3 (layers.attention_backend)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
#: --quantization values (vLLM's names): fp8 quantizes the linear layers of a floating-point checkpoint at load
QUANTIZATIONS = ("fp8",)
SPECULATIVE_METHODS = ("ngram", "dflash", "mtp", "draft_model", "eagle3")
SPECULATIVE_POLICIES = ("adaptive", "always")
#: engine options that only --speculative dflash takes (an engine of another method must have them unset)
DFLASH_ONLY_OPTIONS = ("draft_model", "speculative_token_map")
#: option -> the methods besides dflash that take it too
OPTION_ALSO_FOR = {"draft_model": ("draft_model", "eagle3"), "speculative_token_map": ("mtp",)}
MAX_DRAFT_TOKENS = 32
DEVICES = ("auto", "cuda", "cpu")
#: --load-format values: auto = safetensors (the only weight format read); dummy = random weights, no files read
LOAD_FORMATS = ("auto", "safetensors", "dummy")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
#: --structured-outputs-backend values (atlas/structured/grammar.py: auto routes each constraint to one of the two)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "llguidance", "xgrammar")
#: --runner values (vLLM's): generate = text generation; pooling = an embedding engine (POST /v1/embeddings, LLM.embed)
RUNNERS = ("generate", "pooling")
#: vLLM's older --task values -> --runner
TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "embedding": "pooling"}

# CPU default for --kv-cache-memory when neither it nor --num-gpu-blocks-override is given.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
#: TuningConfig.gemv values (kernels/gemv.py): default = the fixed single-row GEMV on compute capability 9.0+
GEMV_MODES = ("default", "0", "1", "auto")
#: TuningConfig.pdl_trigger values (kernels/pdl.py)
PDL_TRIGGERS = ("first", "after-wait")
GDN_PREFILL_KERNELS = ("auto", "atlas", "fla")  # the chunked delta rule of hybrid models' prompt chunks (TuningConfig)
#: TuningConfig.tp_all_reduce values (runtime/parallel.py, parallel_groups.py); the order is the ranks' agreement code, nccl first
ALL_REDUCE_KINDS = ("nccl", "peer", "symm_mem")


def _flag(help: str, aliases: tuple[str, ...] = (), choices: tuple[str, ...] | None = None,
          metavar: str | None = None, type: Callable[[str], Any] | None = None, nargs: str | None = None
          ) -> dict[str, Any]:
    return {"help": help, "aliases": aliases, "choices": choices, "metavar": metavar, "type": type, "nargs": nargs}


def parse_memory_size(value: str | int | float | None, name: str) -> int | None:
    """'4GiB', '512MB', '1e9' or a plain number of bytes -> bytes."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", value, re.IGNORECASE)
    if not m:
        raise ConfigError(
            f"--{name.replace('_', '-')}: cannot read {value!r} as a size; write e.g. 4GiB, 512MiB or 1073741824"
        )
    number = float(m.group(1))
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    size = int(number * scale[unit])
    if size <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value!r}")
    return size


TOKENIZER_MODES = ("auto", "hf", "deepseek_v32")
# vLLM's other tokenizer modes, and why Atlas has none of them
_OTHER_TOKENIZER_MODES = {
    "slow": "Atlas runs the checkpoint's fast (tokenizers) tokenizer, whose ids the slow one shares",
    "mistral": "Atlas reads the checkpoint's Hugging Face tokenizer files, not mistral_common's tekken.json "
               "(Mistral's checkpoints ship both)",
    "custom": "Atlas registers no tokenizer classes of its own; a checkpoint's own tokenizer code runs with "
              "--trust-remote-code"}


def _tokenizer_mode(value: str) -> str:
    if value in TOKENIZER_MODES:
        return value
    reason = _OTHER_TOKENIZER_MODES.get(value, f"the modes are {', '.join(TOKENIZER_MODES)}")
    raise argparse.ArgumentTypeError(f"{value}: not implemented: {reason}; leave the flag out (auto)")


def _task_runner(value: str) -> str:
    """vLLM's --task VALUE -> the --runner it means."""
    if value not in TASK_RUNNERS:
        raise argparse.ArgumentTypeError(f"Atlas takes --task {' or '.join(TASK_RUNNERS)} (= --runner "
                                         f"{' / '.join(sorted(set(TASK_RUNNERS.values())))}), not {value!r}")
    return TASK_RUNNERS[value]


def _check_choice(what: str, value: Any, allowed: Sequence[str]) -> None:
    """A ConfigError "WHAT must be one of A, B, got VALUE" unless value is one of allowed."""
    if value not in allowed:
        raise ConfigError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")


def _knob(help: str) -> dict[str, Any]:
    return {"help": help}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class TuningConfig:
    """Tuning knobs: which kernel or code path runs, never what a request computes (at most its rounding in
    bf16, as the choice of kernel by shape already does). Each default is the one measured best on an H200
    (BENCHMARKS.md); the knobs are there for measuring and for ruling a path out. CLI: `--tuning KEY=VALUE[,...]`
    (or a JSON object; repeatable); LLM(...): `tuning={"gemv": "0"}` or `tuning=TuningConfig(gemv="0")`.

    The engine hands them down once at start-up: the runner's, the parallel state's and the proposers' own
    through the config they are built with; the kernels' (kernels/settings.py) through `configure`, which the
    model runner calls before it builds the model (a process-wide setting, as the kernels are shared)."""

    gemv: str = field(default="default", metadata=_knob(
        "small-M Triton GEMV for the linear layers, chosen at load (kernels/gemv.py): default = one fixed tile "
        "config for single rows on compute capability 9.0+, cuBLAS elsewhere; 0 = cuBLAS everywhere; auto = "
        "timed against cuBLAS per weight shape at load; 1 = the fastest GEMV config for every shape"))
    gemv_prefetch: bool = field(default=False, metadata=_knob(
        "the small-M GEMVs (bf16 / fp16 CUDA-core and tensor-core tiles, FP8 row tiles) load their first weight tile before they "
        "wait for the kernel before them under PDL, so that the next layer's weights stream in during that "
        "kernel's tail (the same sums); off: slower in bf16 (the 8B shape on the H200: 4.655 against 4.244 ms a "
        "step; gpt-oss-20b, DeepSeek-V2-Lite and Qwen3-30B-A3B at batch 1 on an H100: BENCHMARKS.md 2.6, 7, 7.3)"))
    fp8_gemv_prefetch: bool = field(default=True, metadata=_knob(
        "gemv_prefetch for the FP8 row tiles alone (the one-row GEMVs of FP8 linear layers; bf16 layers such as the "
        "LM head keep their order; the same sums): on the H200 gemv_prefetch sped the FP8 step and slowed the bf16 "
        "one, and this alone took the H100's FP8 batch-1 step from 3.50 to 3.31 ms; 0 = off"))
    gemv_rows: str = field(default="", metadata=_knob(
        "bf16 / fp16 linear layers at 2-16 rows (a verify step's, a small batch's) through the tensor-core GEMV by "
        "row count, in place of cuBLAS (for measuring in the model): ROWS:CONFIG[;ROWS:CONFIG...], e.g. "
        "8:dot-n16k256w4s4;16:dot-n32k256w4s4 (row counts between the keys take the next key up; CONFIG a 'dot' "
        "tile of kernels/gemv.py; checked when the engine starts); empty = cuBLAS from 2 rows"))
    fp8_fused_quant: bool = field(default=True, metadata=_knob(
        "block-scaled FP8 layers on cuBLASLt's block path (2 rows and more) take their activations quantized by the "
        "kernel before them: the RMSNorm before q|k|v and gate|up, and the gated activation before down, write FP8 "
        "per 1 x 128 group in place of the model dtype (the same values and scales, so the same outputs bit for bit; "
        "Llama-family models and DeepSeek's MLA with q_lora; the norms on one GPU). On the H200 it took the Qwen3-8B "
        "shape's batch-256 step from 1.10x to 1.19-1.21x bf16's speed and a 2,048-token prefill from 1.11x to "
        "0.78-0.82x bf16's time; 0 = each layer quantizes its own input"))
    fp8_quant_fma: bool = field(default=False, metadata=_knob(
        "the FP8 activation quantizers per 1 x 128 group divide by the group's scale as a multiply by its reciprocal "
        "corrected by two fused multiply-adds (the same FP8 values as the IEEE division for every bf16 and fp16 input: "
        "tools/quant_division_check.py) instead of a division per element; off until timed on a GPU"))
    fp8_gemv: str = field(default="", metadata=_knob(
        "FP8 linear layers' small-M kernel by row count, in place of kernels/fp8_linear.py's tuned table (for "
        "measuring configs in the model): ROWS:CONFIG[;ROWS:CONFIG...], e.g. 1:xs-n8k128w4s4;8:dot-n16k128w4s4 "
        "(row counts between the keys take the next key up; CONFIG w8a8: those rows quantize their activations and take "
        "the large-M GEMM; rt-nNkKwWsS: the GEMV in row tiles, up to 4 rows; checked when the engine starts); empty = "
        "the table"))
    kv_block_n: int = field(default=0, metadata=_knob(
        "keys a tile of an unsplit GQA attention program (a power of two from 16); 0 = the kernel's choice"))
    kv_stages: int = field(default=3, metadata=_knob(
        "key tiles in flight in the GQA attention kernel's loop for decode programs (at most 2 for wider "
        "programs, 1 in float32); 1 = no software pipelining"))
    attention_fused_combine: bool = field(default=False, metadata=_knob(
        "split-KV GQA decode attention: the last split of each program to finish merges the partials itself (an "
        "atomic count a program and KV head) in place of the combine kernel after it: one kernel a layer fewer (36 a "
        "step of the 8B shape, 0.077 ms of kernels on an H100 in session 91's profile); off until timed on a GPU"))
    mla_kv_stages: int = field(default=2, metadata=_knob(
        "latent tiles in flight in the MLA attention kernel's decode programs; 1 = no software pipelining"))
    pdl: bool = field(default=True, metadata=_knob(
        "programmatic dependent launch of the decode path's Triton kernels (compute capability 9.0+, CUDA 12.4+)"))
    pdl_trigger: str = field(default="first", metadata=_knob(
        "with pdl: first = the next kernel may launch before this one waits; after-wait = after (for measuring)"))
    moe_pdl: bool = field(default=True, metadata=_knob(
        "with pdl: the router and routed-expert Triton kernels take part too; off = they launch plainly while "
        "the rest keep PDL (for measuring: a batch-1 MoE step was shorter with pdl off altogether)"))
    moe_triton_max_tokens: int = field(default=64, metadata=_knob(
        "steps of up to this many tokens run the routed experts through the Triton kernels; 0 = never"))
    moe_pairs_max_tokens: int = field(default=4, metadata=_knob(
        "steps of up to this many tokens (0-4) take the Triton expert kernels that read the (token, choice) pairs "
        "unsorted (the fused pairs or the MXFP4 row tiles); above, the grouped tensor-core kernel over the pairs "
        "sorted by expert. 0 = the grouped kernel at every token count (for measuring it: on an H200 gpt-oss-20b's "
        "batch-1 step 2.830 ms with it, the one-program sort, the activation epilogue and the scales' fold, against "
        "the row tiles' 2.068; BENCHMARKS.md 7.3)"))
    moe_grouped_block_m: int = field(default=0, metadata=_knob(
        "rows of one expert that a program of the Triton grouped expert kernel multiplies at once (16, 32, 64 or "
        "128; each chunk reads the expert's weight slice again); 0 = from the rows per expert of the step (16 at "
        "decode sizes, up to 128 at prefill sizes: FP8 Qwen3-30B-A3B TTFT of 64 x 128 tokens 430 -> 215 ms; MXFP4 "
        "weights, which each chunk decodes again, 8x the mean rows: gpt-oss-20b's step at 64 requests 9.18 -> 5.97 "
        "ms on an H100)"))
    moe_grouped_gather: bool = field(default=True, metadata=_knob(
        "the Triton grouped expert kernel reads each (token, choice) row of the layer's input by index and the down "
        "kernel writes its rows back in (token, choice) order, instead of a copy of the rows in expert order before "
        "gate|up and another back after down, and one kernel sums each token's rows by their routing weights (for "
        "PyTorch's float32 copy, product and sum of them; at gpt-oss-20b's 256 requests the copy back alone took 10 "
        "us a layer on an H100). The same products, the choices added in their order (PyTorch's sum may pair them "
        "otherwise: float32 rounding apart). On an H100 gpt-oss-20b's step 5.10 -> 4.67 ms at 64 requests and 9.60 -> "
        "8.45 at 256, Qwen3-30B-A3B's 23.8 -> 22.7 at 64 (BENCHMARKS.md 7.3); 0 = the copies"))
    moe_expert_sort: bool = field(default=False, metadata=_knob(
        "with moe_grouped_gather, a step of up to 4,096 (token, choice) pairs and at most 256 experts a rank sorts its "
        "pairs by expert in one Triton program (kernels/moe_triton.expert_sort: the order, the rows they read and "
        "each expert's offsets) in place of the radix sort's, the count's, its sum's and the division's kernels; "
        "the same order (stable). Off until timed on a GPU"))
    moe_grouped_act: bool = field(default=False, metadata=_knob(
        "with moe_grouped_gather, the Triton grouped gate|up kernel computes the gated activation as its epilogue (its "
        "programs take gate and up rows side by side) in place of the [M, 2I] products and the activation kernel "
        "after them; the same roundings. Off until timed on a GPU"))
    moe_fused_routing: bool = field(default=True, metadata=_knob(
        "the router's choice (scores, top-k, weights) in one Triton kernel on CUDA where experts are not chosen by "
        "groups (kernels/moe_routing_triton.py); off = PyTorch ops"))
    moe_route_in_experts: bool = field(default=False, metadata=_knob(
        "at a few tokens on CUDA, the router's choice made inside the routed experts' gate|up kernel (each program "
        "choosing its pair's expert from the logits, as the router kernel does) instead of a launch of its own; "
        "where the router kernel would run, up to 128 experts, and gate|up takes the fused pairs kernel (not the FP8 "
        "or MXFP4 row tiles). Off: slower on an H100 (batch-1 step: DeepSeek-V2-Lite 2.822 ms against 2.757, "
        "Qwen3-30B-A3B 4.082 against 3.311; each program ranks every expert, BENCHMARKS.md 7)"))
    mla_fused_prologue: bool = field(default=True, metadata=_knob(
        "MLA's prologue (the latent's RMSNorm, RoPE of q_pe and k_pe, the latent cache row's write) in one Triton "
        "launch (kernels/fused_ops.mla_prologue); off = the PyTorch ops it replaces, some thirty small kernels a layer"))
    moe_fused_pairs: bool = field(default=True, metadata=_knob(
        "at a few tokens, the routed experts' gate|up with its activation, and down with the routing weights' sum, "
        "one Triton kernel each (kernels/moe_triton.py); off = the matmuls, the activation and the sum apart"))
    moe_mxfp4: bool = field(default=True, metadata=_knob(
        "MXFP4 routed experts (gpt-oss) stay MXFP4 in memory, read by the Triton expert kernels; off = dequantized "
        "to the model dtype as they load (four times the experts' memory; on an H200 the bf16 experts are the "
        "faster: BENCHMARKS.md 7.3)"))
    moe_down_rows: bool = field(default=True, metadata=_knob(
        "the fused down + routing-weights kernel loads a token's k choices' weight rows in one tile (all experts' "
        "loads at once; bf16 and FP8 weights, MXFP4's timed slower); off = one expert after another"))
    moe_row_tiles: bool = field(default=False, metadata=_knob(
        "FP8 routed experts' gate|up at a few tokens in row tiles (float32 weights, each thread summing runs of 16 "
        "columns: on sm_90 fewer instructions a weight than the pairs kernel's; tools/sass_loop_mix.py); off: on "
        "an H100 the Qwen3-30B-A3B shape's FP8 step took 2.82 ms with it against 2.78 (BENCHMARKS.md 7.2)"))
    moe_mxfp4_dot_pairs: bool = field(default=True, metadata=_knob(
        "MXFP4 routed experts (gpt-oss) at more tokens (the grouped tensor-core kernel): each byte's two E2M1 codes "
        "become a bf16 pair by integer operations and are scaled in bf16 (exact), and each step's scales load a step "
        "ahead; on sm_90 with Triton 3.6 its loop issues 0.19 warp instructions a weight against 0.30 (the codes "
        "through float32; gpt-oss-20b's step on an H100 at 64 requests 9.18 ms against 10.35, at 256 16.88 against "
        "19.95); off = through float32. bf16 activations only"))
    moe_mxfp4_fold: bool = field(default=True, metadata=_knob(
        "MXFP4 routed experts in the grouped tensor-core kernel (above 4 tokens) whose every E8M0 scale code is at "
        "most 128 (a block scale of at most 2; checked once as they load): each bf16 pair scaled by one multiply by "
        "2^(s - 1) in place of 2^126 and then 2^(s - 127), the same exact values, bit for bit (on sm_90 with Triton "
        "3.6 the loop issues 0.176 warp instructions a weight against 0.194 at 32 rows a chunk, 0.206 against 0.224 "
        "at 128). On an H200 gpt-oss-20b's step at 64 requests 4.302 / 4.257 ms against 4.360 / 4.372 off, at 256 "
        "7.947 / 7.871 against 8.100 / 8.065 (BENCHMARKS.md 7.3); off = the two multiplies"))
    moe_mxfp4_row_tiles: bool = field(default=True, metadata=_knob(
        "MXFP4 routed experts' (gpt-oss) gate|up with its activation and down with the routing weights' sum at a "
        "few tokens in row tiles (each thread summing runs of 32 columns, one scale each); off = the pairs kernels, "
        "whose loops issue twice the instructions a weight: gpt-oss-20b's batch-1 step 3.29 ms against 2.68 on an "
        "H100 (BENCHMARKS.md 7.3)"))
    moe_mxfp4_down_choices: bool = field(default=True, metadata=_knob(
        "the MXFP4 row tiles' down (bits or pairs decode) with a token's chosen experts side by side in each program, "
        "every choice's loads of a step in flight at once and the program's warps times the choices; off = the choices "
        "one after another (16 % achieved occupancy at gpt-oss-20b's batch 1, waiting on memory). On an H100 that "
        "step 2.330 ms against 2.428, the down kernel 16.9 us a layer against 20.3 (BENCHMARKS.md 7.3)"))
    moe_l2_prefetch: bool = field(default=False, metadata=_knob(
        "MXFP4 routed experts (gpt-oss) at a few tokens: each program of the one-token down kernel asks the L2 for "
        "its part of the next layer's first weight (q|k|v: up to 32 MiB, sm_90's bulk prefetch from one thread) "
        "while the experts' instruction issue, not their bytes, bounds the kernel; a hint only (no value changes). "
        "Off: on an H100 gpt-oss-20b's batch-1 step 2.245-2.252 ms against 2.190-2.192 (the down kernel 6 us a layer "
        "slower, the q|k|v GEMV 1.5 us faster; BENCHMARKS.md 7.3)"))
    moe_mxfp4_gate_up_cols: int = field(default=4, metadata=_knob(
        "output columns a program of the MXFP4 row tiles' gate|up (bits or pairs decode) takes as [columns, runs, 16] "
        "tiles of its gate and up rows: 2, 4 or 8 (warps times columns / 2: fewer, wider programs; x's step moves "
        "through shared memory at 4 and 8); 0 = the two-column kernel. gpt-oss-20b's batch-1 step on an H100 with "
        "the pairs decode: 2.206 ms at 4 against 2.233 at 8 and 2.233 with the two-column kernel (BENCHMARKS.md 7.3)"))
    moe_mxfp4_row_runs: int = field(default=0, metadata=_knob(
        "runs of 32 columns a step of the MXFP4 row tiles (16, 32 or 64; each with runs / 16 warps, so a thread "
        "takes 8 bytes of a row a step), or 0: the one that pads the experts' columns least (gpt-oss's 2,880 "
        "columns, 90 runs: 32, where 64 issue the loop for 128 runs: 0.268 warp instructions a weight on sm_90 "
        "against 0.357; gpt-oss-20b's batch-1 step 2.44 ms against 2.68-2.71 at 64 on an H100, BENCHMARKS.md 7.3)"))
    moe_mxfp4_decode: str = field(default="pairs", metadata=_knob(
        "how the MXFP4 row tiles decode E2M1 codes: bits (each code's sign and magnitude shifted from its byte into "
        "float32 bits, times 2^126), words (W read as int32 words, 8 codes to float32 bits by shifts of the word, x "
        "times 2^63 once a step instead of each code times 2^126) or e4m3 (W's words turned into E4M3 bytes of each "
        "code's value times 2^-6 by whole-word operations, then to halves by sm_89+'s E4M3 conversion, two at a "
        "time; refused below compute capability 8.9) or pairs (a byte's two codes placed in one int32 by two "
        "multiplies, as bf16 bits, its halves to float32 by a shift and a mask, x times 2^63 once a step: the bits "
        "form's sums times 2^-63 bit for bit while |x| lies within 2^-62 .. 2^65; 0.213 warp instructions a weight "
        "against bits' 0.250 on sm_90; gpt-oss-20b's batch-1 step 2.229 / 2.235 ms against bits' 2.333 / 2.336 on "
        "an H100; gpt-oss's activations lie well within that range); in the gate|up columns and down choices kernels "
        "only, pairs-fma (pairs' decode, each thread's products summed as a chain of fused multiply-adds) or "
        "words-fma (W's int32 words, each code's float32 bits by a mask, a multiply and a mask, no byte extracted, "
        "fused multiply-adds): gate|up 0.175 warp instructions a weight against pairs' 0.207, down 0.171 on 4 warps "
        "(moe_mxfp4_row_steps' WARPS) against 0.214 (sm_90, Triton 3.6), yet on an H200 gpt-oss-20b's batch-1 step "
        "2.400 ms with words-fma against pairs' 2.075 / 2.071, and 2.053 with pairs-fma (down on 4 warps) against "
        "2.068 / 2.070 (one pass, within the passes' spread: BENCHMARKS.md 7.3). The same "
        "products, summed in another order in the word and FMA forms (float32 rounding apart). The word forms issue fewer instructions a step (sm_90 at 16 runs, "
        "Triton 3.6: 513 / 458 / 350) but run slower: gpt-oss-20b's batch-1 step 2.43 ms with bits against 3.08 "
        "(words) and 3.01 (e4m3) at 32 runs, 2.53-2.63 at 16, on an H100 (BENCHMARKS.md 7.3)"))
    moe_mxfp4_row_steps: str = field(default="", metadata=_knob(
        "the MXFP4 row tiles' step per kernel, in place of moe_mxfp4_row_runs, one stage and moe_mxfp4_decode (for "
        "measuring configs in the model): KERNEL:RUNS:STAGES:DECODE[:WARPS][;...] with KERNEL gate_up or down, RUNS 0 "
        "(the step that pads least), 16, 32, 64 or 128 (warps = runs / 16), STAGES 1-3, DECODE one of "
        "moe_mxfp4_decode's forms, WARPS a program's warps in the gate|up columns and down choices kernels (1-16, "
        "powers of two), e.g. gate_up:16:1:e4m3;down:64:2:bits or down:0:1:words-fma:4 (checked when the engine "
        "starts); empty = those knobs"))
    moe_pairs_tiles: str = field(default="", metadata=_knob(
        "the routed experts' fused one-token kernels' tiles, in place of kernels/moe_triton.py's (for measuring "
        "configs in the model): KERNEL:nNkKwWsS[;...] with KERNEL gate_up or down, e.g. down:n4k256w4s3 "
        "(n output columns a program, gate_up's counting gate and up; k columns a step; w warps; s stages; "
        "checked when the engine starts); empty = the defaults"))
    mask_kernel: bool = field(default=True, metadata=_knob(
        "grammar masks applied by one Triton kernel on CUDA (bit-equal); off = PyTorch ops"))
    mixed_graphs: bool = field(default=True, metadata=_knob(
        "one device: mixed steps (query lengths that differ) replay CUDA graphs; off = eagerly"))
    mixed_graph_recurrent_rows: int = field(default=128, metadata=_knob(
        "hybrid models (linear-attention layers), one device: mixed steps whose sequences have at most this many "
        "rows each replay CUDA graphs too, their linear-attention layers through the recurrent kernel token by "
        "token (runtime/mixed_graphs.py); 0 = such steps run eagerly. 128: Qwen3.5-9B shape TTFT of a 128-token "
        "prompt 61 -> 13 ms, 64 streams 1.31x the output tokens/s (BENCHMARKS.md 14)"))
    pp_graphs: bool = field(default=True, metadata=_knob(
        "pipeline stages replay CUDA graphs of their layers; off = eagerly"))
    kv_cache_groups: bool = field(default=True, metadata=_knob(
        "a model with sliding-window layers beside global ones keeps the windowed layers' KV in a page pool of its "
        "own, whose pages below the window go back as sequences advance (engine/kv_groups.py); off = one page "
        "table for every layer, which keeps every page (the memory of full attention)"))
    lora_base_graphs: bool = field(default=True, metadata=_knob(
        "--enable-lora under CUDA graphs: a second set of step graphs without the adapter slots' kernels, replayed "
        "by steps in which no row reads an adapter (the sets share their memory pools; capture takes twice as "
        "long); off = one set, whose steps all run the slots (on an H100 the Qwen3-8B shape's base-model step took "
        "1.30-1.34x its time without --enable-lora)"))
    static_steps: bool = field(default=False, metadata=_knob(
        "where CUDA graphs are off (CPU), run uniform and mixed steps through the graphs' static buffers anyway, "
        "on every rank (for tests)"))
    tp_all_reduce: str = field(default="peer", metadata=_knob(
        "tensor-parallel all-reduces of decode steps: peer (the peer-memory kernel), nccl, or symm_mem "
        "(torch's symmetric-memory op, experimental)"))
    mtp_catch_up_graphs: bool = field(default=True, metadata=_knob(
        "the MTP module's and the EAGLE-3 drafter's pass over committed rows replays CUDA graphs; off = eagerly"))
    device_drafts: bool = field(default=True, metadata=_knob(
        "one device: DFlash, MTP and EAGLE-3 drafts stay on the device and are read back with the verify step's "
        "results; off = read back at once"))
    draft_after_verify: bool = field(default=True, metadata=_knob(
        "one device, drafts on it: the DFlash block (MTP's and EAGLE-3's pass and chain, a draft model's steps) is "
        "queued right behind each uniform verify step; off = drafted after the read-back"))
    late_scheduling: bool = field(default=False, metadata=_knob(
        "experimental (no gain measured: on the H200 at 256 streams its requests waited longer before their first "
        "step and TTFT was no better): `atlas serve`'s engine schedules each step as late as the step in flight "
        "allows (from measured step times; engine/device_clock.py), so that requests arriving during a long step "
        "join the next one; off = at once"))
    gdn_prefill: str = field(default="auto", metadata=_knob(
        "hybrid models' prompt chunks through the Gated DeltaNet layers (CUDA): atlas = the chunked delta rule in "
        "PyTorch ops, batched by length (kernels/gated_delta_rule.py); fla = flash-linear-attention's Triton chunk "
        "kernel, one call a step (`pip install flash-linear-attention`; the CPU keeps the PyTorch form); auto = fla "
        "where it imports (on the H200 it took TTFT of 2,048 tokens from 343 to 245 ms), else atlas"))
    gdn_snapshot_tail: bool = field(default=True, metadata=_knob(
        "hybrid models' rows after a prefix-cache snapshot taken inside a prompt chunk (at most 64) go through the "
        "recurrent kernel in one launch instead of a second chunked call a layer (on an H200, Qwen3.5-9B shape: TTFT "
        "of 128 tokens 141 against 53-70 ms, of 2,048 tokens 70-81 against 58 ms; BENCHMARKS.md 14); off = chunked"))
    draft_context_backlog: bool = field(default=True, metadata=_knob(
        "a DFlash engine's plain steps (drafting off) keep the target's captured rows in a buffer (at least 256 "
        "rows, 2 a running sequence) and write the drafter's context K/V from them in one batch when the drafter "
        "next reads it (a draft, a request's end or preemption, a sliding window releasing pages, the buffer full), "
        "so the drafter's weights are read once for many steps; off = written behind each step"))
    draft_lengths: str = field(default="", metadata=_knob(
        "experimental, slower where measured (DFlash at one request 1.52x plain against 3.18x without): draft "
        "lengths below --num-draft-tokens (colon-separated, e.g. 1:3) that the adaptive policy may give a drafting "
        "step instead of K, where a shorter verify step gives more tokens for its cost (a ladder; each length gets "
        "verify-step CUDA graphs of its own; DFlash then drafts after the read-back, not behind the verify step); "
        "empty = K only"))
    prelaunch_verify: bool = field(default=False, metadata=_knob(
        "experimental (no gain measured): with draft_after_verify, also queue the verify step after each "
        "drafted block before the host schedules it"))

    @property
    def draft_ladder(self) -> tuple[int, ...]:
        """draft_lengths as sorted distinct lengths (empty: K only)."""
        return tuple(sorted({int(n) for n in self.draft_lengths.split(":")})) if self.draft_lengths else ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _knob_value(f, getattr(self, f.name)))
        if self.draft_lengths and not all(n.isdigit() and int(n) > 0 for n in self.draft_lengths.split(":")):
            raise ConfigError(f"tuning draft_lengths must be positive integers separated by ':' (e.g. 1:3), got "
                              f"{self.draft_lengths!r}")
        _check_choice("tuning gemv", self.gemv, GEMV_MODES)
        _check_choice("tuning pdl_trigger", self.pdl_trigger, PDL_TRIGGERS)
        _check_choice("tuning gdn_prefill", self.gdn_prefill, GDN_PREFILL_KERNELS)
        if self.tp_all_reduce not in ALL_REDUCE_KINDS:
            raise ConfigError(f"tuning tp_all_reduce={self.tp_all_reduce!r} is not a tensor-parallel all-reduce: use "
                              f"one of {', '.join(ALL_REDUCE_KINDS)}")
        if self.kv_block_n and (self.kv_block_n < 16 or self.kv_block_n & (self.kv_block_n - 1)):
            raise ConfigError(f"tuning kv_block_n must be 0 or a power of two from 16, got {self.kv_block_n}")
        for name in ("kv_stages", "mla_kv_stages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tuning {name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.moe_pairs_max_tokens <= 4:
            raise ConfigError(f"tuning moe_pairs_max_tokens must be 0 to 4, got {self.moe_pairs_max_tokens}")
        if self.moe_grouped_block_m not in (0, 16, 32, 64, 128):
            raise ConfigError(f"tuning moe_grouped_block_m must be 0, 16, 32, 64 or 128, got {self.moe_grouped_block_m}")
        if self.moe_mxfp4_decode not in ("bits", "words", "e4m3", "pairs", "pairs-fma", "words-fma"):
            raise ConfigError(f"tuning moe_mxfp4_decode must be bits, words, e4m3, pairs, pairs-fma or words-fma, got "
                              f"{self.moe_mxfp4_decode!r}")
        if self.moe_mxfp4_gate_up_cols not in (0, 2, 4, 8):
            raise ConfigError(f"tuning moe_mxfp4_gate_up_cols must be 0, 2, 4 or 8, got {self.moe_mxfp4_gate_up_cols}")
        if self.moe_mxfp4_row_runs not in (0, 16, 32, 64):
            raise ConfigError(f"tuning moe_mxfp4_row_runs must be 0, 16, 32 or 64, got {self.moe_mxfp4_row_runs}")
        if self.moe_triton_max_tokens < 0:
            raise ConfigError(f"tuning moe_triton_max_tokens must be >= 0, got {self.moe_triton_max_tokens}")

    @classmethod
    def knob_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def parse(cls, text: str | dict[str, Any], base: TuningConfig | None = None) -> TuningConfig:
        """`base` (default: the defaults) with the knobs that `text` sets: a JSON object, or KEY=VALUE pairs
        separated by commas (dashes in a key read as underscores; booleans as 1/0, true/false, on/off)."""
        if isinstance(text, str):
            text = text.strip()
            if text.startswith("{"):
                try:
                    pairs = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"--tuning: {text!r} is not a valid JSON object ({exc})") from None
                if not isinstance(pairs, dict):
                    raise ConfigError(f"--tuning: {text!r} is not a JSON object")
            else:
                pairs = {}
                for item in filter(None, (part.strip() for part in text.split(","))):
                    key, sep, value = item.partition("=")
                    if not sep:
                        raise ConfigError(f"--tuning: {item!r} is not KEY=VALUE (knobs: {', '.join(cls.knob_names())})")
                    pairs[key.strip()] = value.strip()
        else:
            pairs = dict(text)
        changes = {}
        for key, value in pairs.items():
            name = str(key).replace("-", "_")
            if name not in cls.knob_names():
                raise ConfigError(f"unknown tuning knob {key!r}; knobs: {', '.join(cls.knob_names())}")
            changes[name] = value
        return dataclasses.replace(base if base is not None else cls(), **changes)

    def changes(self) -> dict[str, Any]:
        """The knobs that differ from their defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def __str__(self) -> str:
        """The knobs that differ from the defaults as `--tuning` takes them (empty for the defaults)."""
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.changes().items())


def _knob_value(f: dataclasses.Field, value: Any) -> Any:
    """A knob's value in its field's type (from a string or a JSON scalar), or a ConfigError."""
    kind = str(f.type)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in (*_TRUE, *_FALSE):
            return value.strip().lower() in _TRUE
        raise ConfigError(f"tuning {f.name} must be a boolean (1/0, true/false, on/off), got {value!r}")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"tuning {f.name} must be an integer, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"tuning {f.name} must be a string, got {value!r}")
    return str(value).strip().lower()


class _TuningAction(argparse.Action):
    """--tuning: each use sets the knobs it names on top of the earlier ones."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            setattr(namespace, self.dest, TuningConfig.parse(values, getattr(namespace, self.dest, None)))
        except ConfigError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None


@dataclass(frozen=True)
class HubAccess:
    """How hub ids are fetched (huggingface_hub's snapshot_download arguments): the cache folder (--download-dir;
    None: the Hugging Face cache) and the token (--hf-token; None: HF_TOKEN or the stored login). Kept out of
    repr: the token is a secret."""

    cache_dir: str | None = None
    token: str | None = field(default=None, repr=False)

    def snapshot_args(self) -> dict[str, Any]:
        return {"cache_dir": self.cache_dir, "token": self.token}


def json_object(text: str | dict[str, Any], flag: str) -> dict[str, Any]:
    """A flag's JSON object (a dict as it is), or a ConfigError naming the flag."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{flag}: not JSON ({exc}); give an object, e.g. '{{\"key\": value}}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: a JSON object, e.g. '{{\"key\": value}}', not {text!r}")
    return value


class _JsonObjectAction(argparse.Action):
    """A JSON-object flag: each use adds its keys to the earlier ones' (a key given again: the later value)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            new = json_object(values, option_string or self.dest)
        except ConfigError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest, None) or {}), **new})


@dataclass(frozen=True)
class LoraModule:
    """One --lora-modules entry: the name requests use, and where the adapter is (a folder or a hub id)."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        """NAME=PATH, or vLLM's JSON object {"name": ..., "path": ..., "base_model_name": ...}."""
        if not isinstance(text, str):
            raise ConfigError(f"--lora-modules entries are NAME=PATH text, got {text!r}")
        if text.lstrip().startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--lora-modules: {text!r} is not valid JSON ({exc})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(
                    obj.get("path"), str):
                raise ConfigError(f"--lora-modules: {text!r} must be a JSON object with string fields name and path")
            name, path = obj["name"], obj["path"]
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ConfigError(f"--lora-modules: {text!r} is not NAME=PATH (e.g. sql-lora=/models/sql-adapter)")
        if not name.strip() or not path.strip():
            raise ConfigError(f"--lora-modules: {text!r} needs both a name and a path")
        return cls(name.strip(), path.strip())


@dataclass
class EngineConfig:
    """Every engine setting. CLI flag = field name with dashes; LLM(...) keyword = field name."""

    model: str | None = field(default=None, metadata=_flag(
        "Local Hugging Face checkpoint folder or hub id. Default: the small model shipped with Atlas."))
    tokenizer: str | None = field(default=None, metadata=_flag(
        "Tokenizer folder or hub id, if not the model's own."))
    revision: str | None = field(default=None, metadata=_flag("Hub revision (branch, tag or commit)."))
    tokenizer_revision: str | None = field(default=None, metadata=_flag(
        "Hub revision of --tokenizer (default: --revision).", metavar="REVISION"))
    tokenizer_mode: str = field(default="auto", metadata=_flag(
        "vLLM's flag: auto (or hf): the checkpoint's Hugging Face fast tokenizer and its chat template; "
        "deepseek_v32: DeepSeek-V3.2's chat format, which ships as code rather than a template "
        "(engine/chat_encodings.py; auto takes it for a deepseek_v32 checkpoint without a chat template). slow, "
        "mistral and custom are refused.", type=_tokenizer_mode, metavar="auto|hf|deepseek_v32"))
    trust_remote_code: bool = field(default=False, metadata=_flag(
        "Let the tokenizer run the checkpoint's own tokenizer code, as vLLM's flag does: a tokenizer_config.json "
        "whose auto_map names a class in the checkpoint (Kimi K2's tiktoken tokenizer). Atlas never runs a "
        "checkpoint's modeling code: each architecture is built in, and one it lacks is refused either way."))
    download_dir: str | None = field(default=None, metadata=_flag(
        "Hub cache folder for the model, tokenizer, drafter and LoRA adapters given as hub ids (huggingface_hub's "
        "cache_dir): downloads go there and are looked up there (with HF_HUB_OFFLINE=1, only there). Default: the "
        "Hugging Face cache (HF_HOME, HF_HUB_CACHE).", metavar="DIR"))
    hf_token: str | None = field(default=None, repr=False, metadata=_flag(
        "Hugging Face token for the hub ids of the model, tokenizer, drafter and adapters (vLLM's flag; default: "
        "HF_TOKEN or the token `hf auth login` stored).", metavar="TOKEN"))
    hf_overrides: dict[str, Any] | None = field(default=None, metadata=_flag(
        "Changes to the checkpoint's config.json (vLLM's flag), a JSON object: each key replaces the file's value, "
        "and an object given for a nested config (text_config) changes the keys it names there. rope_scaling (vLLM's "
        "--rope-scaling) also replaces the type and parameters of transformers 5's rope_parameters, keeping "
        "rope_theta; e.g. YaRN past a model's trained context: '{\"rope_scaling\": {\"rope_type\": \"yarn\", "
        "\"factor\": 4.0, \"original_max_position_embeddings\": 32768}}' with --max-model-len 131072 (a scaled "
        "RoPE's context is original_max_position_embeddings x factor).", metavar="JSON", type=json_object))
    skip_tokenizer_init: bool = field(default=False, metadata=_flag(
        "Load no tokenizer; prompts must then be token ids and outputs carry no text."))
    load_format: str = field(default="auto", metadata=_flag(
        "Where the weights come from. auto, safetensors: the checkpoint's .safetensors files. dummy: random values "
        "drawn on the device (config.json is all that is read), for measuring the speed and memory of a shape "
        "whose weights you do not have; outputs are meaningless.", choices=LOAD_FORMATS))
    dtype: str = field(default="auto", metadata=_flag(
        "Weight and activation dtype. auto: the checkpoint's dtype on CUDA, float32 on CPU (vLLM's half and float: "
        "float16 and float32).", choices=DTYPES, type=lambda v: DTYPE_ALIASES.get(v, v)))
    device: str = field(default="auto", metadata=_flag("auto picks cuda when available.", choices=DEVICES))
    seed: int = field(default=0, metadata=_flag("Seed for requests that do not set their own."))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "Context length (prompt + output), e.g. 4096, 4k (4,000) or 4K (4,096). Default: the model's "
        "max_position_embeddings.", aliases=("--max-seq-len",), type=human_int))
    block_size: int = field(default=16, metadata=_flag("Tokens per KV-cache page."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_flag(
        "Fraction of the GPU's memory Atlas may use in all (weights, activations, KV cache)."))
    kv_cache_memory: str | None = field(default=None, metadata=_flag(
        "KV-cache size (e.g. 4GiB). On a GPU it replaces --gpu-memory-utilization's share (the start refuses when "
        "the weights, activations and it do not fit the free memory); on CPU the default is 1GiB, capped at what "
        "max-num-seqs full sequences need.",
        metavar="SIZE", aliases=("--kv-cache-memory-bytes",)))
    num_gpu_blocks_override: int | None = field(default=None, metadata=_flag(
        "Use exactly this many KV pages instead of planning from memory."))
    quantization: str | None = field(default=None, metadata=_flag(
        "Quantize a floating-point checkpoint's weights at load (vLLM's flag). fp8: the linear layers of the Llama, "
        "Mistral, Qwen2 and Qwen3 families in float8_e4m3fn with a scale per output row (embedding and LM head "
        "stay), activations scaled as they come: half the bytes a decode step reads, at a small change in outputs. "
        "An FP8 checkpoint needs no flag: its own quantization_config says so.", aliases=("-q",),
        choices=QUANTIZATIONS))
    enable_lora: bool = field(default=False, metadata=_flag(
        "Serve LoRA adapters (PEFT's format: adapter_config.json + adapter_model.safetensors) beside the base model: "
        "a request names an adapter as its model (or LLM.generate's lora_request), and one batch mixes adapters and "
        "the base model. Llama, Mistral, Qwen2, Qwen3 and Gemma 3 models on their q/k/v/o and gate/up/down "
        "projections; Qwen3-MoE, Mixtral, GLM-4.5 and gpt-oss on their attention projections."))
    lora_modules: tuple[str, ...] = field(default=(), metadata=_flag(
        "Adapters to load at start (with --enable-lora), each NAME=PATH or vLLM's JSON form "
        "'{\"name\": ..., \"path\": ...}'; PATH a local folder or a hub id.", metavar="NAME=PATH", nargs="+"))
    max_loras: int | None = field(default=None, metadata=_flag(
        "Adapter slots on the device (with --enable-lora): the most adapters resident at once. Every step's "
        "projections compute all slots (their cost grows with slots x --max-lora-rank). Default: the number of "
        "--lora-modules, at least 1.", metavar="N"))
    max_lora_rank: int = field(default=16, metadata=_flag(
        "Largest adapter rank (r) the slots hold (with --enable-lora); an adapter of a higher rank is refused.",
        metavar="R"))
    kv_cache_dtype: str = field(default="auto", metadata=_flag(
        "Element type of the KV cache. auto: the model dtype (outputs as computed); fp8 (= fp8_e4m3): K and V (GQA) "
        "or the latent row (MLA: DeepSeek-V2/V3, LongCat-Flash; DeepSeek-V3.2 / GLM-5 with their indexer keys) "
        "rounded to 8-bit floats (unscaled, saturating at +-448): half the bytes a token, so twice the tokens in the "
        "pool, at a small change in outputs. Drafters keep their own caches in the model dtype. Refused for caches "
        "with no 8-bit path (DeepSeek-V4).",
        choices=KV_CACHE_DTYPES))
    split_kv: bool = field(default=True, metadata=_flag(
        "Split-KV decode attention on CUDA: for small decode batches the GQA, MLA and DSA kernels split each "
        "request's keys (DSA: each row's selected keys) over several programs (a faster batch-1 step; MLA's unsplit decode is up to 31x slower at long "
        "contexts). In bf16 a split decode row rounds otherwise than the same row of a verify step, so speculative "
        "outputs can part from plain decoding's where two logits nearly tie (float32 stays exact); --no-split-kv "
        "with --tuning gemv=0 puts every row through the same kernels."))
    max_num_seqs: int = field(default=256, metadata=_flag("Most sequences running at once."))
    max_num_seqs_per_request: int | None = field(default=None, metadata=_flag(
        "Fair slots: while other requests wait, the most of the --max-num-seqs slots that one request's sequences "
        "(its n samples over all of its prompts) hold; a newcomer takes a slot of a request above it at the next "
        "step (that sequence is recomputed later, its prompt from the prefix cache). Fair rows: while a request at "
        "or under its share runs or waits, one above it computes only this many of its sequences a step, in turn. "
        "With nobody else a request may use every slot. Default: half of --max-num-seqs (at least 1); "
        "--max-num-seqs turns the share off. --scheduling-policy fcfs only.", metavar="N"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_flag(
        "Token budget of one engine step (prefill chunks + decodes). Default 8192 on CUDA, 2048 on CPU."))
    long_prefill_token_threshold: int | None = field(default=None, metadata=_flag(
        "Fair budget: while another request waits, one prompt's chunk computes at most this many tokens of a step, "
        "so that a long prompt leaves the rest of the step's budget to the prompts behind it (vLLM's flag). "
        "Default: half of --max-num-batched-tokens; 0: no cap (a long prompt takes the whole budget of each step "
        "until it is done).", metavar="N"))
    enable_prefix_caching: bool = field(default=True, metadata=_flag(
        "Reuse the KV pages of identical prompt prefixes across requests."))
    state_snapshots: int | None = field(default=None, metadata=_flag(
        "Hybrid (linear-attention) models with prefix caching: recurrent-state snapshots kept for cached prefixes "
        "(each holds every linear-attention layer's state at the end of one cached page, as much memory as one "
        "running sequence's state; counted in the memory plan before the KV pages). Default: a quarter of "
        "--max-num-seqs (at least 1): shared system prompts and chat turns hit without doubling the state memory. "
        "0 turns prefix caching off for these models.", metavar="N"))
    enforce_eager: bool = field(default=False, metadata=_flag(
        "Never capture CUDA graphs; run every step eagerly."))
    async_scheduling: bool = field(default=True, metadata=_flag(
        "Schedule and prepare the next step while the device runs the current one (its decodes read their "
        "input tokens on the device). Steps that need the last tokens on the host (speculative decoding, "
        "penalties) wait for them either way."))
    speculative: str | None = field(default=None, metadata=_flag(
        "Speculative decoding method (one of them; outputs are unchanged): ngram (prompt lookup), dflash "
        "(block-diffusion drafter, needs --draft-model unless the model ships one), mtp (the model's own "
        "multi-token-prediction heads), draft_model (a smaller model with the same vocabulary, --draft-model), "
        "eagle3 (an EAGLE-3 drafter trained for the model, --draft-model).",
        choices=SPECULATIVE_METHODS))
    draft_model: str | None = field(default=None, metadata=_flag(
        "Drafter checkpoint folder or hub id for --speculative dflash, draft_model or eagle3."))
    num_draft_tokens: int | None = field(default=None, metadata=_flag(
        "Draft tokens verified per step (K). Default: 4 for ngram, the drafter's block size - 1 for dflash, 1 "
        "for mtp (its module chained K times), 4 for draft_model, 3 for eagle3."))
    speculative_token_map: str | None = field(default=None, metadata=_flag(
        "File of the token ids a DFlash drafter or an MTP module may propose (a .pt tensor or a .json list, e.g. a "
        "corpus's most frequent tokens, `atlas token-map`): its LM head then scores those rows only, which reads a "
        "fraction of the head's bytes a draft. Outputs are unchanged; drafts outside the list are never proposed.",
        metavar="PATH"))
    speculative_max_model_len: int | None = field(default=None, metadata=_flag(
        "--speculative mtp: the drafter attends over at most N positions (a drafter whose attention is capped, e.g. "
        "a DSA block trained to a shorter context): it is given the target's hidden states of positions below N "
        "only, the capture buffer shrinks to N rows, and a request whose context passes N decodes on without "
        "drafts. Outputs are unchanged. Default: no cap.", metavar="N"))
    ngram_min: int = field(default=2, metadata=_flag("Shortest n-gram that --speculative ngram matches."))
    ngram_max: int = field(default=4, metadata=_flag("Longest n-gram that --speculative ngram matches."))
    speculative_policy: str = field(default="adaptive", metadata=_flag(
        "When steps draft: adaptive (each step, only where the measured acceptance beats the measured cost of a "
        "verify step at that batch size; probes now and then while off) or always (every step drafts "
        "--num-draft-tokens). Outputs are the same either way.", choices=SPECULATIVE_POLICIES))
    num_cpu_threads: int | None = field(default=None, metadata=_flag(
        "Torch CPU threads when running on CPU. Default: the CPUs this process may use (affinity mask, cgroup "
        "CPU quota), not the machine's core count."))
    tensor_parallel_size: int = field(default=1, metadata=_flag(
        "GPUs (ranks) that each layer is split over: attention heads, MLP, experts, vocabulary. The engine starts "
        "its worker processes itself.", aliases=("-tp",)))
    enable_expert_parallel: bool = field(default=False, metadata=_flag(
        "With --tensor-parallel-size: each rank holds 1/N of the routed experts whole instead of 1/N of every "
        "expert (attention, dense MLPs and shared experts stay tensor-sharded; one all-reduce either way)."))
    pipeline_parallel_size: int = field(default=1, metadata=_flag(
        "Pipeline stages the layers are split into (for spanning machines); ranks = tensor x pipeline size.",
        aliases=("-pp",)))
    nnodes: int = field(default=1, metadata=_flag(
        "Machines the ranks span; run the same command on each with its --node-rank (0 serves)."))
    node_rank: int = field(default=0, metadata=_flag("This machine's index among --nnodes (0 = the driver's)."))
    master_addr: str | None = field(default=None, metadata=_flag(
        "Address of node 0 where the ranks meet (default MASTER_ADDR, else 127.0.0.1)."))
    master_port: int | None = field(default=None, metadata=_flag(
        "Port on node 0 where the ranks meet (default MASTER_PORT; one node: a free port)."))
    structured_outputs_backend: str = field(default="auto", metadata=_flag(
        "Grammar engine of structured outputs (JSON schema, regex, choice, grammar); every one enforces a "
        "constraint exactly or refuses it naming what it cannot do. llguidance: the most of JSON Schema. "
        "xgrammar: half the per-token host work, but only a checked subset of JSON Schema. auto: each JSON "
        "schema inside that subset to xgrammar, everything else to llguidance.",
        choices=STRUCTURED_OUTPUTS_BACKENDS, aliases=("--guided-decoding-backend",)))
    structured_outputs_compile_timeout: float = field(default=30.0, metadata=_flag(
        "Longest a constraint may take to compile; past it the request is refused with a 400 (the compile "
        "goes on in the background and its result is cached).", metavar="SECONDS"))
    structured_outputs_mask_threads: int | None = field(default=None, metadata=_flag(
        "Threads of the llguidance grammar engine that compute a step's token masks of its constrained "
        "sequences in parallel (default: a quarter of the CPUs this process may use, at most 8, none below 4 "
        "CPUs); 0: none, the engine's thread computes them one by one. xgrammar computes its masks on the "
        "engine's thread.",
        metavar="N"))
    structured_outputs_compile_memory: str | None = field(default="4GiB", metadata=_flag(
        "Each new constraint is first compiled in a worker process with this much memory (on top of what the "
        "worker holds after start-up) and --structured-outputs-compile-timeout; past either limit the worker is "
        "killed and the request gets a 400, so that no compile holds the engine's cores or memory. 0: compile "
        "in the engine's threads only.", metavar="SIZE"))
    structured_outputs_cache_memory: str = field(default="512MiB", metadata=_flag(
        "Bound on the memory of the cache of compiled constraints (at most 256 of them besides), least recently "
        "used out first: each grammar counted as xgrammar reports it, or estimated from the constraint's size for "
        "llguidance. A grammar larger than the bound serves its own request and is not kept; an evicted one is "
        "compiled again when next asked for.", metavar="SIZE"))
    scheduling_policy: str = field(default="fcfs", metadata=_flag(
        "fcfs: first come, first served (with a fair share of sequence slots per request, "
        "--max-num-seqs-per-request). priority: requests "
        "with a lower `priority` value run first (ties by arrival); one waiting ahead of a running one of lower "
        "priority takes its slot or its pages (vLLM's policy).", choices=("fcfs", "priority")))
    runner: str = field(default="generate", metadata=_flag(
        "generate: text generation. pooling: an embedding engine (vLLM's flag): each request's prompt is computed "
        "(chunked and batched as usual) and pooled into one vector as the checkpoint's sentence-transformers files "
        "say (modules.json, 1_Pooling/config.json; without them the last token, L2-normalized), served by POST "
        "/v1/embeddings and LLM.embed; nothing is generated. vLLM's older --task embed is an alias.",
        choices=RUNNERS))
    chat_template: str | None = field(default=None, metadata=_flag(
        "Chat template to use instead of the tokenizer's: a .jinja file's path, or the template text (as vLLM's "
        "flag).", metavar="PATH|TEMPLATE"))
    generation_config: str = field(default="auto", metadata=_flag(
        "Sampling defaults for requests that leave them out (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens): auto = the model's generation_config.json, as vLLM; vllm = none "
        "(temperature 1.0); or a folder or file with a generation_config.json.", metavar="auto|vllm|PATH"))
    override_generation_config: dict[str, Any] | None = field(default=None, metadata=_flag(
        "Sampling defaults added to or changed from what --generation-config gives (vLLM's flag): a JSON object of "
        "generation_config.json keys, e.g. '{\"temperature\": 0.6, \"top_p\": 0.95}'. With --generation-config "
        "vllm, these alone.", metavar="JSON", type=json_object))
    max_logprobs: int = field(default=DEFAULT_MAX_LOGPROBS, metadata=_flag(
        "Most logprobs a request may ask for per token (logprobs, top_logprobs, prompt_logprobs; a beam search's "
        "width is at most half of it); -1: up to the vocabulary.", metavar="N"))
    logprobs_mode: str = field(default="raw_logprobs", metadata=_flag(
        "What sampled tokens' logprobs are (vLLM's flag): raw_logprobs, the model's distribution; raw_logits, its "
        "logits; processed_logprobs / processed_logits, those of the distribution the token was drawn from (after "
        "logit bias, allowed and banned tokens, penalties and grammar masks, then, for a sampled row, temperature "
        "and min-p / top-k / top-p, filtered tokens -inf), as for importance weights in RL. Prompt logprobs stay "
        "raw_logprobs; beam search needs raw_logprobs.", choices=LOGPROBS_MODES))
    distributed_timeout: float = field(default=300.0, metadata=_flag(
        "Seconds after which a rank that stopped responding or did not finish a step ends the engine with an "
        "error naming it.", metavar="SECONDS"))
    tuning: TuningConfig = field(default=TuningConfig(), metadata=_flag(
        "Tuning knobs, KEY=VALUE[,KEY=VALUE...] or a JSON object (repeatable): which kernel or code path runs, "
        "never what a request computes beyond rounding; the defaults are the measured best (README, Tuning "
        f"knobs). Knobs: {', '.join(TuningConfig.knob_names())}.", metavar="KEY=VALUE,..."))

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if isinstance(self.tuning, (str, dict)):
            self.tuning = TuningConfig.parse(self.tuning)
        for name in ("hf_overrides", "override_generation_config"):
            if getattr(self, name) is not None:
                setattr(self, name, json_object(getattr(self, name), "--" + name.replace("_", "-")))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        _check_choice("--dtype", self.dtype, DTYPES)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)} (or left out), got "
                              f"{self.quantization!r}")
        _check_choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("--load-format", self.load_format, LOAD_FORMATS)
        _check_choice("--structured-outputs-backend", self.structured_outputs_backend, STRUCTURED_OUTPUTS_BACKENDS)
        if not (isinstance(self.structured_outputs_compile_timeout, (int, float))
                and self.structured_outputs_compile_timeout > 0):
            raise ConfigError("--structured-outputs-compile-timeout must be a positive number of seconds, got "
                              f"{self.structured_outputs_compile_timeout!r}")
        if self.structured_outputs_mask_threads is not None and not (
                isinstance(self.structured_outputs_mask_threads, int) and self.structured_outputs_mask_threads >= 0):
            raise ConfigError("--structured-outputs-mask-threads must be a whole number of at least 0, got "
                              f"{self.structured_outputs_mask_threads!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        _check_choice("--device", self.device, DEVICES)
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size > 256 or (
            self.block_size & (self.block_size - 1)
        ):
            raise ConfigError(f"--block-size must be a power of two between 1 and 256, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        parse_memory_size(self.kv_cache_memory, "kv_cache_memory")
        _ = self.compile_memory_bytes  # (validated)
        _ = self.grammar_cache_bytes
        for name in ("max_model_len", "num_gpu_blocks_override", "max_num_batched_tokens", "num_cpu_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.state_snapshots is not None and (not isinstance(self.state_snapshots, int) or self.state_snapshots < 0):
            raise ConfigError(f"--state-snapshots must be a non-negative integer, got {self.state_snapshots!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ConfigError(f"--max-logprobs must be an integer >= 0, or -1 for the whole vocabulary, "
                              f"got {self.max_logprobs!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be a positive integer, got {self.max_num_seqs!r}")
        share = self.max_num_seqs_per_request
        if share is not None and (not isinstance(share, int) or isinstance(share, bool)
                                  or not 1 <= share <= self.max_num_seqs):
            raise ConfigError(f"--max-num-seqs-per-request must be a whole number from 1 to --max-num-seqs "
                              f"({self.max_num_seqs}), got {share!r}; raise --max-num-seqs or lower it")
        cap = self.long_prefill_token_threshold
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ConfigError(f"--long-prefill-token-threshold must be a whole number, 0 or more (0: no cap), "
                              f"got {cap!r}")
        if not isinstance(self.tuning, TuningConfig):
            raise ConfigError(f"tuning must be a TuningConfig, a dict of knobs or KEY=VALUE text, got {self.tuning!r}")
        _check_choice("--logprobs-mode", self.logprobs_mode, LOGPROBS_MODES)
        _check_choice("--tokenizer-mode", self.tokenizer_mode, TOKENIZER_MODES)
        _check_choice("--runner", self.runner, RUNNERS)
        if self.runner == "pooling" and self.speculative is not None:
            raise ConfigError("--runner pooling computes embeddings and generates nothing: it takes no --speculative")
        if self.runner == "pooling" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("--runner pooling runs on one device: drop --tensor-parallel-size / "
                              "--pipeline-parallel-size")
        self._validate_speculative()
        self._validate_parallel()
        self._validate_lora()

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            for name in ("lora_modules", "max_loras"):
                if getattr(self, name):
                    raise ConfigError(f"--{name.replace('_', '-')} needs --enable-lora")
            return
        modules = self.lora_adapters  # (reads each entry: a malformed one is refused here)
        names = [m.name for m in modules]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"--lora-modules: the name {repeated[0]!r} is given twice")
        if not isinstance(self.max_lora_rank, int) or isinstance(self.max_lora_rank, bool) or self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be a positive integer, got {self.max_lora_rank!r}")
        slots = self.max_loras
        if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
            raise ConfigError(f"--max-loras must be a positive integer, got {slots!r}")
        if slots is not None and slots < len(modules):
            raise ConfigError(f"--max-loras {slots} holds fewer adapters than the {len(modules)} --lora-modules "
                              "loaded at start: raise it or give fewer")
        if self.pipeline_parallel_size > 1:
            raise ConfigError("--enable-lora runs without pipeline parallelism: drop --pipeline-parallel-size "
                              "(tensor parallelism takes adapters)")
        if self.runner == "pooling":
            raise ConfigError("--enable-lora serves generation: --runner pooling takes no adapters")

    @property
    def lora_adapters(self) -> list[LoraModule]:
        """--lora-modules as (name, path) entries."""
        return [LoraModule.parse(text) for text in self.lora_modules]

    @property
    def lora_slots(self) -> int:
        """Adapter slots on the device (--max-loras, default the --lora-modules' count, at least 1)."""
        return self.max_loras or max(1, len(self.lora_modules))

    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank!r}")
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if ranks % self.nnodes:
            raise ConfigError(f"{ranks} ranks (--tensor-parallel-size x --pipeline-parallel-size) do not split "
                              f"evenly over --nnodes {self.nnodes}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port must be a TCP port, got {self.master_port}")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ConfigError("--enable-expert-parallel spreads the experts over the tensor-parallel ranks: it needs "
                              "--tensor-parallel-size 2 or more")
        if not self.distributed_timeout > 0:
            raise ConfigError(f"--distributed-timeout must be positive, got {self.distributed_timeout}")

    def _validate_speculative(self) -> None:
        _check_choice("--speculative-policy", self.speculative_policy, SPECULATIVE_POLICIES)
        if self.speculative is None:
            for name in ("num_draft_tokens", "speculative_max_model_len", *DFLASH_ONLY_OPTIONS):
                if getattr(self, name) is not None:
                    raise ConfigError(f"--{name.replace('_', '-')} needs --speculative (ngram, dflash or mtp)")
            return
        _check_choice("--speculative", self.speculative, SPECULATIVE_METHODS)
        for name in DFLASH_ONLY_OPTIONS:
            takers = ("dflash", *OPTION_ALSO_FOR.get(name, ()))
            if getattr(self, name) is not None and self.speculative not in takers:
                raise ConfigError(f"--{name.replace('_', '-')} is for --speculative {' or '.join(takers)}, "
                                  f"not {self.speculative}")
        cap = self.speculative_max_model_len
        if cap is not None:
            if self.speculative != "mtp":
                raise ConfigError(f"--speculative-max-model-len caps an MTP drafter's context (--speculative mtp); "
                                  f"--speculative {self.speculative} takes no cap")
            if not isinstance(cap, int) or cap < 2:
                raise ConfigError(f"--speculative-max-model-len must be an integer >= 2 (positions the drafter "
                                  f"attends over), got {cap!r}")
        k = self.num_draft_tokens
        if k is not None and (not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS):
            raise ConfigError(f"--num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"--ngram-min ({self.ngram_min}) must be >= 1 and <= --ngram-max ({self.ngram_max})")

    @property
    def kv_cache_bytes(self) -> int | None:
        return parse_memory_size(self.kv_cache_memory, "kv_cache_memory")

    @property
    def seqs_per_request(self) -> int:
        """--max-num-seqs-per-request, its default resolved: half of --max-num-seqs, at least 1."""
        if self.max_num_seqs_per_request is not None:
            return self.max_num_seqs_per_request
        return max(1, self.max_num_seqs // 2)

    def prompt_chunk_cap(self, step_tokens: int) -> int | None:
        """--long-prefill-token-threshold for a step budget of step_tokens, its default resolved (half the budget,
        at least 1); None: no cap."""
        cap = self.long_prefill_token_threshold
        if cap is None:
            return max(1, step_tokens // 2)
        return cap or None

    @property
    def grammar_cache_bytes(self) -> int:
        """--structured-outputs-cache-memory in bytes."""
        value = self.structured_outputs_cache_memory
        if value in (None, 0, "0"):
            raise ConfigError("--structured-outputs-cache-memory must be a positive size, e.g. 512MiB (a grammar "
                              f"larger than it is still used by its request, only not kept), got {value!r}")
        return parse_memory_size(value, "structured_outputs_cache_memory")

    @property
    def compile_memory_bytes(self) -> int | None:
        """--structured-outputs-compile-memory in bytes; None: 0 (compiles in the engine's threads only)."""
        value = self.structured_outputs_compile_memory
        if value in (None, 0, "0"):
            return None
        return parse_memory_size(value, "structured_outputs_compile_memory")

    @property
    def hub(self) -> HubAccess:
        """--download-dir and --hf-token, as hub downloads take them."""
        return HubAccess(self.download_dir, self.hf_token)

    @property
    def dummy_weights(self) -> bool:
        """--load-format dummy: every model (target, drafter, MTP module) draws its weights, reading no file."""
        return self.load_format == "dummy"

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from LLM(...) keywords; `max_seq_len` is accepted as an alias of `max_model_len`."""
        if "max_seq_len" in kwargs:
            alias = kwargs.pop("max_seq_len")
            if kwargs.get("max_model_len") not in (None, alias):
                raise ConfigError("max_seq_len is an alias of max_model_len: give only one of them")
            kwargs["max_model_len"] = alias
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown engine argument(s): {', '.join(unknown)}. Valid ones: {', '.join(cls.field_names())}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            meta = f.metadata
            names = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta.get("help")}
            if f.name == "tuning":
                kwargs.update(action=_TuningAction, metavar=meta["metavar"])
            elif meta.get("type") is json_object:
                kwargs.update(action=_JsonObjectAction, metavar=meta["metavar"])
            elif f.type in ("bool", bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = meta.get("type") or {"int | None": int, "int": int, "float": float}.get(str(f.type), str)
                if meta.get("choices"):
                    kwargs["choices"] = meta["choices"]
                if meta.get("metavar"):
                    kwargs["metavar"] = meta["metavar"]
                if meta.get("nargs"):
                    kwargs["nargs"] = meta["nargs"]
            group.add_argument(*names, **kwargs)
        group.add_argument("--task", dest="runner", type=_task_runner, metavar="embed|generate", default=argparse.SUPPRESS,
                           help="vLLM's older form of --runner: --task embed = --runner pooling")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{name: getattr(args, name) for name in cls.field_names()})


# ---------------------------------------------------------------------------------- model config
@dataclass
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn | dynamic (not supported)
    params: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0


@dataclass
class ModelConfig:
    """The fields of a Hugging Face config.json that the engine relies on, checked and typed.

    Family-specific fields stay in `raw`; model files read them from there.
    """

    path: Path
    raw: dict[str, Any]
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    torch_dtype: str | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    # A causal LM read as a sequence classifier (classifier_from_tokens): its tokens' ids, resolved by the engine
    # through the tokenizer before the model loads.
    classifier_token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path) -> ModelConfig:
        where = path / "config.json"

        def need(key: str, kind: type = int) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelLoadError(f"malformed checkpoint: {where} has no '{key}' field")
            value = raw[key]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ModelLoadError(f"malformed checkpoint: {where} field '{key}' must be a positive integer, "
                                     f"got {value!r}")
            if kind is float and not isinstance(value, (int, float)):
                raise ModelLoadError(f"malformed checkpoint: {where} field '{key}' must be a number, got {value!r}")
            return value

        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not archs:
            raise ModelLoadError(f"malformed checkpoint: {where} has no 'architectures' list")
        text = raw.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in raw:
            # A vision-language checkpoint (e.g. Qwen3_5ForConditionalGeneration): the language model's fields, with
            # the top level's architectures, tie_word_embeddings and anything the text config lacks (e.g. a
            # quantization_config). The original is kept under "vlm_config".
            top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
            raw = {**top, **_with_class_defaults(text, where), "architectures": archs, "vlm_config": raw}
            if "tie_word_embeddings" in top:
                raw["tie_word_embeddings"] = top["tie_word_embeddings"]
        # A config that names a field by an alias its transformers class maps (num_layers: decoder layers;
        # ffn_hidden_size) is read under the common name; raw keeps both.
        for common, alias in (("num_hidden_layers", "num_layers"), ("intermediate_size", "ffn_hidden_size")):
            if raw.get(common) is None and raw.get(alias) is not None:
                raw = {**raw, common: raw[alias]}
        if raw.get("num_hidden_layers") is None:  # (Nemotron-H's transformers class derives it from its layer list)
            layers = raw.get("layers_block_type") or raw.get("hybrid_override_pattern")
            if isinstance(layers, (list, str)) and layers:
                raw = {**raw, "num_hidden_layers": len(layers)}
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelLoadError(f"malformed checkpoint: num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv_heads}) in {where}")
        head_dim = raw.get("head_dim") or hidden // heads
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            path=path,
            raw=raw,
            architecture=archs[0],
            model_type=raw.get("model_type", ""),
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            # (MoE-only configs such as Qwen3.5-MoE's have none: the shared expert's width stands in; it only sizes
            #  activation estimates)
            # (and DeepSeek-V4's only width is moe_intermediate_size, which its transformers class reads as this)
            intermediate_size=(need("intermediate_size") if "intermediate_size" in raw
                               else need("shared_expert_intermediate_size") if "shared_expert_intermediate_size" in raw
                               else need("moe_intermediate_size") if "moe_intermediate_size" in raw
                               else need("intermediate_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings") or 2048,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=_parse_rope(raw),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )

    @classmethod
    def from_path(cls, path: Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """path/config.json, with --hf-overrides' changes when given."""
        raw = read_config_json(path, "--model", "a Hugging Face checkpoint", "checkpoint")
        return cls.from_dict(override_config(raw, overrides) if overrides else raw, path)

    @property
    def classifier_labels(self) -> tuple[str, ...] | None:
        """A sequence-classification checkpoint's (*ForSequenceClassification: a `score` head over the last token)
        class labels, in order (id2label, else LABEL_i for num_labels, as transformers names them); None for
        other checkpoints."""
        if not self.architecture.endswith("ForSequenceClassification"):
            return None
        converted = self.classifier_from_tokens
        if converted is not None:  # (vLLM's: one label for a 2-way softmax, else one a token, named LABEL_i)
            method, tokens = converted
            return tuple(f"LABEL_{i}" for i in range(1 if method == "from_2_way_softmax" else len(tokens)))
        id2label = self.raw.get("id2label")
        if isinstance(id2label, dict) and id2label:
            try:
                ordered = sorted((int(k), str(v)) for k, v in id2label.items())
            except ValueError:
                raise ModelLoadError(f"malformed checkpoint: {self.path / 'config.json'} id2label keys must be "
                                     "class indices") from None
            if [i for i, _ in ordered] != list(range(len(ordered))):
                raise ModelLoadError(f"malformed checkpoint: {self.path / 'config.json'} id2label must number the "
                                     "classes 0, 1, ...")
            return tuple(label for _, label in ordered)
        n = self.raw.get("num_labels", 2)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ModelLoadError(f"malformed checkpoint: {self.path / 'config.json'} num_labels must be a positive "
                                 f"integer, got {n!r}")
        return tuple(f"LABEL_{i}" for i in range(n))

    @property
    def classifier_from_tokens(self) -> tuple[str, list[str | int]] | None:
        """vLLM's reading of a causal LM's checkpoint as a sequence classifier (config.json or --hf-overrides:
        `classifier_from_token` with `method`, on a *ForSequenceClassification architecture): (method, tokens), or
        None. from_2_way_softmax: two tokens ("no", "yes"), one label whose logit is the second's LM-head logit minus
        the first's (the log-odds of a softmax over the two); `is_original_qwen3_reranker: true` asks for it (the
        Qwen3-Reranker checkpoints). no_post_processing: a label per token, its LM-head row. A token is a string of
        the tokenizer's vocabulary or an id."""
        tokens = self.raw.get("classifier_from_token")
        if tokens is None and not self.raw.get("is_original_qwen3_reranker"):
            return None  # (a `method` key alone belongs to something else)
        method = self.raw.get("method") or ("from_2_way_softmax" if self.raw.get("is_original_qwen3_reranker")
                                            else None)
        where = self.path / "config.json"
        if not self.architecture.endswith("ForSequenceClassification"):
            raise ModelLoadError(f"{where}: classifier_from_token reads a causal LM as a sequence classifier, so the "
                                 "architecture must be one too: add \"architectures\": [\"Qwen3ForSequenceClassification\"] "
                                 "(or the family's) to --hf-overrides")
        if method not in ("from_2_way_softmax", "no_post_processing"):
            raise ModelLoadError(f"{where}: method {method!r} for classifier_from_token is not one Atlas implements "
                                 "(from_2_way_softmax, no_post_processing; is_original_qwen3_reranker: true means "
                                 "the first)")
        if (not isinstance(tokens, list) or not tokens
                or not all(isinstance(t, (str, int)) and not isinstance(t, bool) for t in tokens)):
            raise ModelLoadError(f"{where}: classifier_from_token must be a non-empty list of tokens (strings of "
                                 f"the vocabulary, or ids), got {tokens!r}")
        if method == "from_2_way_softmax" and len(tokens) != 2:
            raise ModelLoadError(f"{where}: from_2_way_softmax reads two tokens (e.g. [\"no\", \"yes\"]), got "
                                 f"{len(tokens)}")
        return method, list(tokens)

    @property
    def context_limit(self) -> int:
        """The longest context the checkpoint allows: max_position_embeddings, or a scaled RoPE's reach where it is
        longer (YaRN: original_max_position_embeddings x factor; linear and dynamic: max_position_embeddings x
        factor; as vLLM derives it; llama3 and longrope configs give their extended length as is)."""
        params, limit = self.rope.params, self.max_position_embeddings
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 1:
            return limit
        if self.rope.rope_type == "yarn":
            return max(limit, int((params.get("original_max_position_embeddings") or limit) * factor))
        if self.rope.rope_type in ("linear", "dynamic"):
            return int(limit * factor)
        return limit


# rope_parameters keys that are not the scaling's (kept when --hf-overrides replaces the scaling)
_ROPE_BASE_KEYS = ("rope_theta", "partial_rotary_factor")
_GLOBAL_LAYERS = "full_attention"


def override_config(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json's dict with --hf-overrides' changes (a new dict): a key's value replaced, an object for a nested
    config (a dict-valued key ending in _config) applied inside it; rope_scaling and rope_theta also where
    transformers 5 keeps them (rope_parameters), which the reader prefers, so that neither is silently ignored."""
    out = dict(raw)
    for key, value in overrides.items():
        if key.endswith("_config") and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = override_config(out[key], value)
            continue
        out[key] = value
        params = out.get("rope_parameters")
        if key not in ("rope_scaling", "rope_theta") or not isinstance(params, dict) or "rope_parameters" in overrides:
            continue
        # (Gemma 3 / 4 key rope_parameters by layer type; rope_scaling and rope_theta are the global layers')
        nested = params and all(isinstance(v, dict) for v in params.values())
        if nested and _GLOBAL_LAYERS not in params:
            continue
        rope = params[_GLOBAL_LAYERS] if nested else params
        if key == "rope_scaling":
            rope = {**{k: rope[k] for k in _ROPE_BASE_KEYS if k in rope}, **(value or {"rope_type": "default"})}
        else:
            rope = {**rope, "rope_theta": value}
        out["rope_parameters"] = {**params, _GLOBAL_LAYERS: rope} if nested else rope
    return out


def config_fields(raw: dict[str, Any], where: Path, kind: str
                  ) -> tuple[Callable[[Any, str], int], Callable[[str], int]]:
    """Readers of a drafter's config.json fields that must be positive integers: (positive_int(value, key),
    need(key)); a bad or missing field is a ModelLoadError naming the file, the field and the `kind` of checkpoint."""

    def positive_int(value: Any, key: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"malformed {kind}: {where} field '{key}' must be a positive integer, got {value!r}")
        return value

    def need(key: str) -> int:
        if raw.get(key) is None:
            raise ModelLoadError(f"malformed {kind}: {where} has no '{key}' field")
        return positive_int(raw[key], key)

    return positive_int, need


# The fields every decoder's config gives; a vision-language checkpoint's text_config may leave them to its
# transformers class's defaults (Gemma 3's published image-text configs give only the sizes that differ).
_DECODER_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _with_class_defaults(text: dict[str, Any], where: Path) -> dict[str, Any]:
    """A text_config that leaves out some of _DECODER_FIELDS, as its transformers config class reads it (the
    defaults filled in, derived fields such as layer_types and rope_parameters made from the given ones); a
    complete one as it is."""
    if all(key in text for key in _DECODER_FIELDS):
        return text
    model_type = text.get("model_type")
    try:
        from transformers import AutoConfig

        filled = AutoConfig.for_model(model_type, **{k: v for k, v in text.items() if k != "model_type"}).to_dict()
    except Exception as exc:  # (an unknown model_type, or fields its class rejects)
        missing = [key for key in _DECODER_FIELDS if key not in text]
        raise ModelLoadError(f"malformed checkpoint: the text_config of {where} has no {', '.join(missing)}, and "
                             f"transformers cannot fill them in for model_type {model_type!r} ({exc})") from exc
    return {**{k: v for k, v in text.items() if k not in filled}, **filled}


def read_config_json(path: Path, flag: str, kind: str, malformed: str) -> dict[str, Any]:
    """The JSON object in path/config.json, or a ModelLoadError naming the flag to fix."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: point {flag} at {kind} folder")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"malformed {malformed}: {config_file} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"malformed {malformed}: {config_file} must hold a JSON object")
    return raw


def rope_of_layer_type(raw: dict[str, Any], layer_type: str) -> RopeConfig:
    """The RoPE of one layer type where config.json's rope_parameters holds one set a type (OLMo 3's
    {"sliding_attention": {...}, "full_attention": {...}})."""
    params = (raw.get("rope_parameters") or {}).get(layer_type)
    if not isinstance(params, dict):
        raise ModelLoadError(f"malformed checkpoint: config.json's rope_parameters has no object for {layer_type!r}")
    return _parse_rope({**{k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")},
                        "rope_parameters": params})


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings in both the transformers<5 form (rope_theta + rope_scaling) and the
    transformers>=5 form (rope_parameters holding rope_theta)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if scaling:
        params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su":
        rope_type = "longrope"  # (the early Phi-3 configs' name for it)
    if rope_type == "mrope":
        # (Qwen2-VL's older form: multimodal RoPE, which over text positions is plain RoPE, as transformers 5 reads
        #  it; its mrope_section stays in params)
        rope_type = "default"
    if rope_type in ("yarn", "llama3", "longrope") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = raw.get(
            "original_max_position_embeddings", raw.get("max_position_embeddings"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=params, partial_rotary_factor=float(partial))
