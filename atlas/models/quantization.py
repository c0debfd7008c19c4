"""Quantized checkpoints: block-scaled FP8 loaded by dequantizing, everything else refused before a weight is read.

Loading an FP8 / AWQ / GPTQ / ... checkpoint as if its tensors were plain weights (FP8 values copied unscaled,
scales ignored) runs without an error and generates wrong tokens, so every checkpoint Atlas loads (a target of any
family, a DFlash drafter) is checked here first. The one layout Atlas loads is block-scaled FP8 with dynamic
activations (DeepSeek-V3, Qwen -FP8: float8_e4m3fn weights, a float32 `weight_scale_inv` per block), and only
for targets: models whose class keeps FP8 linear layers (`supports_fp8_linear`: the Llama families, Qwen3-MoE,
Mixtral, GLM-4.5, DeepSeek-V2 / V3) keep them in FP8 (layers/linear.py, kernels/fp8_linear.py); `dequantize_fp8` turns the other weights and their
scales into the model's dtype as they load (exact: the checkpoint's own values): every weight of the other families,
and the layers the FP8 ones keep in their dtype (`CausalLM.keeps_fp8`: DeepSeek's kv_b_proj, the routers, the routed
experts only where they cannot stay FP8 (layers/moe.py: static activation scales, or a tensor-parallel slice that
cuts the scale blocks)), and an MTP module read from an FP8 checkpoint (speculative/mtp.py).

- `refuse_quantized(raw, path, what, dequantizes)`: config.json's `quantization_config` (or compressed-tensors'
  older `compression_config`), or a quantizer's own config file beside it (AutoGPTQ's
  quantize_config.json, AutoAWQ's quant_config.json, ModelOpt's hf_quant_config.json). Any other method is
  refused, known or not.
- `refuse_gguf(path)`: a folder (or file) of GGUF weights.
- Tensor by tensor, for checkpoints whose config says nothing (`load_named_weights` in models/base.py):
  `refuse_quantized_tensor(name, where)` for the names quantizers give their scales, zero points and
  packed weights, and `quantized_dtype(tensor)` for a float8 or integer tensor offered to a
  floating-point parameter.

Called from `build_model` (models/loader.py: every target, first thing; an MTP module is read from the
target's own checkpoint, so that covers it), `DFlashConfig.from_dict` (a drafter's config.json) and
`resolve_model_path` / `safetensors_files` (GGUF).

MXFP4 expert weights (quant_method mxfp4, gpt-oss's published layout) load for architectures whose class says
`loads_mxfp4_experts` (GptOssForCausalLM): kept as MXFP4 by its experts where layers/moe.mxfp4_unusable allows
(models/gpt_oss.py), else dequantized as they load (kernels/mxfp4.dequantize_mxfp4: exact, the FP4 values times their
power-of-two scales; memory and speed are those of the dequantized model). Every other architecture refuses
them as any other method.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.kernels.fp8_linear import dequantize_block_fp8
from atlas.kernels.mxfp4 import FP4_E2M1_VALUES, MXFP4_BLOCK, check_mxfp4, dequantize_mxfp4  # noqa: F401 (the loaders')
from atlas.layers.linear import Fp8Scheme, checkpoint_dtype

SUPPORTED = ("unquantized float32, float16 or bfloat16 safetensors, and (as a model to serve, not a drafter) FP8 "
             "weights: block-scaled with dynamic activation scales (quant_method fp8 with weight_block_size, the "
             "DeepSeek-V3 / Qwen -FP8 layout), per-tensor (quant_method fp8, static or dynamic activations; ModelOpt "
             "FP8) and per-channel (fbgemm_fp8), and compressed-tensors float8 weights (tensor, channel or block "
             "strategy)")
FIX = "Use a bf16 checkpoint of the same model (the one it was quantized from)"

# config.json keys that mean "the weights are quantized".
_CONFIG_KEYS = ("quantization_config", "compression_config")
# A quantizer's own config file beside config.json -> the method it means when the file does not say.
_SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq", "hf_quant_config.json": "modelopt"}

# What vLLM users know each quant_method as (any other method is refused too, by its own name).
_METHODS = {
    "fp8": "FP8 weights",
    "fbgemm_fp8": "FP8 weights with per-channel scales (FBGEMM)",
    "ptpc_fp8": "FP8 weights with per-channel scales",
    "awq": "AWQ 4-bit integer weights",
    "awq_marlin": "AWQ 4-bit integer weights (Marlin kernels)",
    "gptq": "GPTQ integer weights",
    "gptq_marlin": "GPTQ integer weights (Marlin kernels)",
    "gptq_marlin_24": "GPTQ 2:4 sparse integer weights",
    "marlin": "Marlin integer weights",
    "gptq_bitblas": "GPTQ integer weights (BitBLAS)",
    "bitblas": "BitBLAS integer weights",
    "exl2": "EXL2 (exllamav2) integer weights",
    "bitsandbytes": "bitsandbytes 4-/8-bit weights",
    "compressed-tensors": "compressed-tensors (llm-compressor) weights",
    "compressed_tensors": "compressed-tensors (llm-compressor) weights",
    "sparseml": "SparseML compressed weights",
    "modelopt": "NVIDIA ModelOpt quantized weights",
    "modelopt_fp4": "NVIDIA ModelOpt NVFP4 weights",
    "nvfp4": "NVFP4 weights",
    "mxfp4": "MXFP4 weights",
    "mxfp8": "MXFP8 weights",
    "gguf": "GGUF weights",
    "hqq": "HQQ integer weights",
    "eetq": "EETQ int8 weights",
    "quark": "AMD Quark quantized weights",
    "torchao": "torchao quantized weights",
    "experts_int8": "int8 expert weights",
    "aqlm": "AQLM codebook weights",
    "quanto": "optimum-quanto quantized weights",
    "higgs": "HIGGS quantized weights",
    "vptq": "VPTQ codebook weights",
    "spqr": "SpQR weights",
    "fp_quant": "FP-Quant weights",
    "auto-round": "AutoRound integer weights",
    "inc": "Intel Neural Compressor weights",
    "bitnet": "BitNet ternary weights",
    "deepspeedfp": "DeepSpeed FP6/FP8 weights",
    "tpu_int8": "int8 weights",
}


def _detail(q: Mapping[str, Any]) -> list[str]:
    """The facts of a quantization config worth a line: block size, bits, group size, format ..."""
    out: list[str] = []
    if q.get("weight_block_size"):
        out.append(f"block {q['weight_block_size']}")
    bits = q.get("bits", q.get("w_bit", q.get("nbits")))
    if bits is not None:
        out.append(f"{bits}-bit")
    if q.get("load_in_4bit"):
        out.append("4-bit")
    if q.get("load_in_8bit"):
        out.append("8-bit")
    if q.get("bnb_4bit_quant_type"):
        out.append(str(q["bnb_4bit_quant_type"]))
    group = q.get("group_size", q.get("q_group_size"))
    if group is not None:
        out.append(f"group size {group}")
    for key in ("fmt", "format", "quant_algo", "quant_type", "activation_scheme"):
        if q.get(key):
            out.append(f"{key.replace('_', ' ')} {q[key]}")
    inner = q.get("quantization")  # ModelOpt's hf_quant_config.json
    if isinstance(inner, Mapping) and inner.get("quant_algo"):
        out.append(f"quant algo {inner['quant_algo']}")
    groups = q.get("config_groups")  # compressed-tensors: the weights' scheme of each group
    if isinstance(groups, Mapping):
        for group_cfg in groups.values():
            w = group_cfg.get("weights") if isinstance(group_cfg, Mapping) else None
            if isinstance(w, Mapping):
                what = " ".join(str(w[k]) for k in ("type", "num_bits") if w.get(k) is not None)
                out.append(f"weights {what}{'-bit' if w.get('num_bits') is not None else ''}"
                           f"{', ' + str(w['strategy']) if w.get('strategy') else ''}")
                break
    return out


def _method(q: Any, default: str) -> str:
    if isinstance(q, str):
        return q
    if isinstance(q, Mapping):
        for key in ("quant_method", "method"):
            if isinstance(q.get(key), str) and q[key]:
                return q[key]
    return default


def describe(q: Any, default: str = "no quant_method") -> str:
    """'fp8, block [128, 128]', 'awq, 4-bit, group size 128': the method and its facts (for messages)."""
    method = _method(q, default)
    known = _METHODS.get(method.lower())
    facts = _detail(q) if isinstance(q, Mapping) else []
    return ", ".join([method, *facts]) + f": {known or 'a method Atlas does not know'}"


def _refusal(what: str, path: Path, description: str, source: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{what} {path} is quantized ({description}; {source}): Atlas does not implement this quantization "
        f"yet, and loading the weights as plain ones would generate wrong tokens. It loads {SUPPORTED}. {FIX}")


# quant_method fp8's `fmt` names of the one format Atlas reads: DeepSeek's "e4m3", MiniMax-M2's "float8_e4m3fn"
_E4M3 = ("e4m3", "float8_e4m3fn")


def fp8_block_size(raw: Mapping[str, Any]) -> tuple[int, int] | None:
    """(rows, columns) of the scale blocks when config.json says block-scaled FP8 weights with dynamic activations
    (the DeepSeek-V3 / Qwen -FP8 layout: float8_e4m3fn weights, a float32 `weight_scale_inv` per block), which
    Atlas loads by dequantizing (`dequantize_fp8_blocks`); None for anything else."""
    q = raw.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return None
    if q.get("activation_scheme", "dynamic") != "dynamic" or q.get("fmt", "e4m3") not in _E4M3:
        return None
    return block[0], block[1]


def _modelopt_algo(q: Mapping[str, Any]) -> str | None:
    inner = q.get("quantization")
    algo = q.get("quant_algo") or (inner.get("quant_algo") if isinstance(inner, Mapping) else None)
    return str(algo).upper() if algo else None


def _compressed_tensors_scheme(q: Mapping[str, Any]) -> Fp8Scheme | None:
    """compressed-tensors (llm-compressor) with float8 weights in every config group, alike: per tensor, channel
    or block, activations dynamic (per token or group), static (per tensor) or not quantized."""
    if q.get("format", "float-quantized") not in ("float-quantized", "naive-quantized"):
        return None
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        return None
    schemes = set()
    for group in groups.values():
        if not isinstance(group, Mapping):
            return None
        w, a = group.get("weights"), group.get("input_activations")
        if not (isinstance(w, Mapping) and w.get("type") == "float" and w.get("num_bits") == 8
                and w.get("symmetric", True) and not w.get("dynamic", False)):
            return None
        strategy = w.get("strategy")
        block = None
        if strategy == "block":
            b = w.get("block_structure")
            if not (isinstance(b, list) and len(b) == 2 and all(isinstance(v, int) and v > 0 for v in b)):
                return None
            block = (b[0], b[1])
        elif strategy not in ("tensor", "channel"):
            return None
        activations = "dynamic"
        if a is not None:
            if not (isinstance(a, Mapping) and a.get("type") == "float" and a.get("num_bits") == 8):
                return None
            if not a.get("dynamic", False):
                if a.get("strategy") != "tensor" or block is not None:
                    return None
                activations = "static"
        schemes.add(Fp8Scheme("block" if block else strategy, block, activations, "weight_scale",
                              method="compressed-tensors"))
    return schemes.pop() if len(schemes) == 1 else None


def fp8_scheme(raw: Mapping[str, Any], path: Path | None = None) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint whose config.json (`raw`; or, for ModelOpt, its hf_quant_config.json in
    `path`) says FP8 weights in a layout Atlas loads, else None (any other quantization, or none):
    - quant_method fp8: with weight_block_size [bn, bk] (dynamic activations only), float8 weights and a float32
      `weight_scale_inv` per block; without, a `weight_scale` per tensor, and with activation_scheme static an
      `input_scale` per tensor;
    - fbgemm_fp8: a `weight_scale` per output channel ([N, 1]), dynamic per-token activations capped by
      activation_scale_ub;
    - modelopt with quant_algo FP8: a `weight_scale` and a static `input_scale` per tensor;
    - compressed-tensors with float8 weights (`_compressed_tensors_scheme`), scales named `weight_scale`.
    Layers the quantizer left out (ignored_layers, modules_to_not_convert, ignore, exclude_modules) need no list:
    their weights come in a floating-point dtype and load as plain layers (layers/linear.py)."""
    q = raw.get("quantization_config")
    if not q and path is not None and (Path(path) / "hf_quant_config.json").is_file():
        try:
            q = {"quant_method": "modelopt", **json.loads((Path(path) / "hf_quant_config.json").read_text())}
        except (OSError, ValueError):
            return None
    if not isinstance(q, Mapping):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        activations = q.get("activation_scheme", "dynamic")
        if q.get("fmt", "e4m3") not in _E4M3 or activations not in ("dynamic", "static"):
            return None
        block = q.get("weight_block_size")
        if block is None:
            return Fp8Scheme("tensor", None, activations, "weight_scale", method="fp8")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            return None
        if activations != "dynamic":
            return None
        return Fp8Scheme("block", (block[0], block[1]), "dynamic", "weight_scale_inv", method="fp8")
    if method == "fbgemm_fp8":
        ub = q.get("activation_scale_ub")
        return Fp8Scheme("channel", None, "dynamic", "weight_scale",
                         activation_scale_ub=float(ub) if isinstance(ub, (int, float)) else None, method="fbgemm_fp8")
    if method == "modelopt":
        return Fp8Scheme("tensor", None, "static", "weight_scale", method="modelopt") if _modelopt_algo(q) == "FP8" \
            else None
    if method in ("compressed-tensors", "compressed_tensors"):
        return _compressed_tensors_scheme(q)
    return None


