"""CUDA graphs of mixed steps: sequences with different query lengths in one step (a new prompt's chunk beside
other requests' decodes or verify rows; a chunked prompt's last piece beside decodes).

Under continuous batching such a step comes each time a request joins the running ones. Run eagerly, its
forward launches every kernel of every layer from Python, which on a small model (or a busy host) costs
several times the device's work: the speculative bench at 16 requests in flight measured 6.5 ms of host for
each eager forward of the shipped model on the H200, against 0.1 ms for a graph replay. So steps of up to
`max_tokens` rows replay a graph captured for the next token count of a ladder, with static buffers laid out
for the most sequences a step can hold:

- rows past the step's own belong to one padding sequence (index S - 2), which reads and writes only the
  scratch pages (its page-table row cycles through them);
- the other unused sequences (up to index S - 1) compute nothing: no query rows, no keys;
- the attention kernel's program map is as long as the largest step of that token count can need; programs
  past the step's own point at the last, empty, sequence and return at once;
- logits are made for the sampled rows only (gathered by a static row index, padded with row 0).

A hybrid model's linear-attention layers read their sequences from static buffers too (MixedGraphStates: each
sequence's rows, state slot and any prefix-cache snapshot inside its rows) and advance each state by its rows
through the recurrent kernel, token by token, where an eager step chunks a prompt; so only steps whose sequences
have at most `--tuning mixed_graph_recurrent_rows` rows take these graphs. With speculative decoding the rows of a
sequence that may be verifying drafts also keep their inputs for a replay (as the eager step does), through a row
index into the layers' verify-input buffers.

Without `use_graphs` (CPU), `run` executes the forward on the same static buffers, so the padding and
buffer logic is tested where no GPU is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from atlas.host_copy import to_device
from atlas.kernels.gated_delta_rule import RecurrentRows
from atlas.layers.attention import AttentionMetadata
from atlas.layers.attention_backend import AttentionBackend, MixedGraphAttention
from atlas.runtime.cuda_graphs import capture_each

logger = logging.getLogger(__name__)

# Token counts of the captured mixed steps: fine steps where a graph saves most against the step's device work.
_TOKEN_LADDER = (32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024)
DEFAULT_MAX_TOKENS = 1024

# forward(input_ids [T], positions [T], meta, sample_idx [R]) -> (greedy [R], logits [R, V], captured [T, ...] or None)
MixedForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], tuple]


def mixed_token_sizes(max_tokens: int, boundaries: tuple[int, ...] = ()) -> list[int]:
    """The captured token counts up to max_tokens; `boundaries`: row counts at which the model's kernels change
    (GraphPlan.kernel_row_boundaries), captured too, so that a step padded to its graph's size takes the kernels
    its eager run would."""
    sizes = sorted({s for s in (*_TOKEN_LADDER, *boundaries) if s < max_tokens})
    return sizes + [max_tokens]


class MixedGraphStates:
    """The linear-attention layers' view of a mixed step (kernels/gated_delta_rule.RecurrentRows) in static
    buffers: entries 0 .. max_seqs - 1 for the step's sequences, entry max_seqs for the padding sequence (its rows
    pad the step to its graph's size; it has no rows of state to advance), all filled by one upload a step."""

    _FIELDS = 6  # starts, counts, slots, keep, snap_rows, snap_slots; then the 2S conv entries' 5; then row_seq

    def __init__(self, max_tokens: int, max_seqs: int, scratch_slot: int, max_rows: int, device: torch.device,
                 verify_rows: int = 0):
        """max_rows: the most rows a sequence may have in a step these buffers take; verify_rows: speculative
        decoding's rows of inputs kept a slot (runtime/state_slots.py; 0: none)."""
        self.max_seqs, self.scratch_slot, self.max_rows = max_seqs, scratch_slot, max_rows
        self.verify_rows = verify_rows
        S = self.num_entries = max_seqs + 1
        T = self.max_tokens = max_tokens
        self.flat = torch.zeros(self._FIELDS * S + 5 * 2 * S + T * (2 if verify_rows else 1), dtype=torch.long,
                                device=device)
        table = self.flat[: self._FIELDS * S].view(self._FIELDS, S)
        conv = self.flat[self._FIELDS * S: (self._FIELDS + 10) * S].view(5, 2 * S)
        rest = self.flat[(self._FIELDS + 10) * S:]
        self._rows = RecurrentRows(rest[:T], *table, conv_entries=tuple(conv),
                                   save_index=rest[T:] if verify_rows else None)
        self.device = device

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a step can take these buffers: no sequence over max_rows rows, at most one snapshot inside a
        sequence's rows."""
        qsl = meta.query_start_loc_cpu
        rows = [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
        if meta.state_slots_cpu is None or max(rows) > self.max_rows:
            return False
        seqs = [i for i, _, _ in meta.state_splits]
        return len(seqs) == len(set(seqs))

    def load(self, size: int, meta: AttentionMetadata | None) -> None:
        """The step `meta` describes (None: no sequence, as at capture), padded to `size` rows."""
        S, pad, scratch = self.num_entries, self.max_seqs, self.scratch_slot
        qsl = meta.query_start_loc_cpu if meta is not None else [0]
        n, rows = len(qsl) - 1, qsl[-1]
        counts = [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)] + [0] * (S - n)
        starts = list(qsl[:n]) + [0] * (S - n)
        starts[pad] = rows
        slots = (list(meta.state_slots_cpu) if n else []) + [scratch] * (S - n)
        keep = [int(meta.seq_lens_cpu[i] > counts[i]) for i in range(n)] + [0] * (S - n)
        snap_rows, snap_slots = [0] * S, [scratch] * S
        for i, at, slot in (meta.state_splits if n else ()):
            snap_rows[i], snap_slots[i] = at, slot
        consumed = [c if i < n else -1 for i, c in enumerate(counts)] + [r if r else -1 for r in snap_rows]
        row_seq = [i for i in range(n) for _ in range(counts[i])] + [pad] * (size - rows)
        host = (starts + counts + slots + keep + snap_rows + snap_slots
                + starts * 2 + consumed + slots * 2 + keep * 2 + slots + snap_slots + row_seq)
        if self.verify_rows:
            # (the rows of a sequence of 2 .. verify_rows rows into its slot's rows; the others into the scratch's)
            V, sink = self.verify_rows, scratch * self.verify_rows
            host += [0] * (self.max_tokens - size)  # (row_seq's unused tail: the save index starts after it)
            host += [slots[i] * V + j if 1 < counts[i] <= V else sink for i in range(n) for j in range(counts[i])]
            host += [sink] * (size - rows)
        self.flat[: len(host)].copy_(to_device(host, torch.long, self.device))

    def view(self, size: int) -> RecurrentRows:
        r = self._rows
        return RecurrentRows(r.row_seq[:size], r.starts, r.counts, r.slots, r.keep, r.snap_rows, r.snap_slots,
                             r.conv_entries, None if r.save_index is None else r.save_index[:size])


