"""A drafter's token map (--speculative-token-map): the token ids it may propose, e.g. a corpus's most frequent
ones. The drafter's LM head then scores those rows only; verification is unchanged, so outputs are too, and a
draft that would have been outside the list is simply never proposed (as in frequency-ranked drafting for
EAGLE drafters)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from atlas.errors import ConfigError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The ids in `path` (a .pt file holding a 1-D integer tensor or a list, or a .json list) as a sorted int64
    tensor, checked: non-empty, whole numbers in [0, vocab_size), no repeats."""
    import torch
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


@dataclass(frozen=True)
class MappedHead:
    """A drafter's token map on its device: the ids, and its LM head's rows for them (copied once)."""

    ids: torch.Tensor  # [n] sorted token ids
    rows: torch.Tensor  # [n, hidden]

    @classmethod
    def make(cls, rows: torch.Tensor | None, token_ids: torch.Tensor, device: torch.device, dtype: torch.dtype,
             drafter: str) -> MappedHead:
        """`rows`: the drafter's LM head rows for token_ids (None: its head is not whole on this device, refused)."""
        if rows is None:
            raise ConfigError(f"--speculative-token-map needs the {drafter}'s whole LM head on the drafting device, "
                              "which this model or layout does not give it; run without it")
        mapped = cls(token_ids.to(device), rows.to(device, dtype))
        logger.info("%s drafts from a token map of %d ids (the LM head's rows for them: %.0f MiB)", drafter,
                    token_ids.numel(), mapped.nbytes / 2**20)
        return mapped

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows the LM head takes -> for each, the map's id of the greatest logit among the map's."""
        import torch

        return self.ids[torch.nn.functional.linear(hidden, self.rows).argmax(-1)]


def corpus_texts(paths: list[str]) -> Iterator[str]:
    """The texts of corpus files: a .jsonl file's records ("text", "prompt", "completion", or the "content" of
    each of its "messages"), any other file whole."""
    for name in paths:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"--corpus: no file at {name}")
        if path.suffix != ".jsonl":
            yield path.read_text(errors="replace")
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--corpus {name}, line {number}: not JSON ({exc})") from None
            if isinstance(record, str):
                yield record
                continue
            for key in ("text", "prompt", "completion"):
                if isinstance(record.get(key), str):
                    yield record[key]
            for message in record.get("messages") or []:
                if isinstance(message, dict) and isinstance(message.get("content"), str):
                    yield message["content"]


def most_frequent_tokens(token_lists: Iterable[list[int]], vocab_size: int, size: int, always: Iterable[int] = ()
                         ) -> tuple[torch.Tensor, float]:
    """The `size` ids seen most often (ties: the lower id), with `always` (e.g. end-of-sequence tokens) in
    any case; -> (sorted ids, the share of the counted tokens they cover)."""
    import torch
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in token_lists:
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    total = int(counts.sum())
    if total == 0:
        raise ConfigError("--corpus holds no text to count tokens in")
    forced = sorted({i for i in always if 0 <= i < vocab_size})
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[forced] = True
    order = torch.argsort(-counts, stable=True)  # (most frequent first; equal counts by id)
    keep[order[: max(0, size - len(forced))]] = True
    if int(keep.sum()) < size:  # (forced ids that were frequent anyway left room)
        keep[order[~keep[order]][: size - int(keep.sum())]] = True
    ids = keep.nonzero().flatten()
    return ids, float(counts[ids].sum()) / total