def is_mxfp4(raw: Mapping[str, Any]) -> bool:
    """Whether config.json (`raw`) says MXFP4 weights (quant_method mxfp4)."""
    q = raw.get("quantization_config")
    return isinstance(q, Mapping) and str(q.get("quant_method", "")).lower() == "mxfp4"


def loads_mxfp4(raw: Mapping[str, Any]) -> bool:
    """Whether the checkpoint says MXFP4 weights and its architecture's model class loads them (its
    `loads_mxfp4_experts`: gpt-oss)."""
    if not is_mxfp4(raw):
        return False
    # (imported here: the registry imports the model files, which import this module)
    from atlas.models.registry import architecture_class

    archs = raw.get("architectures") or [None]
    return bool(getattr(architecture_class(archs[0]), "loads_mxfp4_experts", False))


def refuse_quantized(raw: Mapping[str, Any], path: Path, what: str = "checkpoint", dequantizes: bool = False) -> None:
    """Raise UnsupportedModelError if the checkpoint at `path` (config.json parsed into `raw`) says its
    weights are quantized by a method Atlas does not load: any, except the FP8 layouts of `fp8_scheme` where the
    caller loads them (`dequantizes`: a target through build_model, which keeps them in FP8 or dequantizes them),
    and MXFP4 experts for the architectures that load them (`loads_mxfp4`), likewise. Reads config files only,
    never a weight."""
    loads_fp8 = dequantizes and (fp8_scheme(raw, path) is not None or loads_mxfp4(raw))
    for key in _CONFIG_KEYS:
        q = raw.get(key)
        if q and loads_fp8 and key == "quantization_config":
            continue
        if q:  # (null or {} says nothing)
            default = "compressed-tensors" if key == "compression_config" else "no quant_method"
            raise _refusal(what, path, describe(q, default), f"{key} in {path / 'config.json'}")
    for name, method in _SIDE_FILES.items():
        side = Path(path) / name
        if side.is_file() and not (loads_fp8 and method == "modelopt"):
            try:
                q = json.loads(side.read_text())
            except (OSError, ValueError):
                q = {}
            raise _refusal(what, path, describe(q, method), f"{side}")
    refuse_gguf(Path(path))


