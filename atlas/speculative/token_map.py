"""A drafter's token map (--speculative-token-map): the token ids it may propose, e.g. a corpus's most frequent
ones. The drafter's LM head then scores those rows only; verification is unchanged, so outputs are too, and a
draft that would have been outside the list is simply never proposed (as in frequency-ranked drafting for
EAGLE drafters)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from atlas.errors import ConfigError


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The ids in `path` (a .pt file holding a 1-D integer tensor or a list, or a .json list) as a sorted int64
    tensor, checked: non-empty, whole numbers in [0, vocab_size), no repeats."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"--speculative-token-map: no file at {path}")
    try:
        if file.suffix == ".json":
            ids = json.loads(file.read_text())
        else:
            ids = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"--speculative-token-map: cannot read {path} ({exc}); give a .pt file holding a 1-D "
                          f"tensor of token ids, or a .json list of them") from exc
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        ids = torch.tensor(ids, dtype=torch.int64)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() \
            or ids.dtype == torch.bool:
        raise ConfigError(f"--speculative-token-map: {path} must hold a 1-D list or tensor of integer token ids")
    ids = ids.to(torch.int64)
    if ids.numel() == 0:
        raise ConfigError(f"--speculative-token-map: {path} holds no token ids")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ConfigError(f"--speculative-token-map: {path} holds id {low if low < 0 else high}, outside the "
                          f"target's vocabulary of {vocab_size}")
    unique = torch.unique(ids)
    if unique.numel() != ids.numel():
        raise ConfigError(f"--speculative-token-map: {path} repeats {ids.numel() - unique.numel()} token ids")
    return unique  # (sorted)
