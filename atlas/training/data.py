"""Packed token streams: documents joined by an end-of-document token, cut into fixed-length windows.

Training windows: each epoch starts at a random offset in [0, seq_len) and takes the non-overlapping
windows of seq_len + 1 tokens (inputs and their next-token labels) in a random order; the order and
offset come from (seed, epoch) alone, so a run is the same whatever its length. Windows cross
document boundaries, as usual for packed pre-training: the model learns what follows `<|endoftext|>`.

Evaluation windows: the held-out stream in consecutive windows, so that every token after the first
is predicted exactly once (the last window may be shorter).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


def pack_documents(token_ids: Sequence[Sequence[int]], eos_id: int) -> np.ndarray:
    """One int32 stream: doc0, eos, doc1, eos, ..."""
    total = sum(len(t) + 1 for t in token_ids)
    out = np.empty(total, dtype=np.int32)
    pos = 0
    for ids in token_ids:
        n = len(ids)
        out[pos:pos + n] = ids
        out[pos + n] = eos_id
        pos += n + 1
    return out


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64
    labels: torch.Tensor  # [B, L] int64, input_ids shifted left by one

    @property
    def num_tokens(self) -> int:
        return self.labels.numel()


class PackedWindows:
    """Training batches of windows from a token stream, shuffled per epoch, endless."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, batch_size: int, seed: int = 0,
                 device: torch.device | str = "cpu"):
        self.tokens = torch.as_tensor(tokens).to(device=device, dtype=torch.int64)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.device = torch.device(device)
        # Windows in an epoch that starts at the largest offset: the same count for every epoch.
        self.windows_per_epoch = (len(self.tokens) - (seq_len - 1) - 1) // seq_len
        if self.windows_per_epoch < batch_size:
            raise ValueError(f"{len(self.tokens)} tokens give {self.windows_per_epoch} windows of {seq_len} per epoch, "
                             f"fewer than one batch of {batch_size}: use more data or smaller --seq-len/--batch-size")
        self.steps_per_epoch = self.windows_per_epoch // batch_size
        self.epoch = 0
        self._arange = torch.arange(seq_len + 1, device=self.device)

    def epoch_starts(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        offset = int(torch.randint(0, self.seq_len, (1,), generator=g))
        starts = offset + self.seq_len * torch.arange(self.windows_per_epoch)
        return starts[torch.randperm(self.windows_per_epoch, generator=g)]

    def __iter__(self) -> Iterator[Batch]:
        while True:
            starts = self.epoch_starts(self.epoch).to(self.device)
            for i in range(self.steps_per_epoch):
                rows = self.tokens[starts[i * self.batch_size:(i + 1) * self.batch_size, None] + self._arange]
                yield Batch(rows[:, :-1], rows[:, 1:])
            self.epoch += 1


def eval_windows(tokens: np.ndarray | torch.Tensor, seq_len: int, max_tokens: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(full windows [N, seq_len + 1], the shorter last window [k + 1] or None) covering
    tokens[: max_tokens + 1]: every token after the first is a label exactly once."""
    tokens = torch.as_tensor(tokens).to(torch.int64)
    if max_tokens is not None:
        tokens = tokens[: max_tokens + 1]
    n_labels = len(tokens) - 1
    n_full = n_labels // seq_len
    idx = torch.arange(n_full)[:, None] * seq_len + torch.arange(seq_len + 1)
    full = tokens[idx] if n_full else tokens.new_zeros((0, seq_len + 1))
    rest = tokens[n_full * seq_len:]
    return full, (rest if len(rest) > 1 else None)


def eval_labels(tokens: np.ndarray | torch.Tensor, max_tokens: int | None = None) -> np.ndarray:
    """The labels `eval_windows` covers, in order (for baselines scored on the same tokens)."""
    arr = np.asarray(tokens)
    if max_tokens is not None:
        arr = arr[: max_tokens + 1]
    return arr[1:]
