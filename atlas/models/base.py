"""What every model class offers the runtime, and the shared weight-routing helper."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from atlas.errors import ModelLoadError
from atlas.layers.attention import AttentionMetadata, CacheSpec, KVCacheSpec
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import Linear, MergedLinear, default_weight_loader, materialize
from atlas.layers.parallel import current, split_evenly
from atlas.models.quantization import (
    declared_method,
    quantized_dtype,
    refuse_quantized_dtype,
    refuse_quantized_tensor,
)

logger = logging.getLogger(__name__)

__all__ = ["CacheSpec", "CausalLM", "KVCacheSpec", "StageLayers", "load_named_weights", "make_layers"]


class StageLayers(nn.ModuleList):
    """The decoder layers of this pipeline stage, global ids first .. first + len - 1 of `total`. They
    iterate and index like a list of the stage's layers, but are named by their global ids, as the
    checkpoint names them (model.layers.17. ...)."""

    def __init__(self, first: int, total: int, layers: list[nn.Module]):
        super().__init__()
        self.first, self.total = first, total
        for i, layer in enumerate(layers):
            self.add_module(str(first + i), layer)

    @property
    def is_last(self) -> bool:
        return self.first + len(self) == self.total

    def __getitem__(self, index):
        return list(self._modules.values())[index]


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> StageLayers:
    """build(global layer id) for the layers of this pipeline stage only (all of them without pipeline
    parallelism)."""
    view = current()
    first, count = split_evenly(num_layers, view.pp_size, view.pp_rank)
    return StageLayers(first, num_layers, [build(i) for i in range(first, first + count)])


class CausalLM(nn.Module):
    """Interface of a target model. The runtime calls nothing else.

    Optional capability: `build_mtp(max_positions, embedding, lm_head)` -> the model's multi-token-prediction
    module without its weights (what `--speculative mtp` drives and loads), on models that have one;
    `mtp_uses_target_head` where that module's logits are the model's own LM head.
    """

    num_layers: int

    def keeps_fp8(self, name: str) -> bool:
        """For a model class that keeps FP8 linear layers (`supports_fp8_linear`): whether checkpoint tensor `name`
        (an FP8 weight or its scales) loads into one of them as it is; the others are dequantized to the model
        dtype as they load (models/quantization.dequantize_fp8)."""
        return True

    def kv_cache_specs(self) -> list[CacheSpec]:
        """One cache spec per attention layer, in the order of the kv_caches list forward() takes."""
        raise NotImplementedError

    def adapter_module(self, name: str) -> str | None:
        """--enable-lora: a LoRA adapter's module name (as PEFT saved it, its base_model.model. prefix dropped) as
        the model's checkpoint names it; None for a module of a part the model does not run (an image-text
        checkpoint's vision tower: it never touches a text prompt)."""
        return name

    def attention_program_heads(self) -> tuple[int, int] | None:
        """(query heads, key heads) the attention kernels pack per program where the model's layers differ in it
        (the step's program map is prepared for that packing; a layer of another makes its own in the step, so
        such a model keeps CUDA graphs off); None: every layer packs alike (the attention backend checks)."""
        return None

    def attention_windows(self) -> list[int | None]:
        """The sliding window of every attention layer of the model (every pipeline stage's, in order; None: a
        global layer). Empty where the model does not say, which the page manager reads as "keep every page"."""
        return []

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, vocab] logits of the final hidden rows (written into `out` when given)."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def vocab_weight_names(self) -> tuple[str, str] | None:
        """Checkpoint names of the whole embedding and LM head weights ([vocab, hidden] each, the same name
        twice when tied), whose plain lookup and product are `embed` and `compute_logits`; None where the
        model cannot say (a tensor-parallel driver then has no full-vocabulary copy for a drafter)."""
        return None

    #: why the forward cannot be captured in a CUDA graph where supports_cuda_graphs says so
    cuda_graph_blocker: str = ""

    #: why the model cannot hand a drafter the hidden states of its layers (forward's capture_layers: EAGLE-3,
    #: DFlash, MTP), where it cannot; the engine refuses such a drafter at start-up. Empty: it can.
    hidden_capture_blocker: str = ""

    def capture_blocker(self, layers: tuple[int, ...], reads_mtp_input: bool) -> str:
        """Why the forward cannot hand a drafter the residual streams of `layers` ('' where it can);
        reads_mtp_input: the drafter is the model's own MTP module (build_mtp's), which reads what the model's
        captured_width says."""
        return self.hidden_capture_blocker

    def captured_width(self) -> int:
        """The width of one captured layer's row (the hidden size; DeepSeek-V4: its hyper-connection streams)."""
        return self.config.hidden_size

    #: Whether each windowed attention layer reads and writes its cache through `meta.for_layer(window)`, so that
    #: the windowed layers may keep a page pool of their own (KV cache groups: engine/kv_groups.py) where the model
    #: has global layers too. False: one page table serves every layer.
    supports_kv_cache_groups: bool = False

    #: Whether the model keeps per-sequence recurrent state (linear-attention layers) besides, or instead of, paged
    #: KV: a class attribute, so that the engine can refuse what such models do not support before loading one.
    keeps_recurrent_state: bool = False
    #: Whether the recurrent layers run inside the mixed-step CUDA graphs (their rows from device tensors only:
    #: RecurrentRows); False keeps such a model's mixed steps eager.
    recurrent_state_in_mixed_graphs: bool = True

    def state_specs(self) -> list:
        """One layers.linear_attention.RecurrentStateSpec per layer that keeps recurrent state (none here)."""
        return []

    def bind_state_caches(self, pools: list | None) -> None:
        """Give the recurrent layers their state pools (allocate_state_pools' order); None: keep no state."""

    @classmethod
    def tensor_parallel_divisors(cls, cfg) -> dict[str, int]:
        """Counts of this model's own that the tensor-parallel size must divide, by what they are (beyond the
        attention heads and MLP sizes every model shares: runtime/parallel_groups.check_model)."""
        return {}

    def supports_cuda_graphs(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the forward runs without host syncs in this dtype on this device (CUDA graphs)."""
        return True

    def graph_context_buckets(self, max_seq_len: int) -> list[int] | None:
        """Bounds on a step's longest context (AttentionMetadata.max_seq_len) that the forward's tensor shapes
        depend on, ascending, the last at least max_seq_len: the step graphs are captured once per bound and a
        step replays the smallest that holds it. None: no shape depends on it (one graph per batch size)."""
        return None


def piece_name_of(stacked_params: list[tuple[str, str, object]], fused: str, shard: object) -> str:
    """The checkpoint's name of piece `shard` of fused parameter `fused` (q_proj of qkv_proj's "q")."""
    return next((ckpt for ckpt, f, s in stacked_params if f == fused and s == shard), fused)


# Where image-text checkpoints keep their language model, and the text model's names for it.
LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."),)


def language_model_weights(weights: Iterable[tuple[str, torch.Tensor]], towers: tuple[str, ...], where: object,
                           what: str, renames: tuple[tuple[str, str], ...] = LANGUAGE_MODEL_PREFIXES
                           ) -> Iterable[tuple[str, torch.Tensor]]:
    """An image-text checkpoint's tensors under its language model's names (`renames`: the first prefix that
    matches is replaced), those under the `towers` prefixes left out, with one log line naming them (`what`) and
    their count. A text checkpoint's tensors pass as they are."""
    skipped = 0
    for name, tensor in weights:
        for prefix, target in renames:
            if name.startswith(prefix):
                name = target + name[len(prefix):]
                break
        if name.startswith(towers):
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logger.info("%s: %s %d tensors are not loaded: Atlas serves the language model on text prompts", where,
                    what, skipped)


