"""Recurrent state of a hybrid model's linear-attention layers: one slot per running sequence plus a scratch slot,
then (with prefix caching) the snapshot slots, then (with speculative decoding) a backup slot per running slot, all
in the same per-layer pools, allocated beside the KV pages; the scheduler hands out the slot numbers and each step
says which slots to load, save, back up and replay.

Speculative decoding also keeps, per layer and running slot, the inputs of the rows of its last verify step (the
conv input and the raw a and b projections, `verify_rows` rows: 1 + the most drafts). When a verify step rejected
drafts, the next step first restores the slot from its backup and replays the kept rows' inputs through the layer's
convolution and delta rule (GatedDeltaNet.replay): a few launches per layer, where recomputing the kept rows in the
step itself made it a mixed step, run eagerly (BENCHMARKS.md 14: 45.7 ms against 4.75 ms a plain step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atlas.host_copy import to_device
from atlas.kernels.gated_delta_rule import STATE_DTYPE
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear_attention import allocate_state_pools, state_bytes_per_sequence
from atlas.runtime.batch import StepBatch

if TYPE_CHECKING:
    from atlas.models.base import CausalLM


class StateSlots:
    """The recurrent-state slots of a model (none for a model without linear-attention layers)."""

    def __init__(self, model: CausalLM, max_num_seqs: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.dtype = dtype
        self.device = device
        self.specs = model.state_specs()
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        # (the same pools as [layers, slots, ...] stacks, one (conv, delta rule) pair per spec: copies go through them)
        self.stacks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_slots = max_num_seqs + 1 if self.specs else 0
        # ... and, with prefix caching, snapshot slots after them (set_snapshots): snapshot id s is slot
        # max_num_seqs + 1 + s of the same pools.
        self.num_snapshots = 0
        # ... and, with speculative decoding, one backup slot per running slot after those (set_backups): slot s
        # is backed up in slot num_slots + num_snapshots + s before a verify step (StepBatch.state_backups).
        self.num_backups = 0
        # ... and then the saved inputs of each running slot's last verify step, per layer ([slots, verify_rows,
        # conv channels + 2 x value heads]).
        self.verify_rows = 0
        self.verify_inputs: list[torch.Tensor] = []
        # CUDA graphs of the replay, by (kept rows, padded number of slots): each a few launches in every
        # linear-attention layer, which eagerly cost more host time than the graphed verify step they precede.
        self.replay_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replay_sizes: list[int] = []
        self.replay_slots: torch.Tensor | None = None
        self.graphed_replays = 0  # (replays run from those graphs)

    @property
    def scratch_slot(self) -> int | None:
        """The slot that padding sequences of the CUDA graphs' steps read and write (the scheduler never hands it
        out: its slots are 0 .. max_num_seqs - 1); None for a model without recurrent state."""
        return self.num_slots - 1 if self.specs else None

    @property
    def bytes(self) -> int:
        """Bytes of the running sequences' recurrent-state slots (every linear-attention layer), their backups and
        saved verify-step inputs for speculative decoding included; 0 for other models."""
        inputs = sum(self.num_slots * self.verify_rows * spec.verify_row_values for spec in self.specs)
        return (state_bytes_per_sequence(self.specs, self.dtype) * (self.num_slots + self.num_backups)
                + inputs * self.dtype.itemsize)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the recurrent-state snapshot slots kept for prefix caching."""
        return state_bytes_per_sequence(self.specs, self.dtype) * self.num_snapshots

    def set_snapshots(self, n: int) -> None:
        """Keep n recurrent-state snapshots beside the running slots (before the memory plan, which counts them)."""
        # (a pipeline stage without linear-attention layers keeps none, but its page manager counts the model's)
        self.num_snapshots = n if self.model.keeps_recurrent_state else 0

    def set_backups(self, on: bool, verify_rows: int = 0) -> None:
        """Keep a backup slot per running slot and the inputs of `verify_rows` rows of its last verify step
        (speculative decoding: 1 + the most drafts a step verifies; before the memory plan, which counts them)."""
        self.num_backups = self.num_slots if on else 0
        self.verify_rows = verify_rows if on else 0

    def backup_slot(self, slot: int) -> int:
        if not self.num_backups:
            raise RuntimeError("a step backs up recurrent state, but no backup slots were allocated")
        return self.num_slots + self.num_snapshots + slot

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy recurrent state between slots of every linear-attention layer's pools: (from slot, to slot) pairs."""
        if not pairs:
            return
        src = to_device([a for a, _ in pairs], torch.long, self.device)
        dst = to_device([b for _, b in pairs], torch.long, self.device)
        for conv, ssm in self.stacks:
            conv.index_copy_(1, dst, conv.index_select(1, src))
            ssm.index_copy_(1, dst, ssm.index_select(1, src))

    def allocate(self) -> None:
        """The pools of every slot (running, snapshots, backups), bound to the model's recurrent layers."""
        self.model.bind_state_caches(None)
        self.pools, self.stacks = [], []
        self.replay_graphs.clear()
        self.pools, self.stacks = allocate_state_pools(self.specs, self.num_slots + self.num_snapshots
                                                       + self.num_backups, self.dtype, self.device)
        self.verify_inputs = [torch.zeros(self.num_slots, self.verify_rows, spec.verify_row_values, dtype=self.dtype,
                                          device=self.device) for spec in self.specs] if self.verify_rows else []
        self.model.bind_state_caches(self.pools, self.verify_inputs or None)

    def prepare(self, batch: StepBatch, meta: AttentionMetadata) -> None:
        """Before a step's forward: its sequences' slots into `meta`, snapshots loaded into the slots of prefix hits,
        slots restored from (or backed up into) their backups."""
        slots = list(batch.state_slots)
        if len(slots) != batch.num_seqs or any(s is None or not 0 <= s < self.num_slots for s in slots):
            raise RuntimeError(f"a step of a model with recurrent state needs a state slot per sequence, got "
                               f"{slots}")
        meta.state_slots_cpu = slots
        meta.state_slots = to_device(slots, torch.long, self.device)
        # (a prefix hit resumes from the snapshot at its end: loaded before this step's forward reads the slot)
        base = self.num_slots
        # (a snapshot inside a sequence's rows of this step: taken by each linear-attention layer between two passes;
        #  one at the end of its rows: copied after the forward, by save)
        meta.state_splits = [(slots.index(slot), rows, base + snap) for slot, snap, rows in _saves(batch, inside=True)]
        self.copy([(base + snap, slot) for snap, slot in batch.state_loads])
        # (speculative decoding: a slot whose last verify step rejected drafts resumes from before that step and
        #  replays the rows it kept; a slot that verifies drafts now is backed up after that)
        if batch.state_replays:
            self.copy([(self.backup_slot(slot), slot) for slot, _ in batch.state_replays])
            self.replay(batch.state_replays)
        self.copy([(slot, self.backup_slot(slot)) for slot in batch.state_backups])

    def replay(self, replays: list[tuple[int, int]]) -> None:
        """(slot, kept rows): advance each slot by the first rows of its last verify step, from their saved inputs,
        in every linear-attention layer."""
        if any(not 0 < rows <= self.verify_rows for _, rows in replays):
            raise RuntimeError(f"a replay of {replays} rows, but {self.verify_rows} rows of inputs are kept a slot")
        by_rows: dict[int, list[int]] = {}
        for slot, rows in replays:
            by_rows.setdefault(rows, []).append(slot)
        for rows, slots in by_rows.items():
            size = next((s for s in self.replay_sizes if s >= len(slots)), None)
            graph = self.replay_graphs.get((rows, size))
            if graph is None:
                self.model.replay_states(to_device(slots, torch.long, self.device), rows)
                continue
            # (padding replays the scratch slot, whose state nothing reads)
            padded = slots + [self.scratch_slot] * (size - len(slots))
            self.replay_slots[:size].copy_(to_device(padded, torch.long, self.device))
            graph.replay()
            self.graphed_replays += 1

    def replay_graph_bytes(self, max_num_seqs: int) -> int:
        """Device memory the replay's graphs may take (capture_replays): the transient saved inputs, convolution
        and delta-rule outputs of the largest replay, twice for the allocator's rounding, plus 32 MiB."""
        if not self.verify_rows or not self.specs:
            return 0
        values = max(spec.verify_row_values + spec.num_heads * spec.value_dim for spec in self.specs)
        states = max(spec.replay_state_copies * spec.num_heads * spec.key_dim * spec.value_dim for spec in self.specs)
        return (2 * 3 * max_num_seqs * (self.verify_rows - 1) * values * self.dtype.itemsize
                + 2 * max_num_seqs * states * STATE_DTYPE.itemsize + (32 << 20))

    def capture_replays(self, sizes: list[int]) -> None:
        """CUDA graphs of the replay of each number of kept rows (1 .. verify_rows - 1: a step that kept all its
        rows replays nothing) for each padded number of slots in `sizes`, over a static buffer of slots (the warm-up
        and capture runs replay the scratch slot only)."""
        if not self.verify_rows or not self.specs or self.device.type != "cuda":
            return
        from atlas.runtime.cuda_graphs import capture_each

        self.replay_sizes = sorted(sizes)
        self.replay_slots = torch.full((self.replay_sizes[-1],), self.scratch_slot, dtype=torch.long,
                                       device=self.device)
        pool = torch.cuda.graph_pool_handle()
        for rows in range(1, self.verify_rows):
            graphs, _, _ = capture_each(lambda n, rows=rows: self.model.replay_states(self.replay_slots[:n], rows),
                                        self.replay_sizes, pool)
            for n, (graph, _) in graphs.items():
                self.replay_graphs[(rows, n)] = graph

    def save(self, batch: StepBatch) -> None:
        """After a step's forward: the states of the step's (slot, snapshot, rows) saves whose rows are all the
        sequence's rows of the step (the end of a prompt page), kept for the prefix cache; the others were taken
        inside the forward (prepare's state_splits)."""
        self.copy([(slot, self.num_slots + snap) for slot, snap, _ in _saves(batch, inside=False)])


def _saves(batch: StepBatch, inside: bool) -> list[tuple[int, int, int]]:
    """The step's (slot, snapshot, rows) saves taken inside its forward (rows short of the sequence's rows of the
    step), or those at the end of its rows."""
    slots = batch.state_slots
    return [save for save in batch.state_saves if (save[2] < batch.num_scheduled[slots.index(save[0])]) == inside]
