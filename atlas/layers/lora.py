"""LoRA adapters on linear layers, many in one batch (multi-LoRA serving).

A layer that takes adapters keeps every adapter slot's low-rank pair beside its own weight: A [pieces, slots, r, in]
and, for each output piece (q, k, v of a fused q|k|v; gate, up of gate|up; the whole layer otherwise), B [rows,
slots, r], the adapter's scale (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into B. A smaller rank fills the
first rows of its slot's r and leaves the rest zero.

Each step, every token row names its slot (`LoraSlots.row_mask`: row t's column s is set when it reads slot s;
none for the base model). The layer adds
    delta = mask(x A_all^T) B_all^T
where x A_all^T is every slot's shrink at once ([T, pieces * slots * r]) and the mask keeps, in each row, only its
own slot's columns (torch.where, not a product: another slot's overflow cannot reach the row as a NaN); each piece's
expand then reads its own columns in place and adds into its own output rows (one addmm). A layer of P pieces runs
2 + P kernels whatever the mix of adapters in the batch, in shapes fixed by the slot count, so CUDA graphs capture
them as they are; a row of the base model gets an exact zero and so its base output unchanged. The cost grows with
the slot count (--max-loras) times the rank (--max-lora-rank), not with the adapters a step uses.

A step in which no row reads an adapter skips the slots (`LoraSlots.apply` is False: the layers return their base
output, the same bits as the zero delta would give); under CUDA graphs such steps replay a second set of graphs
captured without the slots' kernels (runtime/graph_plan.py), since a graph replays what it captured.

Tensor parallelism: a column-parallel layer keeps A whole and its rows of B; a row-parallel one its columns of A
and B whole, and adds its delta to its partial sum before the all-reduce (the sum of the ranks' (x_i A_i^T) B^T is
x A^T B^T).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class LoraSlots:
    """The adapter slots of a model: their count, the largest rank they hold, and which slot each token row of the
    step reads (one device buffer for every layer, that the step graphs capture and the runner refills)."""

    def __init__(self, num_slots: int, max_rank: int, max_rows: int, device: torch.device):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.row_mask = torch.zeros(max_rows, num_slots, dtype=torch.bool, device=device)
        self._slot_numbers = torch.arange(1, num_slots + 1, dtype=torch.int64)
        self._marked = False  # whether row_mask holds any row's slot (else it is all False)
        # Whether this step's layers add their deltas: some row reads an adapter (set_rows), or a graph set that
        # replays them is being captured (applying).
        self.apply = False

    def masks(self, rows: int) -> torch.Tensor:
        """[rows, 1, slots, 1] bool: row t reads slot s (broadcast over pieces and rank)."""
        if rows > self.row_mask.shape[0]:
            raise RuntimeError(f"LoRA: a step of {rows} rows is longer than the {self.row_mask.shape[0]} rows of "
                               "the slot table")
        return self.row_mask[:rows, None, :, None]

    def set_rows(self, slot_per_seq: list[int], rows_per_seq: list[int]) -> None:
        """This step's rows: sequence i's rows_per_seq[i] rows (in order, back to back) read slot_per_seq[i] - 1
        (0: none); the rows past them none."""
        self.apply = any(slot_per_seq)
        if not self._marked and not self.apply:
            return  # (a step of the base model after another: the table is all False already)
        table = self.row_mask
        total = sum(rows_per_seq)
        if total > table.shape[0]:
            raise RuntimeError(f"LoRA: a step of {total} rows is longer than the {table.shape[0]} rows of the slot "
                               "table")
        slots = torch.repeat_interleave(torch.tensor(slot_per_seq, dtype=torch.int64),
                                        torch.tensor(rows_per_seq, dtype=torch.int64))
        table.zero_()
        table[:total].copy_(slots[:, None] == self._slot_numbers, non_blocking=True)
        self._marked = self.apply

    @contextmanager
    def applying(self, apply: bool) -> Iterator[None]:
        """The layers add their deltas (apply) or not, whatever the table holds, for the forwards inside (a graph
        set's capture)."""
        before, self.apply = self.apply, apply
        try:
            yield
        finally:
            self.apply = before


class LoraWeights:
    """One linear layer's adapter slots (module docstring). pieces: (shard id, first output row, rows) of each
    output piece, in the layer's own rows (this rank's under tensor parallelism)."""

    def __init__(self, slots: LoraSlots, in_features: int, pieces: list[tuple[object, int, int]],
                 dtype: torch.dtype, device: torch.device):
        self.slots = slots
        self.in_features = in_features
        self.pieces = pieces
        self.piece_index = {shard: p for p, (shard, _, _) in enumerate(pieces)}
        S, P, r = slots.num_slots, len(pieces), slots.max_rank
        self.a = torch.zeros(P, S, r, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(rows, S, r, dtype=dtype, device=device) for _, _, rows in pieces]

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + sum(b.numel() * b.element_size() for b in self.b)

    def clear_slot(self, slot: int) -> None:
        self.a[:, slot].zero_()
        for b in self.b:
            b[:, slot].zero_()

    def set_piece(self, slot: int, shard: object, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Slot `slot`'s pair for output piece `shard`: a [r, in] (this rank's columns), b [rows, r] (its rows)."""
        p = self.piece_index[shard]
        rank = a.shape[0]
        self.a[p, slot, :rank].copy_(a)
        self.b[p][:, slot, :rank].copy_(b.to(torch.float32) * scale)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter delta (y: the layer's output for x, [T, out]; changed in place)."""
        if not self.slots.apply:
            return y  # (no row reads an adapter: every delta is zero)
        S, P, r = self.slots.num_slots, len(self.pieces), self.slots.max_rank
        x2 = x.reshape(-1, self.in_features)
        T = x2.shape[0]
        shrink = torch.matmul(x2, self.a.view(P * S * r, self.in_features).t()).view(T, P, S, r)
        shrink = torch.where(self.slots.masks(T), shrink, 0).view(T, P, S * r)
        y2 = y.view(T, -1)
        for p, (_, first, rows) in enumerate(self.pieces):
            # (piece p's columns in place: a row stride of P * S * r, unit column stride)
            y2[:, first: first + rows].addmm_(shrink[:, p], self.b[p].view(rows, S * r).t())
        return y
