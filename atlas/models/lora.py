"""LoRA adapters in PEFT's format: read one, check it against the model, and write it into an adapter slot of the
model's layers (layers/lora.py holds the slots and their math).

PEFT saves `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and `adapter_model.safetensors`
(or the older `adapter_model.bin`) with, per adapted module, `base_model.model.<module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r]; the layer computes W x + scale * B A x, scale = lora_alpha / r (rsLoRA: / sqrt(r)), with
per-module ranks and alphas where rank_pattern / alpha_pattern name them. What Atlas cannot apply exactly is refused
with its name: DoRA, trained biases, embedding or LM-head adapters (modules_to_save, lora_embedding_*), modules the
model does not adapt.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from atlas.config import HubAccess
from atlas.errors import ConfigError, ModelLoadError, UnsupportedModelError
from atlas.layers.linear import Linear
from atlas.layers.lora import LoraSlots, LoraWeights

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
# adapter_config.json fields that change what the adapter computes beyond W x + scale * B A x, refused when set
_REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a trained bias on lora_B",
    "layer_replication": "layer replication",
    "target_parameters": "adapters on parameters (not on linear modules)",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "fan_in_fan_out": "fan_in_fan_out weights (Conv1D layers)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
}


@dataclass
class LoraAdapter:
    """An adapter read from disk: per adapted module (named as the base checkpoint names it, e.g.
    model.layers.0.self_attn.q_proj), its A [r, in], B [out, r] and scale."""

    name: str
    path: Path
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    base_model: str | None = None

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _, _ in self.modules.values()), default=0)


def adapter_folder(path: str, revision: str | None = None, hub: HubAccess | None = None) -> Path:
    """A local adapter folder, or a hub id fetched into the Hugging Face cache (only its config and weights)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ConfigError(f"LoRA adapter {path!r}: no such folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, revision=revision, allow_patterns=[CONFIG_FILE, *WEIGHT_FILES],
                                      **(hub or HubAccess()).snapshot_args()))
    except Exception as exc:  # (offline, unknown repo, no access: the hub's message says which)
        raise ConfigError(f"LoRA adapter {path!r} is neither a local folder nor a hub repository Atlas could "
                          f"download: {exc}") from None


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the module name's end."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def read_adapter(name: str, path: str | Path, hub: HubAccess | None = None) -> LoraAdapter:
    """Read a PEFT LoRA adapter folder (refusing what Atlas cannot apply exactly, naming it); a hub id is fetched
    as `hub` says (--download-dir, --hf-token)."""
    folder = adapter_folder(str(path), hub=hub)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ConfigError(f"LoRA adapter {name!r}: {folder} has no {CONFIG_FILE} (a PEFT LoRA adapter folder has "
                          f"it beside adapter_model.safetensors)")
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"LoRA adapter {name!r}: cannot read {config_path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"LoRA adapter {name!r}: {config_path} is not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise UnsupportedModelError(f"LoRA adapter {name!r}: peft_type {kind!r} is not supported (Atlas applies "
                                    "LORA adapters)")
    for key, what in _REFUSED_FIELDS.items():
        if cfg.get(key):
            raise UnsupportedModelError(f"LoRA adapter {name!r}: {key} is set ({what}), which Atlas does not apply")
    if cfg.get("bias", "none") != "none":
        raise UnsupportedModelError(f"LoRA adapter {name!r}: bias {cfg['bias']!r} (trained biases of the base "
                                    "layers) is not supported; Atlas applies adapters with bias 'none'")
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))
    tensors = _read_weights(name, folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, part = key.removeprefix(_PREFIX).rpartition(".lora_")
        if not module or part not in ("A.weight", "B.weight"):
            what = ("DoRA magnitudes" if "lora_magnitude_vector" in key else
                    "an embedding adapter" if "lora_embedding" in key else
                    "a trained bias" if key.endswith(".bias") else "a tensor that is not a LoRA A or B weight")
            raise UnsupportedModelError(f"LoRA adapter {name!r}: {key} ({what}) is not supported")
        pairs.setdefault(module, {})[part[0]] = tensor
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ModelLoadError(f"malformed LoRA adapter {name!r}: {module} has lora_{next(iter(pair))} without "
                                 f"its other half")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ModelLoadError(f"malformed LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)} (expected [r, in] and [out, r])")
        rank = a.shape[0]
        expected = _pattern_value(rank_pattern, module, r)
        if rank != expected:
            raise ModelLoadError(f"malformed LoRA adapter {name!r}: {module} has rank {rank}, its config says "
                                 f"{expected}")
        module_alpha = _pattern_value(alpha_pattern, module, alpha)
        scale = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        modules[module] = (a, b, scale)
    if not modules:
        raise ModelLoadError(f"malformed LoRA adapter {name!r}: {folder} holds no lora_A / lora_B weights")
    return LoraAdapter(name, folder, modules, cfg.get("base_model_name_or_path"))


def _read_weights(name: str, folder: Path) -> dict[str, torch.Tensor]:
    path = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if path is None:
        raise ConfigError(f"LoRA adapter {name!r}: {folder} has no {' or '.join(WEIGHT_FILES)}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(f"malformed LoRA adapter {name!r}: cannot read {path}: {exc}") from None


# ------------------------------------------------------------------------------------------------------- the model
def adapted_name(model: nn.Module, module: str) -> tuple[str, object]:
    """The model's layer and output piece (shard id) of a module as the checkpoint names it: q_proj is piece "q" of
    the fused qkv_proj (the model's stacked_params)."""
    parent, _, leaf = module.rpartition(".")
    for ckpt_piece, fused, shard in getattr(model, "stacked_params", ()):
        if leaf == ckpt_piece:
            return f"{parent}.{fused}" if parent else fused, shard
    return module, None


def checkpoint_leaves(model: nn.Module, leaves: tuple[str, ...]) -> list[str]:
    """The checkpoint's module names of the model's adaptable layers (q_proj, k_proj, v_proj for qkv_proj)."""
    stacked = getattr(model, "stacked_params", ())
    out = []
    for leaf in leaves:
        pieces = [ckpt for ckpt, fused, _ in stacked if fused == leaf]
        out += pieces or [leaf]
    return out


def attach_lora(model: nn.Module, slots: LoraSlots, dtype: torch.dtype, leaves: set[str] | None = None
                ) -> dict[str, Linear]:
    """Give adapter slots (in `dtype`, the model's) to the model's layers that take adapters (the class's
    `lora_layers`), those whose name ends in one of `leaves` (the model's names, e.g. qkv_proj) or all of them.
    -> layer name -> layer."""
    supported = tuple(getattr(model, "lora_layers", ()))
    if not supported:
        raise UnsupportedModelError(f"--enable-lora: Atlas does not apply LoRA adapters to "
                                    f"{type(model).__name__} models (it does to the Llama, Mistral, Qwen2, Qwen3 and "
                                    "Gemma 3 families, and to the attention of Qwen3-MoE, Mixtral, GLM-4.5 and "
                                    "gpt-oss)")
    wanted = set(supported) if leaves is None else set(leaves) & set(supported)
    attached = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rpartition(".")[2] in wanted:
            pieces = []
            for shard in module.shard_ids():
                here, rows, _, _ = module.row_map(shard)
                pieces.append((shard, here, rows))
            module.lora = LoraWeights(slots, module.in_features, pieces, dtype, module.weight.device)
            attached[name] = module
    return attached


def _own_modules(model: nn.Module, adapter: LoraAdapter) -> tuple[dict[str, tuple[str, object]], list[str]]:
    """({adapter module: (the model's layer name, its output piece)}, the adapter's modules of parts the model does
    not run (an image-text model's vision tower: CausalLM.adapter_module))."""
    targets, not_run = {}, []
    for module in adapter.modules:
        own = model.adapter_module(module)
        if own is None:
            not_run.append(module)
        else:
            targets[module] = adapted_name(model, own)
    return targets, not_run


def adapter_leaves(model: nn.Module, adapter: LoraAdapter) -> set[str]:
    """The model's layer names (their last part) an adapter adapts."""
    return {target.rpartition(".")[2] for target, _ in _own_modules(model, adapter)[0].values()}


@dataclass
class PlacedAdapter:
    """An adapter checked against the model and cut to this rank's rows and columns, ready to write into a slot:
    (layer, output piece, A, B, scale) for each module it adapts."""

    name: str
    path: Path
    pieces: list[tuple[Linear, object, torch.Tensor, torch.Tensor, float]]


def place(model: nn.Module, layers: dict[str, Linear], adapter: LoraAdapter, max_rank: int) -> PlacedAdapter:
    """`adapter` checked against the model's adapted layers and cut to this rank's share of them. Refuses an adapter
    whose rank passes max_rank, or that adapts a module the slots do not cover, or whose shapes are not the
    model's."""
    if adapter.rank > max_rank:
        raise ConfigError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank {max_rank}: "
                          f"restart with --max-lora-rank {adapter.rank} or more")
    pieces = []
    adaptable = sorted({n.rpartition(".")[2] for n in layers})
    targets, not_run = _own_modules(model, adapter)
    for module, (target, shard) in targets.items():
        a, b, scale = adapter.modules[module]
        layer = layers.get(target)
        if layer is None:
            leaves = checkpoint_leaves(model, tuple(adaptable))
            raise UnsupportedModelError(
                f"LoRA adapter {adapter.name!r} adapts {module}, which this engine does not adapt (it adapts "
                f"{', '.join(leaves)} of {type(model).__name__}" + (
                    "; the adapters loaded at start chose these: list this one in --lora-modules too" if
                    len(adaptable) < len(getattr(model, "lora_layers", ())) else "") + ")")
        first_col, total_cols = layer.col_map()
        _, rows, first_row, total_rows = layer.row_map(shard)
        if tuple(a.shape[1:]) != (total_cols,) or b.shape[0] != total_rows:
            raise ModelLoadError(f"LoRA adapter {adapter.name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)}, but the model's layer takes {total_cols} inputs to {total_rows} "
                                 "outputs: an adapter of another base model?")
        pieces.append((layer, shard, a[:, first_col: first_col + layer.in_features],
                       b[first_row: first_row + rows], scale))
    if not_run:
        logger.info("LoRA adapter %r: %d modules of parts Atlas does not run for text prompts (e.g. %s) are not "
                    "loaded", adapter.name, len(not_run), not_run[0])
    return PlacedAdapter(adapter.name, adapter.path, pieces)


def write_slot(layers: dict[str, Linear], slot: int, adapter: PlacedAdapter) -> None:
    """Put a placed adapter into slot `slot` of every adapted layer (the slot is cleared first in every layer, so a
    layer the adapter leaves alone adds nothing)."""
    for layer in layers.values():
        layer.lora.clear_slot(slot)
    for layer, shard, a, b, scale in adapter.pieces:
        layer.lora.set_piece(slot, shard, a, b, scale)
