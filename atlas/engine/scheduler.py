"""The scheduler: each step, who runs and how many tokens each computes.

vLLM-v1 style: there are no separate prefill and decode phases. Every running request asks for the
tokens it has not computed yet (a prefill chunk, 1 for a decode, 1 + K with drafts), within one
token budget per step. Running requests are served first, in arrival order; waiting ones are admitted
first-come first-served while budget, sequence slots and pages last. When pages run out, the most
recently arrived running request is preempted (its pages freed; it is recomputed later, first in
line), so the oldest requests always make progress.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from atlas.engine.kv_cache import KVCacheManager
from atlas.engine.request import Request, RequestStatus
from atlas.runtime.batch import StepBatch

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class SchedulerOutput:
    batch: StepBatch
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.batch.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue management
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take req out of the queues and give its pages back."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.spec_token_ids = []

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        logger.debug("preempted %s (pages exhausted); it will be recomputed", victim.request_id)

    # ------------------------------------------------------------------ one step
    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens req computes this step: its uncomputed known tokens plus its drafts, within the
        budget and the context. Drafts that do not fit are dropped (a verify needs all of its rows)."""
        known = req.num_tokens - req.num_computed_tokens
        n = min(known + len(req.spec_token_ids), budget, self.config.max_model_len - req.num_computed_tokens)
        if req.spec_token_ids:
            del req.spec_token_ids[max(0, n - known):]
        return n

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                break  # req was the last running request; nothing after it to schedule
            seqs.append(req)
            counts.append(n)
            budget -= n
            i += 1

        # Admit waiting requests, first come first served, unless pages ran short this step.
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting[0]
            if req.share_from is not None:
                sibling = req.share_from
                if not sibling.is_finished and sibling.num_output_tokens == 0:
                    skipped.append(self.waiting.popleft())  # wait for the sibling's prompt pages
                    continue
                if sibling.num_computed_tokens >= req.num_prompt_tokens - 1:
                    self.kv.share_prefix(sibling, req, req.num_prompt_tokens - 1)
                req.share_from = None
            cached = [] if req.num_computed_tokens else self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate(req, n, cached):
                break
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = req.num_computed_tokens
                self.kv.record_lookup(req, req.num_computed_tokens)
                req.metrics.first_scheduled_time = time.time()
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seqs.append(req)
            counts.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return SchedulerOutput(StepBatch(seqs, counts), preempted)
