"""The runner's side of the memory plan: what this engine's process had on the device at start, what the weights
and the largest step's activations take since (a profiling forward), and the KV pool that fits beside them, the same
number of pages on every rank of a parallel engine (the arithmetic is runtime/memory.py's)."""

from __future__ import annotations

import gc
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atlas.config import DEFAULT_CPU_KV_CACHE_BYTES
from atlas.runtime import memory
from atlas.runtime.sampler import SamplingRow

if TYPE_CHECKING:
    from atlas.config import EngineConfig, ModelConfig
    from atlas.layers.attention_backend import AttentionBackend
    from atlas.models.base import CausalLM
    from atlas.runtime.parallel import ParallelState
    from atlas.runtime.sampler import Sampler


def release_frames(exc: BaseException) -> None:
    """After a device ran out of memory: the finished frames of `exc`'s traceback let go of their tensors (the
    half-built model, the profile's caches), which the exception kept alive as long as it is held (a caller that
    catches the refusal and goes on), and the allocator's freed blocks go back to the device."""
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class PlannedModel:
    """What the plan sizes and profiles, given when the runner plans: none of it exists yet when the planner is
    made (before the model is built)."""

    model: CausalLM
    attention: AttentionBackend
    kv_dtype: torch.dtype
    page_bytes: int  # (the target's KV per page)
    state_bytes: int  # (a hybrid model's recurrent-state slots, 0 for others)
    snapshot_bytes: int  # (... and its recurrent-state snapshots)
    capture_layers: tuple[int, ...]
    pooling: bool  # (--runner pooling: no LM head, nothing sampled)
    sampler: Sampler
    # KV cache groups (engine/kv_groups.py): how the windowed layers' own pool grows, and its bytes per page (the
    # KV is then split between it and the pages of `page_bytes`, the global layers': memory.split_kv_groups).
    window_pool: memory.WindowPoolShape | None = None
    window_page_bytes: int = 0


