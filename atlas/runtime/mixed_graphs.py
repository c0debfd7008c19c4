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

Without `use_graphs` (CPU), `run` executes the forward on the same static buffers, so the padding and
buffer logic is tested where no GPU is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from atlas.kernels.paged_attention import block_shape
from atlas.layers.attention import AttentionMetadata, table_width
from atlas.runtime.cuda_graphs import capture_each

logger = logging.getLogger(__name__)

# Token counts of the captured mixed steps: fine steps where a graph saves most against the step's device work.
_TOKEN_LADDER = (32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024)
DEFAULT_MAX_TOKENS = 1024

# forward(input_ids [T], positions [T], meta, sample_idx [R]) -> (greedy [R], logits [R, V], captured [T, ...] or None)
MixedForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], tuple]


def mixed_token_sizes(max_tokens: int) -> list[int]:
    sizes = [s for s in _TOKEN_LADDER if s < max_tokens]
    return sizes + [max_tokens]


class MixedStepGraphs:
    def __init__(self, forward: MixedForwardFn, num_heads: int, num_kv_heads: int, scratch_pages: list[int],
                 block_size: int, max_pages_per_seq: int, max_seqs: int, max_tokens: int, max_sample_rows: int,
                 device: torch.device, use_graphs: bool = True):
        self.forward = forward
        self.sizes = mixed_token_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = max_seqs
        self.max_sample_rows = max_sample_rows
        self.block_size = block_size
        self.use_graphs = use_graphs
        T, S = self.max_tokens, max_seqs + 2
        self.num_slots = S
        self.pad_seq, self.empty_seq = S - 2, S - 1
        # Every mixed step has a query of more than one row somewhere, so one program shape serves all of them.
        self.block_q, _ = block_shape(num_heads, num_kv_heads, 2)
        self.max_programs = -(-T // self.block_q) + S  # (sum of ceil(q / block_q) over the step's sequences)

        long = dict(dtype=torch.long, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(T, **long)
        self.positions = torch.zeros(T, **long)
        self.slot_mapping = torch.zeros(T, **long)
        # The padding sequence's rows: position 0 each (any position would do, its outputs are never read, but
        # one past the model's context would index past a rotary table), slots cycling through the scratch pages.
        ns = len(scratch_pages)
        self.pad_positions = torch.zeros(T, **long)
        self.pad_slots = torch.tensor([scratch_pages[(p // block_size) % ns] * block_size + p % block_size
                                       for p in range(T)], **long)
        width = table_width(max(max_pages_per_seq, -(-T // block_size)))
        self.block_tables = torch.zeros(S, width, **i32)
        self.block_tables[self.pad_seq] = torch.tensor([scratch_pages[j % ns] for j in range(width)], **i32)
        self.query_start_loc = torch.zeros(S + 1, **i32)
        self.seq_lens = torch.zeros(S, **i32)
        self.prog_req = torch.full((self.max_programs,), self.empty_seq, **i32)
        self.prog_q0 = torch.zeros(self.max_programs, **i32)
        self.q0_ramp = torch.arange(-(-T // self.block_q), **i32) * self.block_q
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
                and num_sample_rows <= self.sample_rows_for(self.size_for(tokens)))

    # ------------------------------------------------------------------ metadata over the static buffers
    def _static_meta(self, size: int, qsl_cpu: list[int], lens_cpu: list[int]) -> AttentionMetadata:
        """The host lists matter only to the PyTorch reference attention (never inside a graph)."""
        S = self.num_slots
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:size], query_start_loc_cpu=qsl_cpu, seq_lens_cpu=lens_cpu,
            max_query_len=max(2, max((b - a for a, b in zip(qsl_cpu, qsl_cpu[1:], strict=False)), default=2)),
            max_seq_len=max(lens_cpu, default=0), block_size=self.block_size)
        programs = -(-size // self.block_q) + S
        meta.kernel_cache[("programs", self.block_q)] = (self.prog_req[:programs], self.prog_q0[:programs])
        return meta

    def _host_lists(self, size: int, qsl: list[int], lens: list[int]) -> tuple[list[int], list[int]]:
        """query_start_loc and seq_lens of every slot: the step's sequences, empty ones, the padding sequence
        (the rows from the step's last to `size`), the last empty one."""
        n, rows, S = len(lens), qsl[-1], self.num_slots
        qsl_all = list(qsl) + [rows] * (S - 2 - n) + [size, size]
        lens_all = list(lens) + [0] * (S - 2 - n) + [size - rows, 0]
        return qsl_all, lens_all

    def _stage(self, size: int, n: int, rows: int, programs: int) -> None:
        """Padding for a step of n sequences, `rows` rows and `programs` attention programs already written
        into the buffers' heads."""
        S, pad = self.num_slots, size - rows
        self.query_start_loc[n + 1: S - 1].fill_(rows)
        self.query_start_loc[S - 1:].fill_(size)
        self.seq_lens[n: S - 2].zero_()
        self.seq_lens[S - 2].fill_(pad)
        if pad:
            self.positions[rows: size].copy_(self.pad_positions[:pad])
            self.slot_mapping[rows: size].copy_(self.pad_slots[:pad])
        k = -(-pad // self.block_q)
        self.prog_req[programs: programs + k].fill_(self.pad_seq)
        self.prog_q0[programs: programs + k].copy_(self.q0_ramp[:k])
        self.prog_req[programs + k:].fill_(self.empty_seq)
        self.prog_q0[programs + k:].zero_()

    # ------------------------------------------------------------------ capture and replay
    def _run_forward(self, size: int, qsl_cpu: list[int], lens_cpu: list[int]) -> tuple:
        meta = self._static_meta(size, qsl_cpu, lens_cpu)
        return self.forward(self.input_ids[:size], self.positions[:size], meta,
                            self.sample_idx[: self.sample_rows_for(size)])

    @torch.inference_mode()
    def capture(self) -> None:
        """A graph per token count of the ladder, captured over a step of the padding sequence alone."""
        if not self.use_graphs:
            return
        self.pool = torch.cuda.graph_pool_handle()
        qsl_lens = {size: self._host_lists(size, [0], []) for size in self.sizes}
        self.graphs, seconds, mib = capture_each(lambda size: self._run_forward(size, *qsl_lens[size]), self.sizes,
                                                 self.pool, prepare=lambda size: self._stage(size, 0, 0, 0))
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
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.query_start_loc[: n + 1].copy_(meta.query_start_loc)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        prog_req, prog_q0 = meta.kernel_cache[("programs", self.block_q)]
        programs = prog_req.numel()
        self.prog_req[:programs].copy_(prog_req)
        self.prog_q0[:programs].copy_(prog_q0)
        self._stage(size, n, rows, programs)
        if num_sample_rows:
            self.sample_idx[:num_sample_rows].copy_(sample_rows)
        self.sample_idx[num_sample_rows:].zero_()  # (rows of an earlier, longer step may lie past this one's)
        if self.use_graphs:
            graph, outputs = self.graphs[size]
            graph.replay()
        else:
            outputs = self._run_forward(size, *self._host_lists(size, meta.query_start_loc_cpu, meta.seq_lens_cpu))
        greedy, logits, captured = outputs
        return greedy[:num_sample_rows], logits[:num_sample_rows], None if captured is None else captured[:rows]

    def release(self) -> None:
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.use_graphs = False
