"""Token embedding and the language-model head (which may share the embedding's weight).

With tensor parallelism both are split by vocabulary: rank r holds rows r * S .. (r + 1) * S - 1 with
S = ceil(vocab / tp) (the last rank's tail past the vocabulary is zero padding). The embedding looks up
the ids in its range, zeros the others and all-reduces; the LM head computes the logits of its range,
all-gathers them and drops the padding, so every rank gets the full [rows, vocab] logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atlas.kernels import gemv
from atlas.layers.linear import Linear, default_weight_loader, loaded_shape, narrow_loaded, takes_slices
from atlas.layers.parallel import ModelParallel, current


def _vocab_loader(vocab_size: int, mp: ModelParallel):
    @takes_slices
    def load(param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        rows, hidden = param.shape
        if loaded_shape(loaded) != (vocab_size, hidden):
            raise ValueError(f"shape mismatch: expected {(vocab_size, hidden)}, got {loaded_shape(loaded)}")
        first = mp.tp_rank * rows
        n = max(0, min(rows, vocab_size - first))
        param.data[n:].zero_()
        if n:
            param.data[:n].copy_(narrow_loaded(loaded, 0, first, n))

    return load


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, mp: ModelParallel | None = None):
        super().__init__()
        self.mp = mp = mp or current()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // mp.tp_size)
        self.vocab_start = mp.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size))
        self.weight.weight_loader = default_weight_loader if mp.tp_size == 1 else _vocab_loader(vocab_size, mp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.mp.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.shard_size)
        out = nn.functional.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.mp.all_reduce(out)


class LMHead(nn.Module):
    """hidden -> vocabulary logits. With `tied_to`, it reuses the embedding's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 mp: ModelParallel | None = None):
        super().__init__()
        self.mp = mp = mp or current()
        self.vocab_size = vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(-(-vocab_size // mp.tp_size), hidden_size))
            self.weight.weight_loader = default_weight_loader if mp.tp_size == 1 else _vocab_loader(vocab_size, mp)

    def weight_rows(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """A copy of the weight's rows for these token ids ([len, hidden]), whose product with a hidden row
        gives those tokens' logits; None when this rank holds a vocabulary shard only."""
        if self.mp.tp_size != 1:
            return None
        return self.weight.detach().index_select(0, token_ids.to(self.weight.device))

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """-> [..., vocab] logits, written into `out` when given (a CUDA graph's buffer shared by its sizes)."""
        # (F.linear, or the small-M GEMV where it was measured faster at load: kernels/gemv.py)
        if self.mp.tp_size == 1:
            return gemv.linear(hidden, self.weight, out=out)
        logits = self.mp.all_gather_last(gemv.linear(hidden, self.weight))[..., : self.vocab_size]
        return logits if out is None else out.copy_(logits)


def linear_weights(model: nn.Module) -> dict[tuple[int, int, torch.dtype], list[torch.Tensor]]:
    """The CUDA weights the model's linear layers, LM head and MoE routers (modules that say `gemv_weight`) would run
    through `gemv.linear`, grouped by (N, K, dtype): what `gemv.tune_shapes` times at load."""
    groups: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if ((isinstance(module, (Linear, LMHead)) or getattr(module, "gemv_weight", False))
                and isinstance(w, torch.Tensor) and w.is_cuda and w.dim() == 2
                and w.dtype in gemv.DTYPES and w.is_contiguous()):
            groups.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w.detach())
    return groups
