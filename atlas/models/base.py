"""What every model class offers the runtime, and the shared weight-routing helper."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from atlas.errors import ModelLoadError
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear import MergedLinear, default_weight_loader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one layer's cache entry per token: kv_heads x head_dim for K and again for V."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


class CausalLM(nn.Module):
    """Interface of a target model. The runtime calls nothing else."""

    num_layers: int

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: list[tuple[str, str, object]],
    skip_suffixes: tuple[str, ...] = (),
) -> None:
    """Route checkpoint tensors to parameters; fused parameters take their pieces by shard id.

    Raises ModelLoadError naming the first missing or mis-shaped weights.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        target, shard = name, None
        for ckpt_piece, fused_piece, shard_id in stacked_params:
            if f".{ckpt_piece}." in name:
                target, shard = name.replace(f".{ckpt_piece}.", f".{fused_piece}."), shard_id
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        try:
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as exc:
            raise ModelLoadError(f"malformed checkpoint: weight {name!r}: {exc}") from exc
        loaded.add(target)
    if unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use, e.g. %s",
                       len(unexpected), ", ".join(unexpected[:3]))
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
