"""Linear layers whose weights may be stored in pieces in the checkpoint.

A fused projection (q|k|v, or gate|up) is one matmul at run time but several tensors on disk; each
parameter carries a `weight_loader(param, tensor, shard_id)` that copies a piece into its rows.
"""

from __future__ import annotations

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b). A plain projection loaded from one checkpoint tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    `shards` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its number of output rows, in order.
    """

    def __init__(self, in_features: int, shards: dict[object, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.weight.weight_loader = self._load_shard
        if bias:
            self.bias.weight_loader = self._load_shard
        self.loaded_shards: dict[str, set] = {"weight": set(), "bias": set()}

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}")
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch for shard {shard_id!r}: expected {tuple(target.shape)}, got {tuple(loaded.shape)}")
        target.copy_(loaded)
        self.loaded_shards["weight" if param is self.weight else "bias"].add(shard_id)

    def missing_shards(self) -> list[tuple[str, object]]:
        """(parameter kind, shard id) of every piece no checkpoint tensor filled."""
        kinds = ["weight"] + (["bias"] if self.bias is not None else [])
        return [(kind, s) for kind in kinds for s in self.shard_offsets if s not in self.loaded_shards[kind]]
