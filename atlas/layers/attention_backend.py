"""Attention backends: the one object per kind of paged attention cache that owns everything between the page
ids the scheduler hands out and the tensors the attention kernels read.

Kinds (`attention_backend(specs, block_size)` picks one from a model's cache specs):

- `GQABackend` (layers.attention.KVCacheSpec): K and V planes of kv heads x head dim per token, read by the paged
  Triton kernel on CUDA and by the PyTorch reference elsewhere. `--kv-cache-dtype fp8` is a layout as well as a
  dtype: the V plane is transposed within each page (`CacheLayout.v_transposed`). Sliding-window layers
  (`KVCacheSpec.sliding_window`, gemma3 / gemma4 / gpt-oss) share it: the window is an argument of the kernel call.
  Where every layer is windowed, one page table serves them all and `layers.attention.release_window` tells the page
  manager which pages no layer reads again (from the model's `attention_windows`, which spans every pipeline stage,
  where a backend sees its stage's layers only). Where windowed layers sit beside global ones, their caches form a
  KV cache group of their own (`windowed_caches`; engine/kv_groups.py): allocated over a pool of their own
  (`allocate`'s window_pages), sized apart (`bytes_per_token` by group), addressed through a page table and slots of
  their own, which every step carries (`AttentionMetadata.windowed`, which a windowed layer picks with
  `for_layer`) and so do the graphs' static inputs (`WindowGraphInputs`).
- `MLABackend` (layers.mla.MLACacheSpec, and DSA's `DSACacheSpec`, whose row appends the indexer key to the
  latent row): one latent row per token, all query heads packed against one key head. `--kv-cache-dtype fp8`
  stores the row in 8 bits as it is (no layout change): `write_latent_cache` rounds and saturates, the Triton
  kernel and the references (DSA's included, whose indexer then selects over the rounded keys) widen what they
  read.

A cache spec without an 8-bit path (`CacheSpec.no_8bit_path`: DeepSeek-V4's) makes `cache_dtype` refuse the flag.

The PyTorch reference is not a backend of its own: it reads the same cache layout and the same metadata (the
host lists), so each kind falls back to it per call where its kernel cannot run (CPU, a head dim too wide).
The recurrent state of hybrid models (layers.linear_attention) is not paged: a state slot per running request,
whose numbers the scheduler gives and `AttentionMetadata.state_slots` carries; it has its own spec and pools.

What a backend owns, and who asks it:

- cache: `layouts` / `allocate` (target and drafter caches alike; `cache_dtype` decides the element type
  for --kv-cache-dtype; `bytes_per_token` is the memory plan's unit);
- slots: `slots` (a sequence's positions, on the host: drafters), `step_slots` (a whole step, vectorized:
  runtime.step_inputs), `padding_slots` (graph padding rows in the scratch pages);
- per-step metadata: `block_q` and `fill_programs` (the Triton program map, `kernels.paged_attention.ProgramMap`,
  which travels typed on `AttentionMetadata.programs`), `metadata` (a step from host lists: the memory probe),
  and for drafters `rows()` (a `StepRows` assembled one run of rows a sequence) and `decode_metadata` (one
  row a sequence: chained one-token drafting steps);
- CUDA-graph static inputs: `UniformGraphAttention` / `MixedGraphAttention`, the attention half of the graph
  classes in runtime/ (which keep the token ids, positions and replay); a step is loaded into them with
  `load` and padded with `pad`.

The K/V write stays fused into each model's q/k/v kernels (`kernels.fused_ops`), at `meta.slot_mapping`: a
backend call per layer would cost host time every layer of every step.

Everything here runs once per step or once per start-up, never once per layer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from atlas.config import KV_CACHE_DTYPES
from atlas.errors import ConfigError
from atlas.host_copy import to_device
from atlas.kernels.paged_attention import ProgramMap, block_shape
from atlas.layers.attention import (
    AttentionMetadata,
    CacheLayout,
    CacheSpec,
    KVCacheSpec,
    aligned_count,
    table_width,
)


class AttentionBackend:
    """A paged attention backend over `specs` (one per layer; every layer packs heads alike) and pages of
    block_size tokens. See the module docstring."""

    kind = "paged"

    def __init__(self, specs: Sequence[CacheSpec], block_size: int, program_heads: tuple[int, int] | None = None):
        """program_heads: the packing the step's program map is prepared for where the model's layers differ in it
        (models.base.CausalLM.attention_program_heads: a layer of another packing makes its own map in the step)."""
        self.specs = tuple(specs)
        self.block_size = block_size
        packs = {spec.program_heads for spec in self.specs}
        if program_heads is not None:
            packs = {program_heads}
        if len(packs) > 1:
            raise ValueError(f"layers of one model pack attention heads differently: {sorted(packs)}")
        # (query heads, key heads) of one kernel program: they fix how many query rows a program takes. (None
        # without attention layers: a pipeline stage of a hybrid model's linear layers.)
        self.num_heads, self.num_kv_heads = packs.pop() if packs else (None, None)

    # ------------------------------------------------------------------ cache
    def cache_dtype(self, name: str, model_dtype: torch.dtype) -> torch.dtype:
        """The caches' element type for --kv-cache-dtype `name`: the model dtype for auto; float8 e4m3 for fp8 /
        fp8_e4m3, unscaled (K and V, or MLA's latent row, saturate at +-448: post-norm keys, values and latents of
        the models served sit far inside it; vLLM's default without calibrated scales), where every layer's spec
        has an 8-bit path (`CacheSpec.no_8bit_path`)."""
        if name == "auto":
            return model_dtype
        if name not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
        refused = sorted({f"{type(spec).__name__} ({spec.no_8bit_path})" for spec in self.specs
                          if spec.no_8bit_path is not None})
        if refused:
            raise ConfigError(f"--kv-cache-dtype {name} is for GQA and MLA attention caches; this model's layers "
                              f"keep {', '.join(refused)}, which have no 8-bit path: drop the flag (auto)")
        return torch.float8_e4m3fn

    # ------------------------------------------------------------------ KV cache groups
    def windowed_caches(self) -> list[bool]:
        """Per cache: whether its layer has a sliding window (its cache joins the window group where the model
        keeps KV cache groups: engine/kv_groups.py)."""
        return [getattr(spec, "sliding_window", None) is not None for spec in self.specs]

    def bytes_per_token(self, dtype: torch.dtype, group: str | None = None) -> int:
        """Cache bytes one token takes in every layer together (the memory plan's unit); group "full" / "window":
        in the global or the windowed layers only (KV cache groups)."""
        if group is None:
            return sum(spec.bytes_per_token(dtype) for spec in self.specs)
        assert group in ("full", "window"), group
        return sum(spec.bytes_per_token(dtype) for spec, windowed in zip(self.specs, self.windowed_caches(), strict=True)
                   if windowed == (group == "window"))

    def layouts(self, num_pages: int, dtype: torch.dtype, window_pages: int | None = None) -> list[CacheLayout]:
        """Each cache's layout: num_pages pages, or with KV cache groups window_pages for the windowed layers."""
        windowed = self.windowed_caches()
        return [spec.layout(window_pages if window_pages is not None and w else num_pages, self.block_size, dtype)
                for spec, w in zip(self.specs, windowed, strict=True)]

    def allocate(self, num_pages: int, dtype: torch.dtype, device: torch.device,
                 window_pages: int | None = None) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer, each in its spec's layout, all addressed by the same page ids; with
        KV cache groups (window_pages), the windowed layers' by the window group's page ids."""
        return [torch.zeros(layout.shape, dtype=layout.dtype, device=device)
                for layout in self.layouts(num_pages, dtype, window_pages)]

    # ------------------------------------------------------------------ slots
    def slots(self, pages: Sequence[int], first: int, count: int) -> list[int]:
        """Cache slots of positions first .. first + count - 1 of a sequence whose pages are `pages`."""
        bs = self.block_size
        return [pages[p // bs] * bs + p % bs for p in range(first, first + count)]

    def step_slots(self, table: np.ndarray, seq_of_row: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        """out[r] = the slot of row r of a step: position positions[r] of sequence seq_of_row[r], whose page ids
        are row seq_of_row[r] of `table`."""
        bs = self.block_size
        out[:] = table[seq_of_row, positions // bs].astype(np.int64) * bs + positions % bs

    def padding_slots(self, scratch_pages: Sequence[int], count: int) -> list[int]:
        """Slots of positions 0 .. count - 1 of a padding sequence, cycling through the scratch pages (which
        the page pool never hands out)."""
        bs, ns = self.block_size, len(scratch_pages)
        return [scratch_pages[(p // bs) % ns] * bs + p % bs for p in range(count)]

    # ------------------------------------------------------------------ program map
    def block_q(self, max_query_len: int) -> int:
        """Query rows one kernel program takes in a step whose longest query has max_query_len rows."""
        if self.num_heads is None:  # (no attention layer reads the program map)
            return block_shape(1, 1, max_query_len)[0]
        return block_shape(self.num_heads, self.num_kv_heads, max_query_len)[0]

    @staticmethod
    def num_programs(q_lens: np.ndarray, block_q: int) -> int:
        return int((-(-q_lens // block_q)).sum())

    @staticmethod
    def fill_programs(req: np.ndarray, q0: np.ndarray, q_lens: np.ndarray | None, block_q: int, rows: np.ndarray,
                      uniform_q: int = 0) -> None:
        """The program map of a step whose sequences have q_lens query rows into req / q0 (num_programs long);
        rows: 0, 1, 2, ... at least that long (the caller's, made once a step); uniform_q > 0: every sequence
        has that many rows (the short way)."""
        n = req.shape[0]
        if uniform_q:
            per_seq = -(-uniform_q // block_q)
            if per_seq == 1:
                req[:] = rows[:n]
                q0[:] = 0
            else:
                req[:] = rows[:n] // per_seq
                q0[:] = rows[:n] % per_seq * block_q
            return
        per_req = -(-q_lens // block_q)
        req[:] = np.repeat(rows[: q_lens.shape[0]], per_req)
        q0[:] = (np.arange(n) - np.repeat(np.cumsum(per_req) - per_req, per_req)) * block_q

    # ------------------------------------------------------------------ metadata from host lists
    def metadata(self, query_start_loc: list[int], seq_lens: list[int], tables: list[list[int]], slots: list[int],
                 device: torch.device) -> AttentionMetadata:
        """A step's metadata from host lists: one tensor each (the page tables padded with page 0, never read past
        a sequence's length). The program map is made by the first layer that needs it."""
        width = table_width(max((len(t) for t in tables), default=1))
        num_reqs = len(tables)
        # One int32 copy (query starts, lengths, tables) and one int64 (slots), from pinned memory on CUDA:
        # a drafter builds these right after a step is read back, and pageable copies hold the host.
        o_lens = aligned_count(len(query_start_loc), 4)
        base = o_lens + aligned_count(len(seq_lens), 4)
        packed = [0] * (base + num_reqs * width)
        packed[: len(query_start_loc)] = query_start_loc
        packed[o_lens: o_lens + len(seq_lens)] = seq_lens
        for i, t in enumerate(tables):
            packed[base + i * width: base + i * width + len(t)] = t
        ints = to_device(packed, torch.int32, device)
        return AttentionMetadata(
            query_start_loc=ints[: len(query_start_loc)],
            seq_lens=ints[o_lens: o_lens + len(seq_lens)],
            page_tables=ints[base:].view(num_reqs, width),
            slot_mapping=to_device(slots, torch.long, device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=max((b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)), default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=self.block_size,
        )

    def metadata_for_query_lens(self, q_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                                slots: list[int], device: torch.device) -> AttentionMetadata:
        """`metadata` from each sequence's number of query rows (its query start is the sum of those before it)."""
        return self.metadata([0, *itertools.accumulate(q_lens)], seq_lens, tables, slots, device)

    def rows(self) -> StepRows:
        """An empty step to assemble run by run (StepRows)."""
        return StepRows(self)

    def decode_metadata(self, tables: list[list[int]], positions: list[int], device: torch.device,
                        slots: list[int] | None = None) -> AttentionMetadata:
        """A step of one query row a sequence, at positions[i] of the sequence whose pages are tables[i] (a
        drafter's chained one-token steps); `slots`: theirs, where the caller has them already."""
        if slots is None:
            slots = [self.slots(pages, p, 1)[0] for pages, p in zip(tables, positions, strict=True)]
        return self.metadata(list(range(len(positions) + 1)), [p + 1 for p in positions], tables, slots, device)

    # ------------------------------------------------------------------ CUDA-graph static inputs
    def uniform_graph_attention(self, q: int, scratch_pages: list[int], max_pages_per_seq: int, max_batch: int,
                                device: torch.device, window_scratch_pages: list[int] | None = None
                                ) -> UniformGraphAttention:
        return UniformGraphAttention(self, q, scratch_pages, max_pages_per_seq, max_batch, device, window_scratch_pages)

    def mixed_graph_attention(self, max_tokens: int, max_seqs: int, scratch_pages: list[int], max_pages_per_seq: int,
                              device: torch.device, window_scratch_pages: list[int] | None = None
                              ) -> MixedGraphAttention:
        return MixedGraphAttention(self, max_tokens, max_seqs, scratch_pages, max_pages_per_seq, device,
                                   window_scratch_pages)


class StepRows:
    """A step assembled on the host one run of rows a sequence (drafters): a run is positions first .. first +
    count - 1 of a sequence whose pages are `pages` and which then holds first + count tokens."""

    def __init__(self, attention: AttentionBackend):
        self.attention = attention
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.q_lens: list[int] = []
        self.seq_lens: list[int] = []
        self.tables: list[list[int]] = []

    def add(self, pages: list[int], first: int, count: int) -> None:
        self.positions.extend(range(first, first + count))
        self.slots.extend(self.attention.slots(pages, first, count))
        self.q_lens.append(count)
        self.seq_lens.append(first + count)
        self.tables.append(pages)

    def __len__(self) -> int:
        return len(self.q_lens)

    def metadata(self, device: torch.device) -> AttentionMetadata:
        return self.attention.metadata_for_query_lens(self.q_lens, self.seq_lens, self.tables, self.slots, device)


class GQABackend(AttentionBackend):
    """K/V planes per token (KVCacheSpec); the paged Triton kernel on CUDA; 8-bit caches with V transposed."""

    kind = "gqa"


class MLABackend(AttentionBackend):
    """One latent row per token (MLACacheSpec, DSACacheSpec); every query head against one key head; 8-bit rows
    as they are."""

    kind = "mla"


def attention_backend(specs: Sequence[CacheSpec], block_size: int,
                      program_heads: tuple[int, int] | None = None) -> AttentionBackend:
    """The backend of a model (or drafter) whose attention layers keep these caches (program_heads: see
    AttentionBackend)."""
    gqa = [isinstance(spec, KVCacheSpec) for spec in specs]
    if gqa and all(gqa):
        return GQABackend(specs, block_size, program_heads)
    if gqa and not any(gqa):
        return MLABackend(specs, block_size, program_heads)
    return AttentionBackend(specs, block_size, program_heads)  # (no attention layers, or mixed kinds whose head packs agree)


class UniformGraphAttention:
    """The attention inputs of graphs over uniform steps (every sequence q query rows, up to max_batch sequences):
    static query starts, lengths, page tables, slots and program map. A padding sequence computes positions
    0 .. q - 1 in the scratch pages."""

    def __init__(self, backend: AttentionBackend, q: int, scratch_pages: list[int], max_pages_per_seq: int,
                 max_batch: int, device: torch.device, window_scratch_pages: list[int] | None = None):
        """window_scratch_pages: KV cache groups (engine/kv_groups.py): the window group's scratch pages, where its
        padding rows go (the graphs then carry the window group's slots and page tables too)."""
        assert len(scratch_pages) * backend.block_size >= q
        self.q = q
        self.block_size = backend.block_size
        n = max_batch
        self.pad_slots = torch.tensor(backend.padding_slots(scratch_pages, q), dtype=torch.long, device=device)
        # Every padding sequence's slots, from which a padded step copies its tail; the buffers start as padding.
        self.pad_slots_all = self.pad_slots.repeat(n)
        self.slot_mapping = self.pad_slots_all.clone()
        self.seq_lens = torch.full((n,), q, dtype=torch.int32, device=device)
        width = table_width(max(max_pages_per_seq, len(scratch_pages)))
        self.page_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.scratch_row = torch.tensor(scratch_pages, dtype=torch.int32, device=device)
        self.page_tables[:, : len(scratch_pages)] = self.scratch_row
        self.query_start_loc = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)
        # The program map of this shape, fixed for every captured size.
        self.block_q = backend.block_q(q)
        per_seq = -(-q // self.block_q)
        self.prog_req = torch.arange(n, dtype=torch.int32, device=device).repeat_interleave(per_seq)
        self.prog_q0 = (torch.arange(per_seq, dtype=torch.int32, device=device) * self.block_q).repeat(n)
        self.per_seq_programs = per_seq
        self.window: WindowGraphInputs | None = None
        if window_scratch_pages is not None:
            self.window = WindowGraphInputs(backend.padding_slots(window_scratch_pages, q) * n, n, width,
                                            window_scratch_pages, device)

    def meta(self, size: int, seq_lens_cpu: list[int] | None = None) -> AttentionMetadata:
        """Metadata over the static buffers. The host lists matter only to the PyTorch reference attention
        (never inside a graph), which gets the real sequence lengths."""
        q = self.q
        seq_lens_cpu = seq_lens_cpu or [q] * size
        programs = size * self.per_seq_programs
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            page_tables=self.page_tables[:size], slot_mapping=self.slot_mapping[: size * q],
            query_start_loc_cpu=list(range(0, (size + 1) * q, q)), seq_lens_cpu=seq_lens_cpu, max_query_len=q,
            max_seq_len=max(seq_lens_cpu), block_size=self.block_size,
            programs=ProgramMap(self.block_q, self.prog_req[:programs], self.prog_q0[:programs]))
        if self.window is not None:
            meta.windowed = self.window.meta(meta, size, size * q)
        return meta

    def device_step_meta(self, seq_lens: torch.Tensor, page_tables: torch.Tensor, slot_mapping: torch.Tensor,
                         lens: list[int]) -> AttentionMetadata:
        """Metadata of a uniform step of len(lens) sequences whose lengths and slots were computed on the device;
        `lens`: the host lengths (see runtime.cuda_graphs.StepGraphs.host_lens)."""
        if self.window is not None:  # (the engine queues no verify step ahead for such a model: prelaunch_verify)
            raise RuntimeError("a step computed on the device carries no window-group slots (KV cache groups)")
        n, q = len(lens), self.q
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1], seq_lens=seq_lens, page_tables=page_tables,
            slot_mapping=slot_mapping, query_start_loc_cpu=list(range(0, n * q + 1, q)), seq_lens_cpu=lens,
            max_query_len=q, max_seq_len=max(lens), block_size=self.block_size)

    def load(self, meta: AttentionMetadata) -> None:
        """The step's slots and lengths into the static buffers (its page tables go in with `pad`)."""
        n = meta.num_reqs
        self.slot_mapping[: n * self.q].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if self.window is not None:  # (its page tables too: run_staged loads the full group's)
            self.window.load(meta.windowed, n)

    def load_tables(self, n: int, page_tables: torch.Tensor) -> None:
        self.page_tables[:n, : page_tables.shape[1]].copy_(page_tables)

    def pad_slots_and_lens(self, n: int, size: int) -> None:
        """Sequences n .. size - 1 of a step padded to a captured size: they touch only the scratch pages."""
        rows, end = n * self.q, size * self.q
        self.slot_mapping[rows: end].copy_(self.pad_slots_all[rows: end])
        self.seq_lens[n:size].fill_(self.q)
        self.page_tables[n:size, : self.scratch_row.numel()] = self.scratch_row
        if self.window is not None:
            self.window.pad_rows(rows, end)
            self.window.pad_seqs(n, size)


class MixedGraphAttention:
    """The attention inputs of graphs over mixed steps of up to max_tokens rows and max_seqs sequences (see
    runtime.mixed_graphs): S = max_seqs + 2 sequence slots, of which S - 2 is the padding sequence (the rows past
    the step's own; its page-table row cycles through the scratch pages) and S - 1 an empty one at which the
    program map's unused programs point."""

    def __init__(self, backend: AttentionBackend, max_tokens: int, max_seqs: int, scratch_pages: list[int],
                 max_pages_per_seq: int, device: torch.device, window_scratch_pages: list[int] | None = None):
        """window_scratch_pages: as UniformGraphAttention's."""
        T, S = max_tokens, max_seqs + 2
        bs = backend.block_size
        self.block_size = bs
        self.num_slots = S
        self.pad_seq, self.empty_seq = S - 2, S - 1
        # Every mixed step has a query of more than one row somewhere, so one program shape serves all of them.
        self.block_q = backend.block_q(2)
        self.max_programs = -(-T // self.block_q) + S  # (sum of ceil(q / block_q) over the step's sequences)
        long = dict(dtype=torch.long, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(T, **long)
        self.pad_slots = torch.tensor(backend.padding_slots(scratch_pages, T), **long)
        ns = len(scratch_pages)
        width = table_width(max(max_pages_per_seq, -(-T // bs)))
        self.page_tables = torch.zeros(S, width, **i32)
        self.page_tables[self.pad_seq] = torch.tensor([scratch_pages[j % ns] for j in range(width)], **i32)
        self.query_start_loc = torch.zeros(S + 1, **i32)
        self.seq_lens = torch.zeros(S, **i32)
        self.prog_req = torch.full((self.max_programs,), self.empty_seq, **i32)
        self.prog_q0 = torch.zeros(self.max_programs, **i32)
        self.q0_ramp = torch.arange(-(-T // self.block_q), **i32) * self.block_q
        self.window: WindowGraphInputs | None = None
        if window_scratch_pages is not None:
            self.window = WindowGraphInputs(backend.padding_slots(window_scratch_pages, T), S, width,
                                            window_scratch_pages, device, cycle_row=self.pad_seq)

    def meta(self, size: int, qsl_cpu: list[int], lens_cpu: list[int]) -> AttentionMetadata:
        """Metadata over the static buffers for a step padded to `size` rows; the host lists (host_lists) matter
        only to the PyTorch reference attention (never inside a graph)."""
        programs = -(-size // self.block_q) + self.num_slots
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, page_tables=self.page_tables,
            slot_mapping=self.slot_mapping[:size], query_start_loc_cpu=qsl_cpu, seq_lens_cpu=lens_cpu,
            max_query_len=max(2, max((b - a for a, b in zip(qsl_cpu, qsl_cpu[1:], strict=False)), default=2)),
            max_seq_len=max(lens_cpu, default=0), block_size=self.block_size,
            programs=ProgramMap(self.block_q, self.prog_req[:programs], self.prog_q0[:programs]))
        if self.window is not None:
            meta.windowed = self.window.meta(meta, self.num_slots, size)
        return meta

    def host_lists(self, size: int, qsl: list[int], lens: list[int]) -> tuple[list[int], list[int]]:
        """query_start_loc and seq_lens of every slot: the step's sequences, empty ones, the padding sequence
        (the rows from the step's last to `size`), the last empty one."""
        n, rows, S = len(lens), qsl[-1], self.num_slots
        qsl_all = list(qsl) + [rows] * (S - 2 - n) + [size, size]
        lens_all = list(lens) + [0] * (S - 2 - n) + [size - rows, 0]
        return qsl_all, lens_all

    def load(self, meta: AttentionMetadata) -> int:
        """The step's attention inputs into the heads of the static buffers; -> its program count."""
        n, rows = meta.num_reqs, meta.num_tokens
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.query_start_loc[: n + 1].copy_(meta.query_start_loc)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.page_tables[:n, : meta.page_tables.shape[1]].copy_(meta.page_tables)
        if self.window is not None:
            self.window.load(meta.windowed, n)
        programs = meta.programs
        assert programs is not None and programs.block_q == self.block_q
        count = programs.num_programs
        self.prog_req[:count].copy_(programs.req)
        self.prog_q0[:count].copy_(programs.q0)
        return count

    def pad(self, size: int, n: int, rows: int, programs: int) -> None:
        """Padding for a step of n sequences, `rows` rows and `programs` attention programs already loaded."""
        S, pad = self.num_slots, size - rows
        self.query_start_loc[n + 1: S - 1].fill_(rows)
        self.query_start_loc[S - 1:].fill_(size)
        self.seq_lens[n: S - 2].zero_()
        self.seq_lens[S - 2].fill_(pad)
        if pad:
            self.slot_mapping[rows: size].copy_(self.pad_slots[:pad])
            if self.window is not None:
                self.window.pad_rows(rows, size, 0)
        k = -(-pad // self.block_q)
        self.prog_req[programs: programs + k].fill_(self.pad_seq)
        self.prog_q0[programs: programs + k].copy_(self.q0_ramp[:k])
        self.prog_req[programs + k:].fill_(self.empty_seq)
        self.prog_q0[programs + k:].zero_()


class WindowGraphInputs:
    """The window group's half of a graph's static attention inputs (KV cache groups: engine/kv_groups.py): its
    slots and page tables (the query starts, lengths and program map are the step's, shared with the full group),
    with padding rows and sequences in the window group's own scratch pages."""

    def __init__(self, pad_slots: list[int], seqs: int, width: int, scratch_pages: list[int], device: torch.device,
                 cycle_row: int | None = None):
        """pad_slots: the padding slots of every row; cycle_row: a sequence slot whose page-table row cycles through
        the scratch pages (the mixed graphs' padding sequence; the others start as the scratch pages)."""
        i32 = dict(dtype=torch.int32, device=device)
        self.pad_slots = torch.tensor(pad_slots, dtype=torch.long, device=device)
        self.slot_mapping = self.pad_slots.clone()
        self.page_tables = torch.zeros(seqs, width, **i32)
        self.scratch_row = torch.tensor(scratch_pages, **i32)
        if cycle_row is None:
            self.page_tables[:, : len(scratch_pages)] = self.scratch_row
        else:
            ns = len(scratch_pages)
            self.page_tables[cycle_row] = torch.tensor([scratch_pages[j % ns] for j in range(width)], **i32)

    def meta(self, meta: AttentionMetadata, seqs: int, rows: int) -> AttentionMetadata:
        """The window group's view of the step `meta` over the static buffers (its first seqs / rows)."""
        return dataclasses.replace(meta, page_tables=self.page_tables[:seqs], slot_mapping=self.slot_mapping[:rows])

    def load(self, windowed: AttentionMetadata, n: int) -> None:
        """A step's window-group slots and page tables (of its n sequences) into the heads of the buffers."""
        self.slot_mapping[: windowed.slot_mapping.shape[0]].copy_(windowed.slot_mapping)
        self.page_tables[:n, : windowed.page_tables.shape[1]].copy_(windowed.page_tables)

    def pad_rows(self, rows: int, end: int, first_pad: int | None = None) -> None:
        """Rows rows .. end - 1 padding: the padding slots of those rows (first_pad: from this one of them on)."""
        start = rows if first_pad is None else first_pad
        self.slot_mapping[rows: end].copy_(self.pad_slots[start: start + end - rows])

    def pad_seqs(self, n: int, size: int) -> None:
        """Sequences n .. size - 1 padding: their page-table rows the scratch pages."""
        self.page_tables[n:size, : self.scratch_row.numel()] = self.scratch_row
