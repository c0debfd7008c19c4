"""The runner's side of the memory plan: what this engine's process had on the device at start, what the weights
and the largest step's activations take since (a profiling forward), and the KV pool that fits beside them, the same
number of pages on every rank of a parallel engine (the arithmetic is runtime/memory.py's)."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from atlas.config import DEFAULT_CPU_KV_CACHE_BYTES
from atlas.runtime import memory
from atlas.runtime.sampler import SamplingRow

if TYPE_CHECKING:
    from atlas.runtime.model_runner import ModelRunner


class MemoryPlanner:
    """Sizes a runner's KV pool. Made before the model is built: on CUDA it measures the device then (what this
    engine adds is measured against it: other engines may share the process)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        device = runner.device
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            self.free_at_start, self.total_memory = torch.cuda.mem_get_info()
            self.allocated_at_start = torch.cuda.memory_allocated(device)
            self.reserved_at_start = torch.cuda.memory_reserved(device)

    def plan(self, max_num_seqs: int, max_num_batched_tokens: int, extra_page_bytes: int = 0,
             extra: dict[str, int] | None = None) -> memory.MemoryPlan:
        """Size the KV pool. `extra_page_bytes`: a drafter's KV per page, allocated beside the target's;
        `extra`: named buffers not allocated yet (e.g. the hidden-state capture buffer)."""
        r = self.runner
        cfg = r.config
        page_bytes = r.page_bytes + extra_page_bytes
        if r.state_bytes:  # (counted before the pages: one budget)
            extra = {**(extra or {}), "recurrent state": r.state_bytes}
        if r.snapshot_bytes:
            extra["recurrent-state snapshots"] = r.snapshot_bytes
        if cfg.num_gpu_blocks_override is not None:
            plan = memory.plan_fixed(r.device.type, page_bytes, r.block_size, cfg.num_gpu_blocks_override)
        elif r.device.type == "cpu":
            useful = max_num_seqs * -(-r.max_model_len // r.block_size) + 1
            plan = memory.plan_cpu(page_bytes, r.block_size, cfg.kv_cache_bytes, useful,
                                   DEFAULT_CPU_KV_CACHE_BYTES, r.state_bytes, r.snapshot_bytes)
        else:
            weights = torch.cuda.memory_allocated(r.device) - self.allocated_at_start
            peak = self.profile_activation_peak(max_num_seqs, max_num_batched_tokens)
            free_now, total = torch.cuda.mem_get_info()
            # Memory taken on the device since start-up outside PyTorch's allocator (CUDA context,
            # cuBLAS workspaces, other libraries).
            reserved_growth = torch.cuda.memory_reserved(r.device) - self.reserved_at_start
            non_torch = max(0, (self.free_at_start - free_now) - reserved_growth)
            plan = memory.plan_cuda(page_bytes, r.block_size, total, self.free_at_start,
                                    cfg.gpu_memory_utilization, weights, peak, non_torch, extra,
                                    useful_pages=max_num_seqs * -(-r.max_model_len // r.block_size) + 1)
        plan.breakdown.update({k: v for k, v in (extra or {}).items() if k not in plan.breakdown})
        if r.parallel is not None:  # page ids are the driver's: every rank holds as many pages
            pages = r.parallel.agree_min(plan.num_pages)
            if pages < plan.num_pages:
                plan.source += f", cut to {pages:,} pages, what every rank can hold"
            plan.num_pages = pages
            plan.source += f" (per rank, {r.parallel.world_size} ranks)"
        memory.check_fits(plan, r.max_model_len, r.device.type == "cuda")
        return plan

    @torch.inference_mode()
    def profile_activation_peak(self, max_num_seqs: int, num_tokens: int) -> int:
        """Peak bytes above the weights during the largest step: a forward over `num_tokens` tokens
        (as prompts of at most max-model-len) plus sampling for max_num_seqs rows."""
        r = self.runner
        torch.cuda.synchronize(r.device)
        torch.cuda.reset_peak_memory_stats(r.device)
        base = torch.cuda.memory_allocated(r.device)
        seq_lens = []
        left = num_tokens
        while left > 0:
            seq_lens.append(min(left, r.max_model_len))
            left -= seq_lens[-1]
        pages = [-(-n // r.block_size) for n in seq_lens]
        caches = r.attention.allocate(sum(pages), r.kv_dtype, r.device)
        block_tables, slots, first = [], [], 0
        for n, p in zip(seq_lens, pages, strict=True):
            block_tables.append(list(range(first, first + p)))
            slots.extend(r.attention.slots(block_tables[-1], 0, n))
            first += p
        positions = [i for n in seq_lens for i in range(n)]
        meta = r.attention.metadata_for_query_lens(seq_lens, seq_lens, block_tables, slots, r.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=r.device)
        par = r.parallel
        stage = {}
        if par is not None and not par.is_first_stage:  # (a later pipeline stage: its layers on zeros)
            stage["intermediate"] = torch.zeros(2, num_tokens, r.model_config.hidden_size, dtype=r.dtype,
                                                device=r.device)
        hidden, _ = r.model(ids, torch.tensor(positions, device=r.device), caches, meta, r.capture_layers,
                            **stage)
        if (par is None or par.is_first_stage) and r.pooler is None:  # (the LM head and sampler: first stage)
            rows = min(max_num_seqs, num_tokens)
            if par is not None and not par.is_last_stage:
                hidden = torch.zeros(rows, r.model_config.hidden_size, dtype=r.dtype, device=r.device)
            logits = r.model.compute_logits(hidden[:rows])
            probe = SamplingRow(1.0, 50, 0.9, 0.05, 1.1, 0.1, 0.1, None, 5, [1], [1], [])
            r.sampler(logits, [probe] * rows)
            del logits
        del caches, hidden
        torch.cuda.synchronize(r.device)
        peak = torch.cuda.max_memory_allocated(r.device) - base
        torch.cuda.empty_cache()
        return peak
