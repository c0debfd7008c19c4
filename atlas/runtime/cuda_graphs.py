"""CUDA graphs of the decode step: every sequence computes one token.

A decode step of a small batch is launch-bound (dozens of kernels per layer), so the forward is
captured once per batch size of a ladder and replayed. Inputs go into static buffers; a batch is
padded up to the next captured size with rows that read and write only a scratch page that the
page pool never hands out. Everything after the forward (LM head on the chosen rows, sampling,
verification) runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from atlas.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in _LADDER if s < max_batch]
    return sizes + [max_batch]


def graph_memory_estimate(max_batch: int, hidden: int, intermediate: int, capture_width: int,
                          dtype: torch.dtype) -> int:
    """Bytes the graph pool may need: activations of the largest decode batch, with slack."""
    per_token = 12 * hidden + 4 * intermediate + capture_width
    return 2 * max_batch * per_token * torch.empty((), dtype=dtype).element_size() + (64 << 20)


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], scratch_page: int, block_size: int,
                 max_pages_per_seq: int, max_batch: int, capture_layers: tuple[int, ...], device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.capture_layers = capture_layers
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_page * block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_pages_per_seq), scratch_page, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.prog_req = torch.arange(n, dtype=torch.int32, device=device)
        self.prog_q0 = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[1] * size, max_query_len=1, max_seq_len=1,
            block_size=self.block_size)
        meta.kernel_cache[("programs", 1)] = (self.prog_req[:size], self.prog_q0[:size])
        return meta

    def _forward(self, size: int):
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size),
                          self.capture_layers)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
                self._forward(size)  # warm-up: compiles kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    hidden, aux = self._forward(size)
                self.graphs[size] = (graph, hidden, aux)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs, %.0f MiB", len(self.graphs),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - t0,
                    (torch.cuda.memory_reserved() - before) / 2**20)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:  # padding rows touch only the scratch page
            self.slot_mapping[n:size].fill_(self.scratch_slot)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(self.scratch_page)
        graph, hidden, aux = self.graphs[size]
        graph.replay()
        return hidden[:n], (aux[:n] if aux is not None else None)