class MemoryPlanner:
    """Sizes a runner's KV pool. Made before the model is built: on CUDA it measures the device then (what this
    engine adds is measured against it: other engines may share the process)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 block_size: int, max_model_len: int, parallel: ParallelState | None):
        self.config, self.model_config = config, model_config
        self.device, self.dtype, self.parallel = device, dtype, parallel
        self.block_size, self.max_model_len = block_size, max_model_len
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            self.free_at_start, self.total_memory = torch.cuda.mem_get_info()
            self.allocated_at_start = torch.cuda.memory_allocated(device)
            self.reserved_at_start = torch.cuda.memory_reserved(device)

    def plan(self, target: PlannedModel, max_num_seqs: int, max_num_batched_tokens: int, extra_page_bytes: int = 0,
             extra: dict[str, int] | None = None) -> memory.MemoryPlan:
        """Size the KV pool. `extra_page_bytes`: a drafter's KV per page, allocated beside the target's;
        `extra`: named buffers not allocated yet (e.g. the hidden-state capture buffer)."""
        cfg, device, block_size, max_model_len = self.config, self.device, self.block_size, self.max_model_len
        page_bytes = target.page_bytes + extra_page_bytes
        if target.state_bytes:  # (counted before the pages: one budget)
            extra = {**(extra or {}), "recurrent state": target.state_bytes}
        if target.snapshot_bytes:
            extra["recurrent-state snapshots"] = target.snapshot_bytes
        if cfg.num_gpu_blocks_override is not None:
            plan = memory.plan_fixed(device.type, page_bytes, block_size, cfg.num_gpu_blocks_override)
        elif device.type == "cpu":
            useful = max_num_seqs * -(-max_model_len // block_size) + 1
            plan = memory.plan_cpu(page_bytes, block_size, cfg.kv_cache_bytes, useful,
                                   DEFAULT_CPU_KV_CACHE_BYTES, target.state_bytes, target.snapshot_bytes)
        else:
            weights = torch.cuda.memory_allocated(device) - self.allocated_at_start
            try:
                peak = self.profile_activation_peak(target, max_num_seqs, max_num_batched_tokens)
            except torch.OutOfMemoryError as exc:
                release_frames(exc)
                raise memory.profiling_ran_out(exc, max_num_batched_tokens, max_num_seqs, weights,
                                               self.free_at_start) from exc
            free_now, total = torch.cuda.mem_get_info()
            # Memory taken on the device since start-up outside PyTorch's allocator (CUDA context,
            # cuBLAS workspaces, other libraries).
            reserved_growth = torch.cuda.memory_reserved(device) - self.reserved_at_start
            non_torch = max(0, (self.free_at_start - free_now) - reserved_growth)
            useful = max_num_seqs * -(-max_model_len // block_size) + 1
            if cfg.kv_cache_bytes is not None:
                plan = memory.plan_cuda_kv_bytes(page_bytes, block_size, cfg.kv_cache_bytes, self.free_at_start,
                                                 weights, peak, non_torch, extra, useful_pages=useful)
            else:
                plan = memory.plan_cuda(page_bytes, block_size, total, self.free_at_start,
                                        cfg.gpu_memory_utilization, weights, peak, non_torch, extra,
                                        useful_pages=useful)
        plan.breakdown.update({k: v for k, v in (extra or {}).items() if k not in plan.breakdown})
        if target.window_pool is not None:
            self._split_kv_groups(plan, target, max_num_seqs)
        if self.parallel is not None:  # page ids are the driver's: every rank holds as many pages
            pages = self.parallel.agree_min(plan.num_pages)
            if pages < plan.num_pages:
                plan.source += f", cut to {pages:,} pages, what every rank can hold"
            plan.num_pages = pages
            if target.window_pool is not None:
                plan.window_pages = self.parallel.agree_min(plan.window_pages)
            plan.source += f" (per rank, {self.parallel.world_size} ranks)"
        memory.check_fits(plan, max_model_len, device.type == "cuda")
        return plan

    def _split_kv_groups(self, plan: memory.MemoryPlan, target: PlannedModel, max_num_seqs: int) -> None:
        """KV cache groups: the plan's pages (sized in the global layers' pages) split between the two pools
        (memory.split_kv_groups); with --num-gpu-blocks-override, those are the global layers' pages and the window
        pool holds the windows of as many --max-model-len sequences as they hold."""
        shape, window_page_bytes = target.window_pool, target.window_page_bytes
        seq_pages = -(-self.max_model_len // self.block_size)
        if not plan.page_bytes:
            # (a pipeline stage without global layers sizes nothing here: the other ranks' plans bound both pools)
            window_pages = shape.pages(max_num_seqs)
        elif self.config.num_gpu_blocks_override is not None:
            window_pages = shape.pages(min(max_num_seqs, max(1, plan.num_pages // seq_pages)))
        else:
            plan.num_pages, window_pages = memory.split_kv_groups(
                plan.num_pages * plan.page_bytes, plan.page_bytes, window_page_bytes, shape, seq_pages, max_num_seqs)
        plan.window_pages, plan.window_page_bytes = window_pages, window_page_bytes

    @torch.inference_mode()
    def profile_activation_peak(self, target: PlannedModel, max_num_seqs: int, num_tokens: int) -> int:
        """Peak bytes above the weights during the largest step: a forward over `num_tokens` tokens
        (as prompts of at most max-model-len) plus sampling for max_num_seqs rows."""
        device, dtype, attention, model = self.device, self.dtype, target.attention, target.model
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        seq_lens = []
        left = num_tokens
        while left > 0:
            seq_lens.append(min(left, self.max_model_len))
            left -= seq_lens[-1]
        pages = [-(-n // self.block_size) for n in seq_lens]
        caches = attention.allocate(sum(pages), target.kv_dtype, device)
        page_tables, slots, first = [], [], 0
        for n, p in zip(seq_lens, pages, strict=True):
            page_tables.append(list(range(first, first + p)))
            slots.extend(attention.slots(page_tables[-1], 0, n))
            first += p
        positions = [i for n in seq_lens for i in range(n)]
        meta = attention.metadata_for_query_lens(seq_lens, seq_lens, page_tables, slots, device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        par = self.parallel
        stage = {}
        if par is not None and not par.is_first_stage:  # (a later pipeline stage: its layers on zeros)
            stage["intermediate"] = torch.zeros(2, num_tokens, self.model_config.hidden_size, dtype=dtype,
                                                device=device)
        hidden, _ = model(ids, torch.tensor(positions, device=device), caches, meta, target.capture_layers,
                          **stage)
        if (par is None or par.is_first_stage) and not target.pooling:  # (the LM head and sampler: first stage)
            rows = min(max_num_seqs, num_tokens)
            if par is not None and not par.is_last_stage:
                hidden = torch.zeros(rows, self.model_config.hidden_size, dtype=dtype, device=device)
            logits = model.compute_logits(hidden[:rows])
            probe = SamplingRow(1.0, 50, 0.9, 0.05, 1.1, 0.1, 0.1, None, 5, [1], [1], [])
            target.sampler(logits, [probe] * rows)
            del logits
        del caches, hidden
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
        return peak
