"""Paged attention: the per-step metadata object, the per-layer cache specs, and the GQA attention layer.

One `AttentionMetadata` describes a whole engine step: prefill chunks, decodes and speculative verify
rows are all "some query rows per request over that request's pages", so they share one code path.

The seam between a model and the runtime is the cache spec: each attention layer declares what it keeps
per token (`KVCacheSpec`: K and V planes of kv heads x head dim; `layers.mla.MLACacheSpec`: one latent
row). A spec is the attention backend's description of its cache (layers/attention_backend.py: the backend
object owns allocation, slots, the per-step metadata and the graphs' attention inputs): it gives the memory plan
its bytes per token, gives the backend the tensor layout its kernels read (`CacheLayout`, 8-bit ones included),
and the head packing of its kernels' program map. The layer that owns the spec makes the attention call (the
Triton kernel on CUDA, the PyTorch reference elsewhere). The scheduler and the page manager only ever see page
ids.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from atlas.kernels.paged_attention import ProgramMap, SplitScratch, paged_attention
from atlas.kernels.paged_attention_ref import v_transposed, write_kv_cache

if TYPE_CHECKING:
    from atlas.kernels.gated_delta_rule import RecurrentRows

# Per-step device tensors are slices of packed buffers. Triton specializes a kernel on whether each pointer is
# 16-byte aligned and each integer argument (a page-table row stride) divisible by 16: slices at offsets that
# follow the batch's shape made new variants of the attention kernel appear mid-serve, each a ~0.6 s compile
# that stalled every request. So every slice starts on a 16-byte boundary and page-table rows hold a multiple
# of 16 entries.
ALIGN_BYTES = 16
TABLE_ROW_MULTIPLE = 16


def aligned_count(n: int, element_size: int) -> int:
    """n elements rounded up so that the slice after them starts on a 16-byte boundary."""
    per = max(1, ALIGN_BYTES // element_size)
    return -(-n // per) * per


def table_width(max_pages: int) -> int:
    """Entries in a page-table row holding up to max_pages pages (at least one; a multiple of 16)."""
    return -(-max(1, max_pages) // TABLE_ROW_MULTIPLE) * TABLE_ROW_MULTIPLE


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; read by every attention layer.

    Device tensors are what kernels read; the `_cpu` lists let the reference path and the host
    avoid device-to-host copies.
    """

    query_start_loc: torch.Tensor  # [B+1] int32: request b owns rows [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache for b once this step's rows are written
    page_tables: torch.Tensor  # [B, max_pages] int32: page ids of each request, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each query row's new K/V
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # The attention kernels' program map (made with the step's other inputs, or by the first layer that needs
    # it) and split-KV partials (made by the first layer that needs them), shared by every layer of the step.
    programs: ProgramMap | None = None
    split_scratch: SplitScratch | None = None
    # Models with recurrent state (linear-attention layers): each request's state slot (the scheduler's
    # numbers), on the host and on the device; None where the model keeps none or the forward keeps no state.
    state_slots_cpu: list[int] | None = None
    state_slots: torch.Tensor | None = None
    # ... and in a step of the CUDA graphs (state_slots_cpu None), whether each sequence continues from its state
    # (its first row is not its position 0), made by the first linear-attention layer of the step.
    state_continues: torch.Tensor | None = None
    # ... and in an eager step, (sequence, rows, slot): that sequence's state after its first rows of the step is
    # copied to that slot too (a prefix-cache snapshot at a page boundary inside its prompt chunk).
    state_splits: list[tuple[int, int, int]] = field(default_factory=list)
    # ... and the index tensors an eager step's linear-attention layers build from the lists above: the first layer
    # builds them, the others reuse them (kernels/gated_delta_rule.py)
    varlen_cache: dict = field(default_factory=dict)
    # ... and in a mixed step of the CUDA graphs, every sequence's rows, slot and snapshot as device tensors
    # (kernels/gated_delta_rule.RecurrentRows; runtime/mixed_graphs.py fills them)
    state_rows: RecurrentRows | None = None
    # Models with KV cache groups (engine/kv_groups.py): the step as the windowed layers see it, through their own
    # pool's page tables and slots (the same query starts, lengths and program map); None for the others.
    windowed: AttentionMetadata | None = None

    def for_layer(self, sliding_window: int | None) -> AttentionMetadata:
        """The step as a layer with this sliding window (None: a global layer) reads and writes its cache: the
        window group's view for a windowed layer of a model with KV cache groups, else this one."""
        if sliding_window is None or self.windowed is None:
            return self
        return self.windowed

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


