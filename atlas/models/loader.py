"""Finding a checkpoint (local folder or hub id) and loading its safetensors into a model.

Under tensor or pipeline parallelism a rank reads only what it holds: the tensors of its pipeline
stage, and of those, through lazy safetensors slices (`get_slice`), only its rows or columns of the
sharded ones.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from atlas.config import HubAccess, ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.linear import Linear, quantizing
from atlas.layers.moe import note_mxfp4_scales
from atlas.layers.parallel import ModelParallel, building_with
from atlas.models.base import CausalLM
from atlas.models.quantization import (
    declared_method,
    dequantize_fp8,
    fp8_scheme,
    loads_mxfp4,
    quantized_dtype,
    refuse_gguf,
    refuse_quantized,
    refuse_quantized_dtype,
)
from atlas.models.registry import model_class

logger = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def resolve_model_path(model: str, revision: str | None = None, weights: bool = True,
                       hub: HubAccess | None = None) -> Path:
    """A local checkpoint folder as is; otherwise a hub id, fetched (or found in the cache) with
    huggingface_hub, which honours HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE; without its weight files when
    `weights` is False (--load-format dummy). hub: --download-dir's cache and --hf-token."""
    hub = hub or HubAccess()
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            refuse_gguf(local)  # (a folder of .gguf files only: named, not "no config.json")
        return local
    if local.exists():
        refuse_gguf(local)
        raise ModelLoadError(f"--model {model!r} is a file; point it at the checkpoint folder that holds config.json")
    looks_like_path = model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or os.sep + os.sep in model
    if looks_like_path:
        raise ModelLoadError(f"model path {model!r} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        if weights:  # a quantized checkpoint is refused before gigabytes of weights are fetched
            configs = Path(snapshot_download(repo_id=model, revision=revision, allow_patterns=["*.json"],
                                             **hub.snapshot_args()))
            if (configs / "config.json").is_file():
                refuse_quantized(ModelConfig.from_path(configs).raw, configs, dequantizes=True)
        patterns = _HUB_PATTERNS if weights else [p for p in _HUB_PATTERNS if p != "*.safetensors"]
        return Path(snapshot_download(repo_id=model, revision=revision, allow_patterns=patterns,
                                      **hub.snapshot_args()))
    except UnsupportedModelError:
        raise
    except HFValidationError as exc:
        raise ModelLoadError(f"model {model!r} is neither an existing folder nor a valid hub id ({exc})") from exc
    except Exception as exc:  # network, auth, offline-cache miss: all user-fixable
        raise ModelLoadError(
            f"could not get model {model!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Pass a local checkpoint folder, or check the id, your network and HF_TOKEN "
            f"(with HF_HUB_OFFLINE=1 the model must already be in the hub cache{', ' + hub.cache_dir if hub.cache_dir else ''})."
        ) from exc


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"malformed checkpoint: {index} has no valid 'weight_map' ({exc})") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"malformed checkpoint: shard(s) {', '.join(missing)} listed in {index.name} "
                                 f"are missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        refuse_gguf(path)
        hint = (" (it has PyTorch .bin weights: re-save them with safetensors)" if any(path.glob("*.bin")) else
                "; --load-format dummy runs its config.json with random weights, to measure speed and memory")
        raise ModelLoadError(f"no *.safetensors weights in {path}{hint}")
    return files