def refuse_gguf(path: Path, only_if_no_safetensors: bool = True) -> None:
    """Raise UnsupportedModelError for GGUF weights: a .gguf file, or a folder whose weights are .gguf
    files only (with only_if_no_safetensors, a folder that also has safetensors passes)."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        found = [path.name]
    elif path.is_dir():
        if only_if_no_safetensors and any(path.glob("*.safetensors")):
            return
        found = sorted(p.name for p in path.glob("*.gguf"))
    else:
        return
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise UnsupportedModelError(
            f"{path} holds GGUF weights ({shown}): Atlas does not load GGUF (llama.cpp's quantized format) "
            f"and implements only one quantized layout. It loads {SUPPORTED} with their config.json. {FIX}, "
            "as published on the Hugging Face hub")


# The last part of the names quantizers give the tensors beside (or instead of) a weight -> what they are.
_FP8_BLOCK = "FP8 block-quantized weights (quant_method fp8 with weight_block_size: the DeepSeek-V3 / Qwen -FP8 layout)"
_SCALED = "FP8 / FP4 scaled weights (fp8, compressed-tensors, modelopt, fbgemm_fp8, quark)"
_TENSOR_KINDS: dict[str, tuple[str, str]] = {
    "weight_scale_inv": ("quantization scales", _FP8_BLOCK),
    **{s: ("quantization scales", _SCALED) for s in (
        "weight_scale", "input_scale", "weight_scale_2", "input_scale_ub", "weight_global_scale",
        "input_global_scale")},
    **{s: ("quantized weights or their scales", "AWQ / GPTQ packed integer weights")
       for s in ("qweight", "qzeros", "scales", "g_idx")},
    **{s: ("quantized weights or their parameters", "compressed-tensors packed weights")
       for s in ("weight_packed", "weight_zero_point", "weight_g_idx", "weight_shape", "input_zero_point")},
    **{s: ("quantization state", "bitsandbytes 4-/8-bit weights")
       for s in ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "SCB", "weight_format")},
    **{s: ("quantized weights or their scales", "MXFP4 expert weights")
       for s in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")},
    **{s: ("quantized weights or their scales", "EXL2 (exllamav2) weights")
       for s in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_perm", "q_invperm")},
    "weight_scales": ("quantization scales", "EETQ int8 weights"),
    "W_q": ("quantized weights", "HQQ weights"),
}


def quantized_tensor_kind(name: str) -> tuple[str, str] | None:
    """(what the tensor is, which methods name it so) if `name` is a quantizer's tensor, else None.
    (FP8 KV-cache scales, k_scale / v_scale, are not here: without them the cache is simply not FP8.)"""
    if ".quant_state." in name:
        return _TENSOR_KINDS["absmax"]
    return _TENSOR_KINDS.get(name.rpartition(".")[2])


def _undeclared(declared: str | None) -> str:
    """Why a quantized tensor is refused: no quantization_config, or one (method `declared`) that does not cover
    the parameter it was offered to (Atlas keeps that one in floating point)."""
    if declared is None:
        return "although its config.json has no quantization_config: Atlas reads quantized weights only as its " \
               "config.json declares them"
    return f"for a parameter that Atlas keeps in floating point under its declared quantization ({declared})"


def refuse_quantized_tensor(name: str, where: object, weight: tuple[str, str] | None = None,
                            declared: str | None = None) -> None:
    """Raise UnsupportedModelError if checkpoint tensor `name` is a quantizer's. `weight`: (name, dtype) of
    a quantized-dtype weight seen before it, named too; `declared`: the config's quant_method, if any."""
    kind = quantized_tensor_kind(name)
    if kind is None:
        return
    what, methods = kind
    also = f", with {weight[0]} in {weight[1]}" if weight is not None else ""
    raise UnsupportedModelError(
        f"{where} holds {what} ({name}{also}: {methods}) {_undeclared(declared)}, and loading the weights without "
        f"them would generate wrong tokens. It loads {SUPPORTED}. {FIX}")


