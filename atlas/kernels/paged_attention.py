"""Attention over the paged KV cache: picks the Triton kernel on CUDA and the PyTorch reference
elsewhere (or where the kernel cannot run the shape). Both compute the same function; tests compare
them case by case."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from atlas.kernels import settings, triton_available
from atlas.kernels.paged_attention_ref import paged_attention_ref

logger = logging.getLogger(__name__)

MAX_TRITON_HEAD_DIM = 256
# Split-KV: decode steps only (prefill and verify have enough programs), at most this many splits.
SPLIT_MAX_QUERY_LEN = 1
MAX_KV_SPLITS = 32


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_shape(num_heads: int, num_kv_heads: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q query tokens, BLOCK_M packed rows) for one program."""
    group = num_heads // num_kv_heads
    if max_query_len == 1:
        return 1, max(16, _next_power_of_2(group))
    block_m = max(64, _next_power_of_2(group))
    return max(1, block_m // group), block_m


@dataclass(frozen=True)
class ProgramMap:
    """The attention kernels' grid for one step: program i serves query rows q0[i] .. q0[i] + block_q - 1 of
    request req[i]. Made once per step (by the attention backend, or here on first use) and read by every layer."""

    block_q: int
    req: torch.Tensor  # [programs] int32
    q0: torch.Tensor  # [programs] int32

    @property
    def num_programs(self) -> int:
        return self.req.numel()


@dataclass(frozen=True)
class SplitScratch:
    """The float32 (m, l, acc) partials of a split-KV call, made by the step's first layer and reused by the
    rest (kernels run in stream order); `shape` (tokens, heads, head dim, splits) says which calls it fits."""

    shape: tuple[int, int, int, int]
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    # (the attention_fused_combine knob: int32 zeros, one a (token, head), that the last split of each program
    #  counts up to and sets back to 0)
    counts: torch.Tensor | None = None


def program_map(query_start_loc: list[int], block_q: int, device: torch.device) -> ProgramMap:
    """For each program: the request it serves and its first query index within that request."""
    reqs, starts = [], []
    for r in range(len(query_start_loc) - 1):
        q_len = query_start_loc[r + 1] - query_start_loc[r]
        for q0 in range(0, q_len, block_q):
            reqs.append(r)
            starts.append(q0)
    return ProgramMap(block_q, torch.tensor(reqs, dtype=torch.int32, device=device),
                      torch.tensor(starts, dtype=torch.int32, device=device))


def step_programs(meta, block_q: int, device: torch.device) -> ProgramMap:
    """The step's program map for block_q-row programs: the one the step was prepared with, else made now and
    kept on `meta` (AttentionMetadata) for the step's other layers."""
    programs = meta.programs
    if programs is None or programs.block_q != block_q:
        programs = meta.programs = program_map(meta.query_start_loc_cpu, block_q, device)
    return programs


def step_split_scratch(meta, num_tokens: int, num_heads: int, head_dim: int, splits: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's split-KV partials of this shape: made by the first layer that asks, kept on `meta`."""
    return _step_scratch(meta, (num_tokens, num_heads, head_dim, splits), device).partials


def step_split_counts(meta, num_tokens: int, num_heads: int, head_dim: int, splits: int,
                      device: torch.device) -> torch.Tensor:
    """The step's counts for splits that merge their own partials (zeros, one a (token, head): at least one a
    program and KV head), beside its partials on `meta`."""
    shape = (num_tokens, num_heads, head_dim, splits)
    scratch = _step_scratch(meta, shape, device)
    if scratch.counts is None:
        scratch = meta.split_scratch = SplitScratch(shape, scratch.partials, torch.zeros(
            num_tokens * num_heads, dtype=torch.int32, device=device))
    return scratch.counts


def _step_scratch(meta, shape: tuple[int, int, int, int], device: torch.device) -> SplitScratch:
    scratch = meta.split_scratch
    if scratch is None or scratch.shape != shape:
        from atlas.kernels.paged_attention_triton import split_scratch

        scratch = meta.split_scratch = SplitScratch(shape, split_scratch(*shape, device))
    return scratch


def num_kv_splits(num_programs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per program's key range: the largest power of two (up to MAX_KV_SPLITS) keeping
    programs x KV heads x splits within two waves of SMs; 1 (no split) when the unsplit grid already
    fills more than one wave. A function of the program count only, so that a captured CUDA graph's
    batch size fixes it."""
    ctas = max(1, num_programs * num_kv_heads)
    target = 2 * num_sms
    if ctas * 2 > target:
        return 1
    return min(MAX_KV_SPLITS, 1 << ((target // ctas).bit_length() - 1))


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_kv_enabled() -> bool:
    """Split-KV decode for both kernels: on unless --no-split-kv (EngineConfig.split_kv, kernels/settings.py). GQA: a batch-1 step of the 8B shape 1.5 %
    shorter on one H200 and 5 % at TP=2; a split row sums its keys in another order than the unsplit kernel
    of a verify step, so in bf16 speculative outputs can drift from plain decoding's (as with the single-row
    GEMV; float32 stays exact). MLA: one unsplit program walks a request's whole context for all its heads,
    31x slower at batch 1 and 8K tokens (BENCHMARKS.md)."""
    return settings.split_kv


def use_triton(query: torch.Tensor) -> bool:
    return query.is_cuda and query.shape[-1] <= MAX_TRITON_HEAD_DIM and triton_available()


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, causal: bool,
                    sliding_window: int | None, sinks: torch.Tensor | None = None,
                    chunk_size: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] for the step that `meta` (AttentionMetadata) describes; `sinks` [Hq]: each
    head's attention-sink logit (gpt-oss), one more term of the softmax's denominator; `chunk_size`: each query
    sees the keys of its chunk only (Llama 4's chunked local attention); `softcap`: scores soft-capped to
    softcap * tanh(score / softcap) (Gemma 2)."""
    if not use_triton(query):
        return paged_attention_ref(query, kv_cache, meta.query_start_loc_cpu, meta.seq_lens_cpu,
                                   meta.page_tables, scale, causal, sliding_window, sinks, chunk_size, softcap)
    from atlas.kernels.paged_attention_triton import paged_attention_triton

    block_q, block_m = block_shape(query.shape[1], kv_cache.shape[3], meta.max_query_len)
    programs = step_programs(meta, block_q, query.device)
    num_heads, num_kv_heads, head_dim = query.shape[1], kv_cache.shape[3], query.shape[2]
    splits, scratch, counts = 1, None, None
    if meta.max_query_len <= SPLIT_MAX_QUERY_LEN and split_kv_enabled():
        splits = num_kv_splits(programs.num_programs, num_kv_heads, sm_count(query.device.index or 0))
    if splits > 1:
        scratch = step_split_scratch(meta, query.shape[0], num_heads, head_dim, splits, query.device)
        if settings.tuning.attention_fused_combine:
            counts = step_split_counts(meta, query.shape[0], num_heads, head_dim, splits, query.device)
    return paged_attention_triton(query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.page_tables,
                                  programs.req, programs.q0, block_q, block_m, scale, causal, sliding_window,
                                  num_splits=splits, scratch=scratch, sinks=sinks, chunk_size=chunk_size,
                                  softcap=softcap, counts=counts)
