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

from atlas.kernels.streams import capture_stream
from atlas.layers.attention import AttentionMetadata
from atlas.layers.attention_backend import AttentionBackend, UniformGraphAttention

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
    """Static inputs (token ids, positions, and the attention backend's `attn`) and the graphs replayed over them."""

    def __init__(self, name: str, forward: ForwardFn, q_len: int, attention: AttentionBackend,
                 scratch_pages: list[int], max_pages_per_seq: int, max_batch: int, device: torch.device,
                 use_graphs: bool = True, window_scratch_pages: list[int] | None = None,
                 state_scratch_slot: int | None = None, context_buckets: list[int] | None = None):
        """window_scratch_pages: KV cache groups: the window group's scratch pages (its padding rows go there).
        state_scratch_slot: a model with recurrent state (linear-attention layers): the slot its padding sequences
        read and write (runtime/state_slots.py); the step's slots then travel in a static buffer as well.
        context_buckets: a model whose shapes depend on a bound on the step's longest context
        (CausalLM.graph_context_buckets): a graph per batch size and bound, the metadata's max_seq_len the bound."""
        self.name = name
        self.forward = forward
        self.q = q_len
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.context_buckets = context_buckets
        # What a graph is captured for: a batch size, or (batch size, context bound).
        self.keys: list = self.sizes if context_buckets is None else [(size, bound) for size in self.sizes
                                                                       for bound in context_buckets]
        self.use_graphs = use_graphs
        n, q = self.max_batch, q_len
        self.input_ids = torch.zeros(n * q, dtype=torch.long, device=device)
        # Slots, lengths, page tables, program map: a padding sequence computes positions 0..q-1 in the scratch pages.
        self.attn: UniformGraphAttention = attention.uniform_graph_attention(q, scratch_pages, max_pages_per_seq, n,
                                                                             device, window_scratch_pages)
        # Every padding sequence's positions, from which a padded step copies its tail; the buffers start as padding.
        self.pad_positions_all = torch.arange(q, device=device).repeat(n)
        self.positions = self.pad_positions_all.clone()
        # The recurrent-state slot of each sequence (the linear-attention layers read them on the device: the
        # metadata's host list is None in these steps), loaded by run().
        self.state_scratch_slot = state_scratch_slot
        self.state_slots = (None if state_scratch_slot is None
                            else torch.full((n,), state_scratch_slot, dtype=torch.long, device=device))
        self._state_slots_loaded = False
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None  # (the captured graphs' memory pool; graphs over the same buffers may share it)
        self.captured_mib = 0.0  # (what capturing reserved, every capture_sized call together: tests read it)
        self.steps_run = 0  # (steps that took this path: tests read it)

    def device_step_meta(self, seq_lens: torch.Tensor, page_tables: torch.Tensor, slot_mapping: torch.Tensor,
                         start: list[int]) -> AttentionMetadata:
        """Metadata of a uniform step of len(start) sequences whose lengths and slots were computed on the
        device from an earlier step's outputs (drafting or verifying behind it). The host lengths matter only
        where the forward runs eagerly (CPU), where they are read; with graphs they are the most the step can
        reach (start + 2q), without waiting for the device."""
        return self.attn.device_step_meta(seq_lens, page_tables, slot_mapping, self.host_lens(seq_lens, start))

    def host_lens(self, seq_lens: torch.Tensor, start: list[int]) -> list[int]:
        """The host lengths of a step whose lengths were computed on the device (see device_step_meta)."""
        return seq_lens.tolist() if not self.use_graphs else [s + 2 * self.q for s in start]

    def _run_forward(self, key, seq_lens_cpu: list[int] | None = None) -> tuple:
        size, bound = key if isinstance(key, tuple) else (key, None)
        rows = size * self.q
        meta = self.attn.meta(size, seq_lens_cpu)
        if bound is not None:
            meta.max_seq_len = bound
        if self.state_slots is not None:
            meta.state_slots, meta.state_slots_cpu = self.state_slots[:size], None
        return self.forward(self.input_ids[:rows], self.positions[:rows], meta)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """pool: another set's graph pool over the same shapes to capture into (never replayed at once with it),
        else one of their own."""
        if not self.use_graphs:
            return
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.graphs = self.capture_sized(self._run_forward, self.name)

    @torch.inference_mode()
    def capture_sized(self, forward: Callable[[int], tuple], name: str) -> dict[int, tuple[torch.cuda.CUDAGraph, tuple]]:
        """A graph of forward(key) for every captured key (batch size, or batch size and context bound), in this
        object's memory pool (its intermediates reuse the same memory: the graphs never run at once) -> {key:
        (graph, outputs)}."""
        graphs, seconds, mib = capture_each(forward, self.keys, self.pool)
        self.captured_mib += mib
        bounds = "" if self.context_buckets is None else f", context bounds {self.context_buckets}"
        logger.info("captured %d %s CUDA graphs (%d-token steps, batch %d..%d%s) in %.1fs, %.0f MiB",
                    len(graphs), name, self.q, self.sizes[0], self.sizes[-1], bounds, seconds, mib)
        return graphs

    def size_for(self, n: int) -> int:
        """The captured batch size a step of n sequences is padded to."""
        return next(s for s in self.sizes if s >= n)

    def key_for(self, size: int, seq_lens_cpu: list[int]) -> int | tuple[int, int]:
        """The graph a step of `size` (padded) sequences of these host lengths replays."""
        if self.context_buckets is None:
            return size
        longest = max(seq_lens_cpu, default=0)
        bound = next((b for b in self.context_buckets if b >= longest), None)
        if bound is None:
            raise RuntimeError(f"a step of {longest} tokens of context, past the graphs' largest bound "
                               f"{self.context_buckets[-1]}")
        return size, bound

    def release(self) -> None:
        """Drop the captured graphs (and the collectives captured in them); the eager path stays."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.use_graphs = False

    def holds(self, num_seqs: int, table_width: int) -> bool:
        """Whether a step of num_seqs sequences whose page tables are table_width wide fits the static buffers."""
        return num_seqs <= self.max_batch and table_width <= self.attn.page_tables.shape[1]

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A step fits when every sequence computes exactly q tokens and there are not too many."""
        n = meta.num_reqs
        return n <= self.max_batch and meta.max_query_len == self.q and meta.num_tokens == n * self.q

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple:
        n = meta.num_reqs
        rows = n * self.q
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.attn.load(meta)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(meta.state_slots)
            self.state_slots[n: self.size_for(n)].fill_(self.state_scratch_slot)
            self._state_slots_loaded = True
        return self.run_staged(n, meta.page_tables, meta.seq_lens_cpu)

    def run_staged(self, n: int, page_tables: torch.Tensor, seq_lens_cpu: list[int]) -> tuple:
        """run() of n sequences whose ids, positions, slots and lengths are already in the static buffers (a
        kernel wrote them there); seq_lens_cpu matters only without graphs (see device_step_meta)."""
        rows = n * self.q
        size = self.size_for(n)
        if self.state_slots is not None:  # (only run() knows the step's recurrent-state slots)
            if not self._state_slots_loaded:
                raise RuntimeError("a step of a model with recurrent state was staged without its state slots")
            self._state_slots_loaded = False
        self.steps_run += 1
        self.attn.load_tables(n, page_tables)
        if size > n:  # padding sequences touch only the scratch pages
            end = size * self.q
            self.positions[rows: end].copy_(self.pad_positions_all[rows: end])
            self.attn.pad_slots_and_lens(n, size)
        key = self.key_for(size, seq_lens_cpu)
        if self.use_graphs:
            graph, outputs = self.graphs[key]
            graph.replay()
        else:
            lens = seq_lens_cpu + [self.q] * (size - n)
            outputs = self._run_forward(key, lens)
        return tuple(o[:rows] if o is not None else None for o in outputs)
