"""The hidden-state capture buffer: residual streams of chosen target layers, kept for a proposer.

It is part of the memory plan. Rightsizing after a proposer is installed only ever shrinks it, and
frees the old buffer before allocating the new one, so the two never coexist. If even that allocation
fails, capture of prefill rows turns itself off (one warning) and the buffer keeps only what decode
and verify rows need; serving goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

Allocator = Callable[..., torch.Tensor]


class HiddenCapture:
    def __init__(self, layers: tuple[int, ...], hidden_size: int, rows: int, min_rows: int, dtype: torch.dtype,
                 device: torch.device, allocator: Allocator = torch.empty):
        self.layers = layers
        self.width = len(layers) * hidden_size
        self.min_rows = min_rows  # decode + verify rows of a full batch
        self.dtype = dtype
        self.device = device
        self.allocator = allocator
        self.prefill_enabled = True
        self.buffer: torch.Tensor | None = self._allocate(rows)

    @staticmethod
    def bytes_for(num_layers: int, hidden_size: int, rows: int, dtype: torch.dtype) -> int:
        return rows * num_layers * hidden_size * torch.empty((), dtype=dtype).element_size()

    @property
    def rows(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[0]

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def _allocate(self, rows: int) -> torch.Tensor:
        return self.allocator((rows, self.width), dtype=self.dtype, device=self.device)

    def rightsize(self, rows: int) -> None:
        """Shrink to `rows` (never grow): free first, then allocate."""
        rows = max(rows, self.min_rows)
        if rows >= self.rows:
            return
        self.buffer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            self.buffer = self._allocate(rows)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            logger.warning("could not allocate the %d-row hidden-state capture buffer (%s): the drafter gets no "
                           "prefill context from now on; decoding stays correct, with lower acceptance", rows, exc)
            self.prefill_enabled = False
            self.buffer = self._allocate(self.min_rows)

    def store(self, captured: torch.Tensor, rows: torch.Tensor | int) -> torch.Tensor:
        """Copy rows of this step's captured [T, width] into the buffer: those `rows` lists (a tensor of row ids), or
        the first `rows` in order (an int); -> the stored view."""
        if isinstance(rows, int):
            out = self.buffer[:rows]
            out.copy_(captured[:rows])
        else:
            out = self.buffer[: rows.numel()]
            torch.index_select(captured, 0, rows, out=out)
        return out