class MixedStepGraphs:
    """Static inputs (token ids, positions, sampled rows, and the attention backend's `attn`) and the graphs
    replayed over them."""

    def __init__(self, forward: MixedForwardFn, attention: AttentionBackend, scratch_pages: list[int],
                 max_pages_per_seq: int, max_seqs: int, max_tokens: int, max_sample_rows: int,
                 device: torch.device, use_graphs: bool = True, window_scratch_pages: list[int] | None = None,
                 states: MixedGraphStates | None = None, boundaries: tuple[int, ...] = ()):
        """window_scratch_pages: KV cache groups: the window group's scratch pages (its padding rows go there).
        states: a hybrid model's linear-attention layers' buffers. boundaries: mixed_token_sizes'."""
        self.forward = forward
        self.states = states
        self.sizes = mixed_token_sizes(max_tokens, boundaries)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = max_seqs
        self.max_sample_rows = max_sample_rows
        self.use_graphs = use_graphs
        T = self.max_tokens
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(T, **long)
        self.positions = torch.zeros(T, **long)
        # The padding sequence's rows: position 0 each (any position would do, its outputs are never read, but
        # one past the model's context would index past a rotary table); its slots cycle through the scratch pages.
        self.pad_positions = torch.zeros(T, **long)
        self.attn: MixedGraphAttention = attention.mixed_graph_attention(T, max_seqs, scratch_pages,
                                                                         max_pages_per_seq, device, window_scratch_pages)
        self.sample_idx = torch.zeros(max(1, min(T, max_sample_rows)), **long)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None
        self.captured_mib = 0.0  # (what capturing reserved: tests read it)
        self.steps_run = 0  # (steps that took this path: tests read it)

    # ------------------------------------------------------------------ which steps
    def size_for(self, num_tokens: int) -> int:
        return next(s for s in self.sizes if s >= num_tokens)

    def sample_rows_for(self, size: int) -> int:
        return min(size, self.sample_idx.numel())

    def can_run(self, meta: AttentionMetadata, num_sample_rows: int) -> bool:
        n, tokens = meta.num_reqs, meta.num_tokens
        return (0 < n <= self.max_seqs and tokens <= self.max_tokens and meta.max_query_len > 1
                and num_sample_rows <= self.sample_rows_for(self.size_for(tokens))
                and (self.states is None or self.states.fits(meta)))

    def _stage(self, size: int, n: int, rows: int, programs: int) -> None:
        """Padding for a step of n sequences, `rows` rows and `programs` attention programs already loaded."""
        self.attn.pad(size, n, rows, programs)
        if size > rows:
            self.positions[rows: size].copy_(self.pad_positions[: size - rows])

    def _stage_empty(self, size: int) -> None:
        """A step of the padding sequence alone (capture's warm-up and capture runs)."""
        self._stage(size, 0, 0, 0)
        if self.states is not None:
            self.states.load(size, None)

    # ------------------------------------------------------------------ capture and replay
    def _run_forward(self, size: int, qsl_cpu: list[int], lens_cpu: list[int]) -> tuple:
        meta = self.attn.meta(size, qsl_cpu, lens_cpu)
        if self.states is not None:
            meta.state_rows = self.states.view(size)
        return self.forward(self.input_ids[:size], self.positions[:size], meta,
                            self.sample_idx[: self.sample_rows_for(size)])

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """A graph per token count of the ladder, captured over a step of the padding sequence alone (into `pool`,
        another set's that never replays at once with these, if given)."""
        if not self.use_graphs:
            return
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        qsl_lens = {size: self.attn.host_lists(size, [0], []) for size in self.sizes}
        self.graphs, seconds, mib = capture_each(lambda size: self._run_forward(size, *qsl_lens[size]), self.sizes,
                                                 self.pool, prepare=self._stage_empty)
        self.captured_mib = mib
        logger.info("captured %d mixed-step CUDA graphs (%d..%d tokens, up to %d sequences) in %.1fs, %.0f MiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.max_seqs, seconds, mib)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sample_rows: torch.Tensor, num_sample_rows: int) -> tuple:
        """The step `meta` describes -> (greedy [num_sample_rows], logits [num_sample_rows, V], captured rows
        [rows] or None), as the eager forward gives them for the sampled rows."""
        n, rows = meta.num_reqs, meta.num_tokens
        size = self.size_for(rows)
        self.steps_run += 1
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self._stage(size, n, rows, self.attn.load(meta))
        if self.states is not None:
            self.states.load(size, meta)
        if num_sample_rows:
            self.sample_idx[:num_sample_rows].copy_(sample_rows)
        self.sample_idx[num_sample_rows:].zero_()  # (rows of an earlier, longer step may lie past this one's)
        if self.use_graphs:
            graph, outputs = self.graphs[size]
            graph.replay()
        else:
            outputs = self._run_forward(size, *self.attn.host_lists(size, meta.query_start_loc_cpu, meta.seq_lens_cpu))
        greedy, logits, captured = outputs
        return greedy[:num_sample_rows], logits[:num_sample_rows], None if captured is None else captured[:rows]

    def release(self) -> None:
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.use_graphs = False
