"""The model-parallel view a model is built with: which tensor-parallel and pipeline rank this process
is, and the device process group its layers all-reduce and all-gather in.

`runtime/parallel_groups.py` creates the process groups and sets this view while the model (and a drafter)
is built; layers read it once, in their constructors, and keep what they need. Outside that (every
single-device engine) the view is tensor and pipeline size 1, and no layer calls a collective, so the
single-GPU path is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelParallel:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of this rank's tensor-parallel peers
    # An all-reduce faster than NCCL's for the tensors it takes (fast.takes(x)), e.g. through symmetric
    # memory (runtime/parallel_groups.py); None: NCCL (gloo on CPU) for every tensor.
    fast: Any = None
    # --enable-expert-parallel: the routed experts spread whole over the tensor-parallel ranks (layers/moe.py)
    expert_parallel: bool = False

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the tensor-parallel ranks (x itself at size 1; x may be reduced in place)."""
        if self.tp_size == 1:
            return x
        if self.fast is not None and self.fast.takes(x):
            return self.fast(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] pieces of every tensor-parallel rank -> [..., tp_size * n], rank order."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((self.tp_size * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x, group=self.tp_group)
        return out.view(self.tp_size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


_current = ModelParallel()


def current() -> ModelParallel:
    return _current


@contextlib.contextmanager
def building_with(view: ModelParallel | None) -> Iterator[None]:
    """Layers constructed inside take this view (None: single device)."""
    global _current
    previous = _current
    _current = view or ModelParallel()
    try:
        yield
    finally:
        _current = previous


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of piece `index` when `total` items go to `parts` pieces, earlier pieces taking
    one fewer when it does not divide (so a first pipeline stage, which also holds the embedding and the
    LM head, gets the fewer layers)."""
    base, extra = divmod(total, parts)
    small = parts - extra  # pieces of `base` items come first
    start = index * base + max(0, index - small)
    return start, base + (1 if index >= small else 0)