_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})


def quantized_dtype(loaded: Any) -> str | None:
    """The dtype of a checkpoint tensor that is not a plain floating-point one (float8, float4, integers,
    bool), else None: such a tensor offered to a floating-point parameter would be cast, not dequantized."""
    dtype = checkpoint_dtype(loaded)
    return None if dtype in _FLOATS else dtype


def refuse_quantized_dtype(name: str, dtype: str, where: object, declared: str | None = None) -> UnsupportedModelError:
    """The error for a weight stored as `dtype` (see quantized_dtype); `declared`: the config's quant_method."""
    return UnsupportedModelError(
        f"{where} stores weight {name} as {dtype}, {_undeclared(declared)}, and casting these values to floating "
        f"point without their scales would generate wrong tokens. It loads {SUPPORTED}. {FIX}")


def declared_method(raw: dict | None) -> str | None:
    """The quant_method a config.json (or its text_config) declares, else None."""
    for cfg in (raw or {}, (raw or {}).get("text_config") or {}):
        q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(q, dict):
            return str(q.get("quant_method") or "unnamed")
    return None


def dequantize_fp8(weights, scheme: Fp8Scheme, dtype: torch.dtype, where: object = "the checkpoint",
                   keep: Callable[[str], bool] | None = None):
    """The checkpoint's tensors with each float8 `X.weight` and its scales (`X.weight_scale_inv` per block, or
    `X.weight_scale` per tensor or channel: scheme.scale_name) replaced by one `X.weight` in `dtype` (they may come
    in either order, from different files); a static `X.input_scale` is dropped (the dequantized model computes
    with unquantized activations); everything else as it comes. For models that do not keep FP8 weights, and for
    the layers of those that keep some where `keep(name)` is false (`CausalLM.keeps_fp8`): tensors it keeps pass
    as they are."""
    from atlas.kernels.fp8_linear import dequantize
    from atlas.layers.linear import materialize

    suffix = "." + scheme.scale_name
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if keep is not None and keep(name):
            yield name, tensor
            continue
        if name.endswith(suffix):
            base, part = name[: -len(suffix)] + ".weight", "scale"
        elif name.endswith(".weight") and checkpoint_dtype(tensor).startswith("float8"):
            base, part = name, "weight"
        elif name.endswith((".input_scale", ".input_scale_ub")):
            continue
        else:
            yield name, tensor
            continue
        pair = pending.setdefault(base, {})
        pair[part] = materialize(tensor)  # (a lazy slice is valid only until the next tensor)
        if len(pair) == 2:
            del pending[base]
            weight, scale = pair["weight"], pair["scale"]
            if scheme.block is not None:
                yield base, dequantize_block_fp8(weight, scale, scheme.block, dtype, base)
                continue
            rows = weight.shape[-2]
            if scale.numel() == 1:
                scale = scale.reshape(1).expand(rows)
            elif scale.numel() != rows:
                raise ModelLoadError(f"malformed FP8 checkpoint: {base[:-len('.weight')]}{suffix} has shape "
                                     f"{tuple(scale.shape)}: one number or one per each of {rows} rows expected")
            yield base, dequantize(weight, scale.reshape(rows), None, dtype)
    if pending:
        base, pair = next(iter(pending.items()))
        stem = base[: -len(".weight")]
        what = (f"{base} has no {scheme.scale_name}" if "weight" in pair
                else f"{stem}{suffix} scales no float8 weight")
        raise ModelLoadError(f"malformed FP8 checkpoint {where}: {what} ({len(pending)} such tensor(s))")
