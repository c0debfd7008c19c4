"""Paged attention: the per-step metadata object, the per-layer cache specs, and the GQA attention layer.

One `AttentionMetadata` describes a whole engine step: prefill chunks, decodes and speculative verify
rows are all "some query rows per request over that request's pages", so they share one code path.

The seam between a model and the runtime is the cache spec: each attention layer declares what it keeps
per token (`KVCacheSpec`: K and V planes of kv heads x head dim; `layers.mla.MLACacheSpec`: one latent
row). A spec is the attention backend's description of its cache: it gives the memory plan its bytes per
token, gives `allocate_kv_caches` (the one place caches are made, for targets and drafters alike) the
tensor layout its kernels read, and gives the runner the head packing of its kernels' program map (the
per-step metadata the runner prepares once per step and bakes into CUDA graphs). The layer that owns
the spec makes the attention call (the Triton kernel on CUDA, the PyTorch reference elsewhere). The
scheduler and the page manager only ever see page ids.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from atlas.config import KV_CACHE_DTYPES
from atlas.errors import ConfigError
from atlas.host_copy import to_device
from atlas.kernels.paged_attention import paged_attention
from atlas.kernels.paged_attention_ref import write_kv_cache

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


def page_slots(pages: list[int], first: int, count: int, page_size: int) -> list[int]:
    """Cache slots of positions first .. first + count - 1 of a sequence whose KV pages are `pages`."""
    return [pages[p // page_size] * page_size + p % page_size for p in range(first, first + count)]


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
    block_tables: torch.Tensor  # [B, max_pages] int32: page ids of each request, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each query row's new K/V
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Per-step values a kernel derives from the above once and reuses in every layer.
    kernel_cache: dict = field(default_factory=dict)
    # Models with recurrent state (linear-attention layers): each request's state slot (the scheduler's
    # numbers), on the host and on the device; None where the model keeps none or the forward keeps no state.
    state_slots_cpu: list[int] | None = None
    state_slots: torch.Tensor | None = None

    @classmethod
    def for_query_lens(cls, q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], slots: list[int],
                       block_size: int, device: torch.device) -> AttentionMetadata:
        """`build` from each sequence's number of query rows (its query start is the sum of those before it)."""
        return cls.build([0, *itertools.accumulate(q_lens)], seq_lens, block_tables, slots, block_size, device)

    @classmethod
    def build(cls, query_start_loc: list[int], seq_lens: list[int], block_tables: list[list[int]],
              slots: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
        """From host lists: one tensor each (the page tables padded with page 0, never read past a
        sequence's length)."""
        width = table_width(max((len(t) for t in block_tables), default=1))
        num_reqs = len(block_tables)
        # One int32 copy (query starts, lengths, tables) and one int64 (slots), from pinned memory on CUDA:
        # a drafter builds these right after a step is read back, and pageable copies hold the host.
        o_lens = aligned_count(len(query_start_loc), 4)
        base = o_lens + aligned_count(len(seq_lens), 4)
        packed = [0] * (base + num_reqs * width)
        packed[: len(query_start_loc)] = query_start_loc
        packed[o_lens: o_lens + len(seq_lens)] = seq_lens
        for i, t in enumerate(block_tables):
            packed[base + i * width: base + i * width + len(t)] = t
        ints = to_device(packed, torch.int32, device)
        return cls(
            query_start_loc=ints[: len(query_start_loc)],
            seq_lens=ints[o_lens: o_lens + len(seq_lens)],
            block_tables=ints[base:].view(num_reqs, width),
            slot_mapping=to_device(slots, torch.long, device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=max((b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)), default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
        )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


class CacheSpec(ABC):
    """What one attention layer keeps per token in its paged cache (see the module docstring)."""

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

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token() * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec(CacheSpec):
    """GQA: K and V planes of num_kv_heads x head_dim per token, layout [2, pages, block, kv heads, dim]
    (K then V, each flattening into one slot table; in an 8-bit cache V is transposed within each page,
    paged_attention_ref.v_transposed), read by kernels/paged_attention*.py."""

    num_kv_heads: int
    head_dim: int
    num_heads: int | None = None  # query heads (None: as many as kv heads)
    # A sliding-window layer reads only the last `sliding_window` positions (None: all of them); see
    # release_window for what that lets the page manager do.
    sliding_window: int | None = None

    def values_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def cache_shape(self, num_pages: int, block_size: int) -> tuple[int, ...]:
        return (2, num_pages, block_size, self.num_kv_heads, self.head_dim)

    @property
    def program_heads(self) -> tuple[int, int]:
        return (self.num_heads or self.num_kv_heads, self.num_kv_heads)


def kv_cache_dtype(name: str, model_dtype: torch.dtype, specs: Sequence[CacheSpec]) -> torch.dtype:
    """The element type of a target model's caches for --kv-cache-dtype `name`: the model dtype for auto;
    float8 e4m3 for fp8 / fp8_e4m3, unscaled (K and V saturate at +-448: post-norm keys and values of
    the models served sit far inside it; vLLM's default without calibrated scales), which the GQA kernels
    read (the Triton kernel widens each tile it loads, to fp16 under bf16 queries; the reference widens the
    rows it gathers). MLA's latent cache has no 8-bit path: refused."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    other = sorted({type(spec).__name__ for spec in specs if not isinstance(spec, KVCacheSpec)})
    if other:
        raise ConfigError(f"--kv-cache-dtype {name} is for GQA attention caches; this model's layers keep "
                          f"{', '.join(other)} caches, which have no 8-bit path: drop the flag (auto)")
    return torch.float8_e4m3fn


def allocate_kv_caches(specs: Sequence[CacheSpec], num_pages: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer, each in its spec's layout, all addressed by the same page ids.
    Targets and drafters allocate their caches here."""
    return [torch.zeros(spec.cache_shape(num_pages, block_size), dtype=dtype, device=device) for spec in specs]


def release_window(windows: Sequence[int | None]) -> int | None:
    """The window W of a model whose layers have these sliding windows (None: a global layer) such that no layer
    ever reads a key more than W - 1 positions behind the query: the largest window when every layer has one,
    else None. Pages holding only keys that far behind every future query of a sequence can go back to the pool
    (engine/kv_cache.py); a model with a global layer keeps them all (one page table serves every layer)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def program_heads(specs: Sequence[CacheSpec]) -> tuple[int, int]:
    """The (query heads, key heads) packing shared by every layer of a model (the per-step program map
    is built once for all layers, so they must agree)."""
    packs = {spec.program_heads for spec in specs}
    if len(packs) != 1:
        raise ValueError(f"layers of one model pack attention heads differently: {sorted(packs)}")
    return packs.pop()


class PagedAttention(nn.Module):
    """Stores this step's K/V rows in the layer's paged cache, then attends over the cache.

    `causal=False` gives every query row of a request full visibility of that request's keys (the
    DFlash drafter's in-block attention). `sliding_window` limits how far back a query sees.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, causal: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        write_kv_cache(kv_cache, k, v, meta.slot_mapping)
        return self.attend(q, kv_cache, meta)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the cache, whose rows for this step are already written. `sinks` [Hq]:
        this rank's heads' attention-sink logits (gpt-oss: one more score in each row's softmax, with no value)."""
        return paged_attention(q, kv_cache, meta, self.scale, self.causal, self.sliding_window, sinks)