def iterate_weights(files: list[Path], desc: str = "loading weights", prefix: str = "",
                    keep: Callable[[str], bool] | None = None, lazy: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the files, or only of those named prefix... and kept by `keep`
    (others are not read). lazy: lazy safetensors slices instead of tensors, valid until the next item
    (the weight loaders read the parts they need; see layers/linear.py)."""
    # (A bar for sharded checkpoints, unless the atlas logger is set quieter than INFO: parallel workers
    # whose node another process speaks for.)
    quiet = len(files) == 1 or logging.getLogger("atlas").level > logging.INFO
    for file in tqdm(files, desc=desc, unit="shard", disable=quiet):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.startswith(prefix) and (keep is None or keep(name)):
                        yield name, (f.get_slice(name) if lazy else f.get_tensor(name))
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"malformed checkpoint: cannot read {file} ({exc})") from exc


class AbsentOnStage(nn.Module):
    """Stands for a module that another pipeline stage holds (calling it is a bug)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is held by another pipeline stage")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Held by the first stage only: the embedding, and the LM head (sampling happens with the scheduler).
_FIRST_STAGE_ONLY = ("model.embed_tokens", "model.embeddings", "lm_head")


def _stage_keeps(cfg: ModelConfig, model: CausalLM, first_stage: bool) -> Callable[[str], bool]:
    """Which checkpoint tensors this pipeline stage reads: its decoder layers' (and any past the model's
    layers, e.g. multi-token-prediction modules, which the model's own loader handles), and the embedding
    and LM head on the first stage only."""
    layers = model.model.layers
    first, end = layers.first, layers.first + len(layers)

    def keep(name: str) -> bool:
        if name.startswith("model.language_model."):  # (a vision-language checkpoint's language model)
            name = "model." + name[len("model.language_model."):]
        elif name.startswith("backbone."):  # (Nemotron-H's checkpoints name the decoder so)
            name = "model." + name[len("backbone."):]
        m = _LAYER.match(name)
        if m is not None:
            i = int(m.group(1))
            return first <= i < end or i >= cfg.num_hidden_layers
        return first_stage or not name.startswith(_FIRST_STAGE_ONLY)

    return keep


@contextlib.contextmanager
def constructing(device: torch.device, dtype: torch.dtype, parallel: ModelParallel | None = None) -> Iterator[None]:
    """Modules made inside are created on `device` in `dtype`, with the model-parallel view `parallel`
    (None: whole, single device)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), building_with(parallel):
            yield
    finally:
        torch.set_default_dtype(previous)


def fill_dummy_weights(module: nn.Module, seed: int = 0) -> None:
    """--load-format dummy: every floating-point parameter drawn uniformly from [-1e-3, 1e-3] (small enough
    that no layer overflows in any dtype) on its own device, each from its own seed; nothing is read. FP8 weights
    are drawn over the FP8 range and their scales set to 1e-3 / 448 (the same values), a static activation scale
    to 1 / 448; MXFP4 experts' codes are random bytes and their scales 2^-13 (|w| < 1e-3)."""
    with torch.no_grad():
        for i, param in enumerate(module.parameters()):
            fill = getattr(param, "dummy_fill", None)
            if fill is not None:
                param.fill_(fill)
            elif param.dtype == torch.float8_e4m3fn:
                g = torch.Generator(param.device).manual_seed(seed + i)
                rows = param.data.view(-1, param.shape[-1])  # (stacked experts [E, N, K]: their rows)
                for row in range(0, rows.shape[0], 4096):  # (float32 a slice at a time)
                    part = rows[row: row + 4096]
                    part.copy_(torch.empty(part.shape, device=param.device).uniform_(-448, 448, generator=g))
            elif param.is_floating_point():
                param.uniform_(-1e-3, 1e-3, generator=torch.Generator(param.device).manual_seed(seed + i))
            elif param.dtype == torch.uint8:  # (MXFP4 experts' codes: any byte is two valid FP4 codes)
                param.random_(0, 256, generator=torch.Generator(param.device).manual_seed(seed + i))


def prepare_fp8(model: nn.Module) -> None:
    """Make the scales of the model's FP8 linear layers (after construction: layers/linear.py)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.prepare_fp8(name)


def quantize_online(model: nn.Module) -> int:
    """--quantization fp8: every loaded plain linear layer of the model to FP8 with a scale per output row. -> how
    many were quantized."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear) and module.fp8 is None and not module.keeps_model_dtype:
                module.quantize_online()
                count += 1
    return count


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                parallel: ModelParallel | None = None,
                before_loading: Callable[[CausalLM], object] | None = None, dummy: bool = False,
                quantization: str | None = None) -> CausalLM:
    """Construct the model directly on `device` in `dtype`, then fill it from the checkpoint (with `dummy`,
    with random values). With `parallel`, this rank's part of it: its pipeline stage's layers and its
    tensor-parallel shards. `before_loading(model)` runs between the two (checks of the constructed model that
    should fail before a large checkpoint is read). A quantized checkpoint is refused first, before anything
    but its config files is read (dummy weights included: they would not run the quantized model), unless it is
    FP8 in a layout models/quantization.fp8_scheme reads: models whose class says `supports_fp8_linear` keep
    those linear layers' weights in FP8 (layers/linear.py), the others' weights are dequantized to `dtype` as they
    load. quantization="fp8" (--quantization fp8): the linear layers of a plain checkpoint are quantized to FP8
    (a scale per output row) once loaded."""
    refuse_quantized(cfg.raw, cfg.path, f"{cfg.architecture} checkpoint", dequantizes=True)
    cls = model_class(cfg)
    scheme = fp8_scheme(cfg.raw, cfg.path)
    native = scheme is not None and getattr(cls, "supports_fp8_linear", False)
    if quantization is not None and not getattr(cls, "supports_fp8_linear", False):
        raise UnsupportedModelError(
            f"--quantization {quantization}: Atlas keeps linear layers in FP8 only in the Llama, Mistral, Qwen2, Qwen3, "
            f"Qwen3-MoE, Mixtral, GLM-4.5, DeepSeek-V2 / V3, Qwen3-Next and Qwen3.5 / Qwen3.6 families, not in "
            f"{cfg.architecture} yet. Leave the flag "
            f"out to serve it in {dtype}")
    files = None if dummy else safetensors_files(cfg.path)
    with constructing(device, dtype, parallel), quantizing(scheme if native else None):
        model = cls(cfg, max_positions)
    if native:
        prepare_fp8(model)
    if before_loading is not None:
        before_loading(model)
    keep = None
    if parallel is not None and parallel.pp_size > 1:
        if not parallel.is_first_stage:
            for name in _FIRST_STAGE_ONLY:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, AbsentOnStage(name))
        keep = _stage_keeps(cfg, model, parallel.is_first_stage)
    if files is None:
        fill_dummy_weights(model)
    else:
        weights = iterate_weights(files, keep=keep, lazy=parallel is not None)
        if native:
            logger.info("%s: %s, kept in FP8 in its linear layers (and routed experts)", cfg.path, scheme)
            # (the layers a model keeps in its dtype, e.g. kv_b_proj, routers, take their tensors dequantized)
            weights = dequantize_fp8(weights, scheme, dtype, cfg.path, keep=model.keeps_fp8)
        elif scheme is not None:
            logger.info("%s: %s, dequantized to %s as they load (%s keeps no FP8 weights yet: memory and speed are "
                        "those of the %s model)", cfg.path, scheme, str(dtype).removeprefix("torch."),
                        cfg.architecture, str(dtype).removeprefix("torch."))
            weights = dequantize_fp8(weights, scheme, dtype, cfg.path)
        with torch.no_grad():  # (lazy: a tensor that no loader takes, e.g. a drafter's, is never read)
            model.load_weights(weights)
    if loads_mxfp4(cfg.raw):  # (after loading: the form the experts hold)
        note_mxfp4_scales(model)
        name = str(dtype).removeprefix("torch.")
        if getattr(model, "mxfp4_experts", False):
            logger.info("%s: MXFP4 expert weights (quant_method mxfp4), %s MXFP4 (uint8 FP4 codes with E8M0 "
                        "scales, half a byte a weight): %s", cfg.path,
                        "drawn at random (--load-format dummy) in" if files is None else "kept in",
                        "the Triton expert kernels dequantize them in registers" if device.type == "cuda" else
                        f"dequantized to {name} at each step (the dequantized model's numbers)")
        elif getattr(model, "mxfp4_fallback", None) is None and files is not None:
            logger.info("%s: quant_method mxfp4, but its expert tensors are floating point: loaded in %s",
                        cfg.path, name)
        else:
            logger.info("%s: MXFP4 expert weights (quant_method mxfp4), %s %s: memory and speed are those of "
                        "the %s model (%s)", cfg.path,
                        "drawn at random (--load-format dummy) in" if files is None else
                        "dequantized exactly as they load to", name, name,
                        getattr(model, "mxfp4_fallback", None) or "the model keeps no MXFP4 experts")
    if quantization == "fp8":
        count = quantize_online(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # (the bf16 weights' blocks, for the KV cache the memory plan sizes next)
        logger.info("--quantization fp8: %d linear layers quantized to FP8 (a scale per output row, dynamic "
                    "activation scales)", count)
    return model.eval()


def load_full_vocab(cfg: ModelConfig, model: CausalLM, device: torch.device, dtype: torch.dtype,
                    with_head: bool = True, dummy: bool = False) -> tuple[nn.Module, nn.Module | None]:
    """Whole (unsharded) copies of the model's embedding and LM head, read from the checkpoint: what a
    tensor-parallel driver gives a drafter, so that drafting calls no collective. -> (embedding, head);
    the head is None with with_head=False unless it is the embedding itself (tied: it costs nothing)."""
    from atlas.layers.embedding import LMHead, VocabEmbedding
    from atlas.layers.linear import default_weight_loader

    names = model.vocab_weight_names()
    if names is None:
        raise ModelLoadError(f"{cfg.architecture} does not name its embedding and LM head weights as a plain lookup "
                             "and product, which a drafter sharing them needs whole on the driver under tensor "
                             "parallelism: run it with tensor_parallel_size 1, or with --speculative ngram (which "
                             "needs neither)")
    embed_name, head_name = names
    tied = head_name == embed_name
    with_head = with_head or tied
    with constructing(device, dtype):
        embedding = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=embedding if tied else None) if with_head else None
    params = {embed_name: embedding.weight}
    if head is not None:
        params[head_name] = head.weight
    if dummy:
        for module in (embedding, head):
            if module is not None:
                fill_dummy_weights(module)
        return embedding, head
    found: set[str] = set()
    with torch.no_grad():
        for name, tensor in iterate_weights(safetensors_files(cfg.path), desc="loading embedding and LM head",
                                            keep=params.__contains__):
            dtype = quantized_dtype(tensor)
            if dtype is not None:
                raise refuse_quantized_dtype(name, dtype, cfg.path, declared_method(cfg.raw))
            try:
                default_weight_loader(params[name], tensor)
            except ValueError as exc:
                raise ModelLoadError(f"malformed checkpoint: weight {name!r}: {exc}") from exc
            found.add(name)
    missing = sorted(set(params) - found)
    if missing:
        raise ModelLoadError(f"malformed checkpoint {cfg.path}: no {', '.join(missing)}")
    return embedding.eval(), (head.eval() if head is not None else None)
