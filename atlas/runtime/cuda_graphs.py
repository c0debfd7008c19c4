"""CUDA graphs of uniform steps: every sequence computes the same number q of query tokens (decode:
q = 1; speculative verify and drafter blocks: q = 1 + K).

Small steps are launch-bound (dozens of kernels per layer), so a forward function is captured once per
sequence count of a ladder and replayed. Inputs go into static buffers; a step is padded up to the
next captured count with sequences that read and write only scratch pages, which the page pool never
hands out. What comes after the forward (sampling, verification) runs eagerly.

Without `use_graphs` (CPU), `run` executes the forward on the same static buffers: the padding and
buffer logic is then testable where no GPU is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from atlas.kernels.paged_attention import block_shape
from atlas.kernels.streams import capture_stream
from atlas.layers.attention import AttentionMetadata, table_width

logger = logging.getLogger(__name__)

_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# forward(input_ids [rows], positions [rows], meta) -> tensors whose first dimension is rows (or None)
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor | None, ...]]


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in _LADDER if s < max_batch]
    return sizes + [max_batch]


def graph_pool_bytes(largest_rows: int, hidden: int, intermediate: int, dtype: torch.dtype, logit_rows: int,
                     vocab: int, kept_bytes: int) -> int:
    """Bytes one graph pool may reserve: the transient activations and logits of its largest step (twice, for
    the allocator's rounding), plus `kept_bytes`, the outputs that every captured size keeps alive in the pool
    (argmax, captured rows, a drafter's drafts and hidden states: summed over the sizes), plus 64 MiB. (The
    target's graphs write their logits into a buffer outside the pool, which the caller counts; with it,
    capturing them at 256 requests on the H200 took 0.34-0.40 of the estimate for the Qwen3-8B shape: the
    transient logits term is generous.)"""
    transient = 2 * dtype.itemsize * (largest_rows * (12 * hidden + 4 * intermediate) + logit_rows * vocab)
    return transient + kept_bytes + (64 << 20)


def uniform_graph_bytes(max_batch: int, q_len: int, hidden: int, intermediate: int, dtype: torch.dtype, vocab: int,
                        kept_row_bytes: int, logit_rows_per_seq: int | None = None) -> int:
    """graph_pool_bytes of a StepGraphs over q_len-token steps: every captured batch size keeps
    `kept_row_bytes` of outputs a row."""
    rows = max_batch * q_len
    kept = sum(graph_batch_sizes(max_batch)) * q_len * kept_row_bytes
    logit_rows = rows if logit_rows_per_seq is None else max_batch * logit_rows_per_seq
    return graph_pool_bytes(rows, hidden, intermediate, dtype, logit_rows, vocab, kept)


@torch.inference_mode()
def capture_each(forward: Callable[[int], tuple], sizes: list[int], pool,
                 prepare: Callable[[int], None] | None = None
                 ) -> tuple[dict[int, tuple[torch.cuda.CUDAGraph, tuple]], float, float]:
    """A graph of forward(size) for every size, largest first (smaller ones reuse its memory in `pool`), each
    after a warm-up run that compiles its kernels outside the capture; prepare(size), if given, runs before
    both and is not captured. -> ({size: (graph, outputs)}, seconds, MiB the pool grew)."""
    t0 = time.perf_counter()
    before = torch.cuda.memory_reserved()
    graphs = {}
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for size in sorted(sizes, reverse=True):
            if prepare is not None:
                prepare(size)
            forward(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs = forward(size)
            graphs[size] = (graph, outputs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graphs, time.perf_counter() - t0, (torch.cuda.memory_reserved() - before) / 2**20


def scratch_pages_needed(max_q_len: int, block_size: int) -> int:
    return -(-max_q_len // block_size)


class StepGraphs:
    def __init__(self, name: str, forward: ForwardFn, q_len: int, num_heads: int, num_kv_heads: int,
                 scratch_pages: list[int], block_size: int, max_pages_per_seq: int, max_batch: int,
                 device: torch.device, use_graphs: bool = True):
        assert len(scratch_pages) * block_size >= q_len
        self.name = name
        self.forward = forward
        self.q = q_len
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.use_graphs = use_graphs
        n, q = self.max_batch, q_len
        rows = n * q
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        # A padding sequence computes positions 0..q-1 in the scratch pages.
        self.pad_slots = torch.tensor([scratch_pages[j // block_size] * block_size + j % block_size
                                       for j in range(q)], dtype=torch.long, device=device)
        self.pad_positions = torch.arange(q, device=device)
        # Every padding sequence's slots and positions, from which a padded step copies its tail; the
        # static buffers start as all padding.
        self.pad_slots_all, self.pad_positions_all = self.pad_slots.repeat(n), self.pad_positions.repeat(n)
        self.positions, self.slot_mapping = self.pad_positions_all.clone(), self.pad_slots_all.clone()
        self.seq_lens = torch.full((n,), q, dtype=torch.int32, device=device)
        width = table_width(max(max_pages_per_seq, len(scratch_pages)))
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.scratch_row = torch.tensor(scratch_pages, dtype=torch.int32, device=device)
        self.block_tables[:, : len(scratch_pages)] = self.scratch_row
        self.query_start_loc = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)
        # The attention kernel's program map for this shape, fixed for every captured size.
        self.block_q, _ = block_shape(num_heads, num_kv_heads, q)
        per_seq = -(-q // self.block_q)
        self.prog_req = torch.arange(n, dtype=torch.int32, device=device).repeat_interleave(per_seq)
        self.prog_q0 = (torch.arange(per_seq, dtype=torch.int32, device=device) * self.block_q).repeat(n)
        self.per_seq_programs = per_seq
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None  # (the captured graphs' memory pool; graphs over the same buffers may share it)
        self.captured_mib = 0.0  # (what capturing reserved, every capture_sized call together: tests read it)
        self.steps_run = 0  # (steps that took this path: tests read it)

    def static_meta(self, size: int, seq_lens_cpu: list[int] | None = None) -> AttentionMetadata:
        """Metadata over the static buffers. The host lists matter only to the PyTorch reference
        attention (never inside a graph), which gets the real sequence lengths."""
        q = self.q
        seq_lens_cpu = seq_lens_cpu or [q] * size
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[: size * q],
            query_start_loc_cpu=list(range(0, (size + 1) * q, q)), seq_lens_cpu=seq_lens_cpu, max_query_len=q,
            max_seq_len=max(seq_lens_cpu), block_size=self.block_size)
        programs = size * self.per_seq_programs
        meta.kernel_cache[("programs", self.block_q)] = (self.prog_req[:programs], self.prog_q0[:programs])
        return meta

    def device_step_meta(self, seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor,
                         start: list[int]) -> AttentionMetadata:
        """Metadata of a uniform step of len(start) sequences whose lengths and slots were computed on the
        device from an earlier step's outputs (drafting or verifying behind it). The host lengths matter only
        where the forward runs eagerly (CPU), where they are read; with graphs they are the most the step can
        reach (start + 2q), without waiting for the device."""
        n, q = len(start), self.q
        lens = self.host_lens(seq_lens, start)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1], seq_lens=seq_lens, block_tables=block_tables,
            slot_mapping=slot_mapping, query_start_loc_cpu=list(range(0, n * q + 1, q)), seq_lens_cpu=lens,
            max_query_len=q, max_seq_len=max(lens), block_size=self.block_size)

    def host_lens(self, seq_lens: torch.Tensor, start: list[int]) -> list[int]:
        """The host lengths of a step whose lengths were computed on the device (see device_step_meta)."""
        return seq_lens.tolist() if not self.use_graphs else [s + 2 * self.q for s in start]

    def _run_forward(self, size: int, seq_lens_cpu: list[int] | None = None) -> tuple:
        rows = size * self.q
        return self.forward(self.input_ids[:rows], self.positions[:rows], self.static_meta(size, seq_lens_cpu))

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs = self.capture_sized(self._run_forward, self.name)

    @torch.inference_mode()
    def capture_sized(self, forward: Callable[[int], tuple], name: str) -> dict[int, tuple[torch.cuda.CUDAGraph, tuple]]:
        """A graph of forward(size) for every captured batch size, in this object's memory pool (its
        intermediates reuse the same memory: the graphs never run at once) -> {size: (graph, outputs)}."""
        graphs, seconds, mib = capture_each(forward, self.sizes, self.pool)
        self.captured_mib += mib
        logger.info("captured %d %s CUDA graphs (%d-token steps, batch %d..%d) in %.1fs, %.0f MiB",
                    len(graphs), name, self.q, self.sizes[0], self.sizes[-1], seconds, mib)
        return graphs

    def size_for(self, n: int) -> int:
        """The captured batch size a step of n sequences is padded to."""
        return next(s for s in self.sizes if s >= n)

    def release(self) -> None:
        """Drop the captured graphs (and the collectives captured in them); the eager path stays."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.use_graphs = False

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A step fits when every sequence computes exactly q tokens and there are not too many."""
        n = meta.num_reqs
        return n <= self.max_batch and meta.max_query_len == self.q and meta.num_tokens == n * self.q

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple:
        n = meta.num_reqs
        rows = n * self.q
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        return self.run_staged(n, meta.block_tables, meta.seq_lens_cpu)

    def run_staged(self, n: int, block_tables: torch.Tensor, seq_lens_cpu: list[int]) -> tuple:
        """run() of n sequences whose ids, positions, slots and lengths are already in the static buffers (a
        kernel wrote them there); seq_lens_cpu matters only without graphs (see device_step_meta)."""
        rows = n * self.q
        size = self.size_for(n)
        self.steps_run += 1
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables)
        if size > n:  # padding sequences touch only the scratch pages
            end = size * self.q
            self.slot_mapping[rows: end].copy_(self.pad_slots_all[rows: end])
            self.positions[rows: end].copy_(self.pad_positions_all[rows: end])
            self.seq_lens[n:size].fill_(self.q)
            self.block_tables[n:size, : self.scratch_row.numel()] = self.scratch_row
        if self.use_graphs:
            graph, outputs = self.graphs[size]
            graph.replay()
        else:
            outputs = self._run_forward(size, seq_lens_cpu + [self.q] * (size - n))
        return tuple(o[:rows] if o is not None else None for o in outputs)