@dataclass(frozen=True)
class CacheLayout:
    """One layer's cache tensor: its shape and element type, and how its bytes are ordered where that differs
    from the shape (an 8-bit GQA cache keeps V transposed within each page: V's page p is [kv heads, head dim,
    block] in memory, though the tensor's shape says [block, kv heads, head dim]; kernels/paged_attention_ref.py
    reads and writes it through v_transposed)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    v_transposed: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class CacheSpec(ABC):
    """What one attention layer keeps per token in its paged cache (see the module docstring)."""

    #: Why this cache cannot be kept in 8-bit floats (--kv-cache-dtype fp8), for the start-up refusal; None where
    #: every writer and reader of it handles an 8-bit cache.
    no_8bit_path: ClassVar[str | None] = "its kernels read no 8-bit cache"

    @abstractmethod
    def values_per_token(self) -> int:
        """Cache elements one token takes in this layer."""

    @abstractmethod
    def cache_shape(self, num_pages: int, block_size: int) -> tuple[int, ...]:
        """Shape of the layer's whole cache tensor for num_pages pages of block_size tokens."""

    @property
    @abstractmethod
    def program_heads(self) -> tuple[int, int]:
        """(query heads, key heads) the backend's kernels pack into one program: they decide how many
        query rows a program takes, hence the program map prepared per step."""

    def layout(self, num_pages: int, block_size: int, dtype: torch.dtype) -> CacheLayout:
        """The cache tensor of num_pages pages in `dtype` (the attention backend allocates it)."""
        return CacheLayout(self.cache_shape(num_pages, block_size), dtype)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token() * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec(CacheSpec):
    """GQA: K and V planes of num_kv_heads x head_dim per token, layout [2, pages, block, kv heads, dim]
    (K then V, each flattening into one slot table; in an 8-bit cache V is transposed within each page:
    `layout(...).v_transposed`), read by kernels/paged_attention*.py."""

    num_kv_heads: int
    head_dim: int
    num_heads: int | None = None  # query heads (None: as many as kv heads)
    # A sliding-window layer reads only the last `sliding_window` positions (None: all of them); see
    # release_window for what that lets the page manager do.
    sliding_window: int | None = None
    no_8bit_path: ClassVar[str | None] = None

    def values_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def cache_shape(self, num_pages: int, block_size: int) -> tuple[int, ...]:
        return (2, num_pages, block_size, self.num_kv_heads, self.head_dim)

    @property
    def program_heads(self) -> tuple[int, int]:
        return (self.num_heads or self.num_kv_heads, self.num_kv_heads)

    def layout(self, num_pages: int, block_size: int, dtype: torch.dtype) -> CacheLayout:
        return CacheLayout(self.cache_shape(num_pages, block_size), dtype, v_transposed(dtype))


def release_window(windows: Sequence[int | None]) -> int | None:
    """The window W of a model whose layers have these sliding windows (None: a global layer) such that no layer
    ever reads a key more than W - 1 positions behind the query: the largest window when every layer has one,
    else None. Pages holding only keys that far behind every future query of a sequence can go back to the pool
    (engine/kv_cache.py). A model with a global layer keeps them all in its global layers' pool; its windowed layers'
    own pool releases them (KV cache groups: engine/kv_groups.py, AttentionMetadata.for_layer)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


class PagedAttention(nn.Module):
    """Stores this step's K/V rows in the layer's paged cache, then attends over the cache.

    `causal=False` gives every query row of a request full visibility of that request's keys (the
    DFlash drafter's in-block attention). `sliding_window` limits how far back a query sees; `chunk_size` limits a
    query to the keys of its chunk of that many positions (Llama 4's chunked local attention; its pages below the
    chunk go back to the pool as a window's do: `reach`); `softcap` soft-caps the scores (Gemma 2).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, causal: bool = True, chunk_size: int | None = None,
                 softcap: float | None = None):
        super().__init__()
        assert sliding_window is None or chunk_size is None, "a window or a chunk, not both"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.causal = causal
        self.chunk_size = chunk_size
        self.softcap = softcap

    @property
    def reach(self) -> int | None:
        """How many positions back a query may read at most (None: all of them): the window, or the chunk (a query
        reads its own chunk, which starts at most chunk_size - 1 positions back). The page manager may release
        pages past it (release_window, KV cache groups)."""
        return self.sliding_window if self.sliding_window is not None else self.chunk_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        write_kv_cache(kv_cache, k, v, meta.slot_mapping)
        return self.attend(q, kv_cache, meta)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the cache, whose rows for this step are already written. `sinks` [Hq]:
        this rank's heads' attention-sink logits (gpt-oss: one more score in each row's softmax, with no value)."""
        return paged_attention(q, kv_cache, meta, self.scale, self.causal, self.sliding_window, sinks,
                               self.chunk_size, self.softcap)