def renamed_weights(weights: Iterable[tuple[str, torch.Tensor]], renames: Iterable[tuple[str, str]] = (),
                    tied_head: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each (old, new) piece of `renames` replaced in their names, in order; with
    `tied_head` (tie_word_embeddings), without the `lm_head.weight` a checkpoint may hold beside the embedding."""
    renames = tuple(renames)
    for name, tensor in weights:
        if tied_head and name == "lm_head.weight":
            continue
        for old, new in renames:
            name = name.replace(old, new)
        yield name, tensor


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: list[tuple[str, str, object]],
    skip_suffixes: tuple[str, ...] = (),
    mapper: Callable[[str], tuple[str, object] | None] | None = None,
    strict: bool = False,
) -> None:
    """Route checkpoint tensors to parameters; fused parameters take their pieces by shard id.

    `mapper(name)` may route a name first (-> (parameter name, shard id or None), or None to fall
    through to `stacked_params`). With `strict`, a checkpoint tensor no parameter takes is an error
    rather than a warning. Raises ModelLoadError naming the first missing or mis-shaped weights.

    Quantized tensors are refused (UnsupportedModelError), never ignored or cast: a quantizer's scales,
    zero points or packed weights by name (models/quantization.py), and a float8 / integer tensor offered
    to a floating-point parameter by dtype. The latter is refused at the next tensor that is not one of its
    own (so that the scales after it, where the checkpoint has them, name the method), or at the end.
    """
    where = getattr(getattr(model, "config", None), "path", None) or "the checkpoint"
    declared = declared_method(getattr(getattr(model, "config", None), "raw", None))
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    held: tuple[str, str] | None = None  # (name, dtype) of a quantized-dtype weight, refused below
    for name, tensor in weights:
        target, shard = name, None
        routed = mapper(name) if mapper is not None else None
        if routed is not None:
            target, shard = routed
        else:
            for ckpt_piece, fused_piece, shard_id in stacked_params:
                if f".{ckpt_piece}." in name:
                    target, shard = name.replace(f".{ckpt_piece}.", f".{fused_piece}."), shard_id
                    break
        param = params.get(target)
        if param is None or not getattr(param, "fp8_scale", False):  # (an FP8 layer's scales are its own)
            refuse_quantized_tensor(name, where, held, declared)
        if held is not None and not name.startswith(held[0].rpartition(".")[0] + "."):
            raise refuse_quantized_dtype(*held, where, declared)
        if name.endswith(skip_suffixes):
            continue
        if param is None:
            unexpected.append(name)
            continue
        dtype = quantized_dtype(tensor) if param.is_floating_point() and param.dtype != torch.float8_e4m3fn and (
            not getattr(param, "takes_fp8", False)) else None
        if dtype is not None:
            if held is not None:
                raise refuse_quantized_dtype(*held, where, declared)
            held = (name, dtype)
            continue
        try:
            loader = getattr(param, "weight_loader", default_weight_loader)
            if not getattr(loader, "takes_slices", False):
                tensor = materialize(tensor)  # (a lazy safetensors slice: read whole)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as exc:
            raise ModelLoadError(f"malformed checkpoint: weight {name!r}: {exc}") from exc
        loaded.add(target)
    if held is not None:
        raise refuse_quantized_dtype(*held, where, declared)
    if unexpected and strict:
        shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise ModelLoadError(f"checkpoint tensor(s) that Atlas does not know how to use: {shown}. Refusing to "
                             "load a model that may compute something else than the checkpoint means")
    if unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use, e.g. %s",
                       len(unexpected), ", ".join(unexpected[:3]))
    fp8_layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear) and m.fp8_pieces]
    for module_name, module in fp8_layers:  # (a weight is not loaded until its scales are)
        absent = module.missing_fp8_scales()
        if absent:
            parent, _, fused = module_name.rpartition(".")
            pieces = [f"{parent}.{piece_name_of(stacked_params, fused, s)}" if s is not None else module_name
                      for s in absent]
            raise ModelLoadError(f"malformed FP8 checkpoint {where}: {pieces[0]}.weight has no {module.scale_name}"
                                 + (f" ({len(pieces)} such piece(s) in this layer)" if len(pieces) > 1 else ""))
    params = dict(model.named_parameters())  # (layers a quantizer left out have dropped their scales)
    missing = sorted(set(params) - loaded)
    # A fused parameter counts as loaded once any shard arrived: name its missing pieces as the
    # checkpoint names them.
    piece_name = {(fused, shard): ckpt for ckpt, fused, shard in stacked_params}
    for module_name, module in model.named_modules():
        if isinstance(module, MergedLinear) and f"{module_name}.weight" in loaded:
            parent, _, fused = module_name.rpartition(".")
            missing += [f"{parent}.{piece_name.get((fused, shard), fused)}.{kind}"
                        for kind, shard in module.missing_shards()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"malformed checkpoint: missing weight(s) {shown}")


def whole_head(model: nn.Module, given: nn.Module | None, own: nn.Module) -> nn.Module:
    """The LM head an MTP module that reads through its target's should use: `given` (a tensor-parallel driver's
    whole copy) where there is one, else the model's own, which is whole only without tensor parallelism."""
    if given is not None:
        return given
    if model.model.mp.tp_size > 1:
        raise RuntimeError(f"{type(model).__name__}: under tensor parallelism its MTP module needs the driver's whole "
                           "copy of the LM head (its proposer's needs_target_head)")
    return own


