"""LoRA adapters on linear layers, many in one batch (multi-LoRA serving).

A layer that takes adapters keeps every adapter slot's low-rank pair beside its own weight: A [slots, pieces, r, in]
and, for each output piece (q, k, v of a fused q|k|v; gate, up of gate|up; the whole layer otherwise), B [rows,
slots, r], the adapter's scale (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into B. A smaller rank fills the
first rows of its slot's r and leaves the rest zero.

Each step, every token row names its slot (`LoraSlots.row_slots`: 0 the base model, s + 1 slot s). The layer adds
    delta = mask(x A_all^T) B_all^T
where x A_all^T is every slot's shrink at once ([T, slots * pieces * r]) and the mask keeps, in each row, only its
own slot's columns (torch.where, not a product: another slot's overflow cannot reach the row as a NaN). Two
matmuls a layer whatever the mix of adapters in the batch, shapes fixed by the slot count, so CUDA graphs capture
it as they are; a row of the base model gets an exact zero and so its base output unchanged. The cost grows with
the slot count (--max-loras) times the rank (--max-lora-rank), not with the adapters a step uses.

Tensor parallelism: a column-parallel layer keeps A whole and its rows of B; a row-parallel one its columns of A
and B whole, and adds its delta to its partial sum before the all-reduce (the sum of the ranks' (x_i A_i^T) B^T is
x A^T B^T).
"""

from __future__ import annotations

import torch


class LoraSlots:
    """The adapter slots of a model: their count, the largest rank they hold, and which slot each token row of the
    step reads (one device buffer for every layer, that the step graphs capture and the runner refills)."""

    def __init__(self, num_slots: int, max_rank: int, max_rows: int, device: torch.device):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.row_slots = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._slot_numbers = torch.arange(1, num_slots + 1, dtype=torch.int64, device=device)

    def row_masks(self, rows: int) -> torch.Tensor:
        """[rows, slots, 1] bool: row t reads slot s."""
        if rows > self.row_slots.shape[0]:
            raise RuntimeError(f"LoRA: a step of {rows} rows is longer than the {self.row_slots.shape[0]} rows of "
                               "the slot table")
        return (self.row_slots[:rows, None] == self._slot_numbers)[:, :, None]

    def set_rows(self, slot_per_seq: list[int], rows_per_seq: list[int]) -> None:
        """This step's rows: sequence i's rows_per_seq[i] rows (in order, back to back) read slot_per_seq[i] - 1
        (0: none); the rows past them none."""
        table = self.row_slots
        total = sum(rows_per_seq)
        if total > table.shape[0]:
            raise RuntimeError(f"LoRA: a step of {total} rows is longer than the {table.shape[0]} rows of the slot "
                               "table")
        host = torch.repeat_interleave(torch.tensor(slot_per_seq, dtype=torch.int64),
                                       torch.tensor(rows_per_seq, dtype=torch.int64))
        table.zero_()
        table[:total].copy_(host, non_blocking=True)


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
        self.a = torch.zeros(S, P, r, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(rows, S, r, dtype=dtype, device=device) for _, _, rows in pieces]

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + sum(b.numel() * b.element_size() for b in self.b)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[:, slot].zero_()

    def set_piece(self, slot: int, shard: object, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Slot `slot`'s pair for output piece `shard`: a [r, in] (this rank's columns), b [rows, r] (its rows)."""
        p = self.piece_index[shard]
        rank = a.shape[0]
        self.a[slot, p, :rank].copy_(a)
        self.b[p][:, slot, :rank].copy_(b.to(torch.float32) * scale)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter delta (y: the layer's output for x, [T, out]; changed in place)."""
        S, P, r = self.slots.num_slots, len(self.pieces), self.slots.max_rank
        x2 = x.reshape(-1, self.in_features)
        T = x2.shape[0]
        shrink = torch.matmul(x2, self.a.view(S * P * r, self.in_features).t()).view(T, S, P, r)
        shrink = torch.where(self.slots.row_masks(T)[:, :, :, None], shrink, 0)
        y2 = y.view(T, -1)
        for p, (_, first, rows) in enumerate(self.pieces):
            own = shrink[:, :, p].reshape(T, S * r)
            y2[:, first: first + rows] += torch.matmul(own, self.b[p].view(rows, S * r).t())
        return y
