"""Linear layers whose weights may be stored in pieces in the checkpoint, and split across
tensor-parallel ranks.

A fused projection (q|k|v, or gate|up) is one matmul at run time but several tensors on disk; each
parameter carries a `weight_loader(param, tensor, shard_id)` that copies a piece into its rows.

Tensor parallelism (Megatron style): a column-parallel layer keeps a slice of the output rows (each
rank computes part of y, e.g. its own attention heads), a row-parallel one a slice of the input columns
(each rank computes a partial y from its slice of x, and the partials are summed by one all-reduce).
Column then row needs no communication in between, so an attention block and an MLP each cost one
all-reduce. Loaders of sharded parameters take either a tensor or a lazy safetensors slice
(`safe_open(...).get_slice(name)`) and read only this rank's rows or columns from it; they are marked
`takes_slices`, every other loader gets a whole tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atlas.kernels import gemv
from atlas.layers.parallel import ModelParallel, current


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or of a lazy safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def materialize(loaded: Any) -> torch.Tensor:
    """The whole checkpoint tensor (read now if it is a lazy slice)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def narrow_loaded(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Elements start .. start + size - 1 along dim; of a lazy slice, only they are read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def takes_slices(loader):
    """Mark a weight loader that reads what it needs from a lazy safetensors slice."""
    loader.takes_slices = True
    return loader


def _check_shape(expected: tuple[int, ...], loaded: Any, what: str = "") -> None:
    got = loaded_shape(loaded)
    if got != tuple(expected):
        raise ValueError(f"shape mismatch{what}: expected {tuple(expected)}, got {got}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def sharded_loader(dim: int, rank: int, full_size: int):
    """Loader of a parameter that holds piece `rank` (of equal pieces) of the checkpoint tensor along dim,
    whose full length there is full_size."""
    @takes_slices
    def load(param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        expected = list(param.shape)
        expected[dim] = full_size
        _check_shape(tuple(expected), loaded)
        size = param.shape[dim]
        param.data.copy_(narrow_loaded(loaded, dim, rank * size, size))

    return load


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


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

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """With `act` (an HF hidden_act name) this is a [gate | up] projection and the result act(gate) * up.
        F.linear, or on CUDA the small-M GEMV, the activation fused as its epilogue (kernels/gemv.py)."""
        return gemv.linear(x, self.weight, self.bias, act)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    `shards` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its number of output rows, in order.
    `sources` (tensor parallelism) maps a shard id to (first row, rows) of its checkpoint tensor: the
    parameter holds rows first .. first + shards[id] - 1 of it. Without an entry, the whole tensor.
    """

    def __init__(self, in_features: int, shards: dict[object, int], bias: bool = False,
                 sources: dict[object, tuple[int, int]] | None = None):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.shard_sources = dict(sources or {})
        self.weight.weight_loader = self._load_shard
        if bias:
            self.bias.weight_loader = self._load_shard
        self.loaded_shards: dict[str, set] = {"weight": set(), "bias": set()}

    @takes_slices
    def _load_shard(self, param: nn.Parameter, loaded: Any, shard_id: object) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}")
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        first, rows = self.shard_sources.get(shard_id, (0, size))
        _check_shape((rows, *target.shape[1:]), loaded, f" for shard {shard_id!r}")
        target.copy_(narrow_loaded(loaded, 0, first, size))
        self.loaded_shards["weight" if param is self.weight else "bias"].add(shard_id)

    def missing_shards(self) -> list[tuple[str, object]]:
        """(parameter kind, shard id) of every piece no checkpoint tensor filled."""
        kinds = ["weight"] + (["bias"] if self.bias is not None else [])
        return [(kind, s) for kind in kinds for s in self.shard_offsets if s not in self.loaded_shards[kind]]


class ColumnParallelLinear(Linear):
    """Output rows split over the tensor-parallel ranks: y_local = x W_local^T (+ b_local)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, mp: ModelParallel | None = None):
        mp = mp or current()
        super().__init__(in_features, _divide(out_features, mp.tp_size, "output features"), bias)
        if mp.tp_size > 1:
            self.weight.weight_loader = sharded_loader(0, mp.tp_rank, out_features)
            if bias:
                self.bias.weight_loader = sharded_loader(0, mp.tp_rank, out_features)


class RowParallelLinear(Linear):
    """Input columns split over the tensor-parallel ranks: y = all_reduce(x_local W_local^T) (+ b).
    With reduce=False the caller sums the partials (e.g. once for several branches); the bias is added
    once, after the sum. direct=True (with reduce=False) says the caller all-reduces the output as it is,
    next, through mp (e.g. in the following norm), so the projection may send it to the peers as it
    computes it (kernels/peer_all_reduce.py, push_args); it always may when it reduces itself."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True,
                 mp: ModelParallel | None = None, direct: bool = False):
        mp = mp or current()
        super().__init__(_divide(in_features, mp.tp_size, "input features"), out_features, bias)
        self.mp = mp
        self.reduce = reduce
        self.direct = reduce or direct
        if mp.tp_size > 1:
            self.weight.weight_loader = sharded_loader(1, mp.tp_rank, in_features)
            if bias and not reduce:
                raise ValueError("a row-parallel layer with a bias must reduce its own output")

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        if self.mp.tp_size == 1:
            return super().forward(x, act)
        assert act is None, "a row-parallel layer's output is a partial sum: no activation before the all-reduce"
        push = self.mp.fast if self.direct and hasattr(self.mp.fast, "push_args") else None
        y = gemv.linear(x, self.weight, push=push)
        if self.reduce:
            y = self.mp.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y


class MergedColumnParallelLinear(MergedLinear):
    """Column-parallel projections of one input stacked along the output (gate|up): each rank holds its
    slice of every shard."""

    def __init__(self, in_features: int, shards: dict[object, int], bias: bool = False,
                 mp: ModelParallel | None = None):
        mp = mp or current()
        local = {k: _divide(n, mp.tp_size, f"shard {k!r}") for k, n in shards.items()}
        sources = {k: (mp.tp_rank * local[k], n) for k, n in shards.items()} if mp.tp_size > 1 else None
        super().__init__(in_features, local, bias, sources)


class QKVParallelLinear(MergedLinear):
    """The fused q|k|v projection over this rank's heads: num_heads / tp query heads, and its key/value
    heads: num_kv_heads / tp of them, or, when there are fewer KV heads than ranks, the one KV head its
    query heads read (replicated on tp / num_kv_heads ranks, as vLLM does)."""

    def __init__(self, in_features: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 mp: ModelParallel | None = None):
        mp = mp or current()
        tp, rank = mp.tp_size, mp.tp_rank
        heads = _divide(num_heads, tp, "attention heads")
        if num_kv_heads >= tp:
            kv_heads = _divide(num_kv_heads, tp, "key/value heads")
            first_kv = rank * kv_heads
        else:
            if tp % num_kv_heads:
                raise ValueError(f"the tensor-parallel size {tp} is neither a divisor nor a multiple of the "
                                 f"{num_kv_heads} key/value heads")
            kv_heads, first_kv = 1, rank // (tp // num_kv_heads)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        q, kv = heads * head_dim, kv_heads * head_dim
        sources = None
        if tp > 1:
            full_kv = num_kv_heads * head_dim
            sources = {"q": (rank * q, num_heads * head_dim), "k": (first_kv * head_dim, full_kv),
                       "v": (first_kv * head_dim, full_kv)}
        super().__init__(in_features, {"q": q, "k": kv, "v": kv}, bias, sources)