class MTPModule(nn.Module):
    """What the multi-token-prediction modules (DeepSeek's, LongCat's; run by speculative/mtp.py) share: they read
    the target's captured last-layer residual stream through its final norm and embed with its embedding (a copy the
    checkpoint carries is used only where it differs), none of which they own."""

    weight_prefix: str

    def share_target(self, final_norm: nn.Module, target_embed: VocabEmbedding, **others: nn.Module) -> None:
        # (kept in dicts, so they are not submodules: not counted, loaded or moved with the module)
        self._target: dict[str, nn.Module] = {"final_norm": final_norm, "embed": target_embed, **others}
        self._embed: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fn": target_embed}
        # the checkpoint's own copies of them, registered once the load is over (_finish_adoption)
        self._adopted: dict[str, nn.Module] = {}

    def target_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        """Captured pre-norm residual streams of the target's last layer -> the normed hidden state."""
        return self._target["final_norm"](captured)

    @property
    def input_width(self) -> int:
        """The width of the hidden-state rows forward takes and returns."""
        return self.config.hidden_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed["fn"](input_ids)

    @property
    def draft_head(self) -> nn.Module:
        """The LM head its drafts are scored with (its own, or the target's)."""
        return self._target["lm_head"]

    def head_input(self, u: torch.Tensor) -> torch.Tensor:
        """The module's output rows u -> the rows draft_head multiplies (its final norm applied, where it has one)."""
        raise NotImplementedError

    def compute_logits(self, u: torch.Tensor) -> torch.Tensor:
        return self.draft_head(self.head_input(u))

    def load_module(self, weights: Iterable[tuple[str, torch.Tensor]],
                    load: Callable[[Iterable[tuple[str, torch.Tensor]]], None]) -> None:
        """Hand `load` the checkpoint tensors under weight_prefix, named after it. A checkpoint with none of them is
        told so by name, rather than by the weights load() found missing."""
        found = 0

        def own() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal found
            for name, tensor in weights:
                if name.startswith(self.weight_prefix):
                    found += 1
                    yield name[len(self.weight_prefix):], tensor

        try:
            load(own())
        except ModelLoadError:
            if not found:
                raise ModelLoadError(f"{self.config.path} has no MTP module (no {self.weight_prefix}* tensors): "
                                     "--speculative mtp needs one; use --speculative ngram") from None
            raise
        self._finish_adoption()

    def _finish_adoption(self) -> None:
        """Register the copies _adopt_embedding / _adopt_head kept (after the load, which checks that every
        parameter registered then was loaded: these were made whole from the checkpoint)."""
        for name, module in self._adopted.items():
            setattr(self, name, module)
        self._adopted.clear()

    def _adopt_embedding(self, tensor: torch.Tensor, name: str = "embed_tokens.weight") -> None:
        """The checkpoint's copy of the embedding (under weight_prefix + name): the module's own where it differs
        from the target's."""
        own = self._own_copy(tensor, self._target["embed"].weight, name, "embedding", VocabEmbedding)
        if own is not None:
            self._adopted["embed_tokens"] = own
            self._embed["fn"] = own

    def _adopt_head(self, tensor: torch.Tensor, name: str = "head.weight") -> None:
        """The checkpoint's copy of the LM head, for a module whose logits are the target's head (lm_head shared)."""
        own = self._own_copy(tensor, self._target["lm_head"].weight, name, "LM head", LMHead)
        if own is not None:
            self._adopted["head"] = own
            self._target["lm_head"] = own

    def _own_copy(self, tensor: torch.Tensor, target: torch.Tensor, name: str, what: str, kind) -> nn.Module | None:
        if tensor.shape != target.shape:
            raise ModelLoadError(f"malformed checkpoint {self.config.path}: {self.weight_prefix}{name} is "
                                 f"{list(tensor.shape)}, the model's {what} {list(target.shape)}")
        if torch.equal(tensor.to(target.device, target.dtype), target):
            return None
        own = kind(*target.shape).to(target.device, target.dtype)
        own.weight.data.copy_(tensor)
        return own
