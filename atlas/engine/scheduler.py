"""The scheduler: each step, who runs and how many tokens each computes; and, once the step's tokens
are known, what they change. Every page change happens here and in the page manager.

vLLM-v1 style: there are no separate prefill and decode phases. Every running request asks for the
tokens it has not computed yet (a prefill chunk, 1 for a decode, 1 + K with drafts), within one
token budget per step. Running requests are served first, in arrival order; waiting ones are admitted
first-come first-served while budget, sequence slots and pages last. When pages run out, the most
recently arrived running request is preempted (its pages freed; it is recomputed later, first in
line), so the oldest requests always make progress.

Fair slots (first come, first served only): while sequences of other requests wait, the sequences of one user
request (its `n` samples over every prompt of one API call: `Request.group_id`) hold at most
`max_seqs_per_request` slots (--max-num-seqs-per-request). Admission skips a sequence of a request at its share
while another request waits below its own, and a newcomer under its share that finds every slot taken takes one from
the request holding the most slots above its share (that sequence is preempted and recomputed later, its prompt
from the prefix cache): so a request with n = 128 cannot keep every other client waiting until it ends, and a
newcomer runs at the next step. With nobody else waiting, one request may use every slot.

Fair rows: while a request at or under its share runs or waits, a request holding more slots than its share
computes only `max_seqs_per_request` of its sequences a step, those that ran least recently first (the rest keep
their pages and skip the step): so the other requests' steps are not those of the whole batch, and a short
request's latency does not grow with someone else's n. Requests all above their share run every sequence.

`schedule()` counts the scheduled positions as computed at once. With asynchronous scheduling the
next step is scheduled while this one runs: a request whose token is still on the device
(`num_pending_tokens`) decodes it next, and the runner takes that input from the device.
`update_from_output()` then appends the tokens, winds back rejected drafts (and their pages),
registers full pages in the prefix cache, finishes requests on stop tokens and lengths, and asks
the proposer for the next drafts.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from atlas.engine.kv_cache import KVCacheManager, StateSlotPool
from atlas.engine.request import Request, RequestStatus
from atlas.outputs import ITL_BUCKETS, STEP_TOKEN_BUCKETS, BucketCounts, SpecDecodeCounters
from atlas.runtime.batch import CommittedTokens, ScheduledSeq, StepBatch, StepResult, window

if TYPE_CHECKING:
    from atlas.speculative.policy import SpeculationPolicy
    from atlas.speculative.proposer import DraftProposer

logger = logging.getLogger(__name__)

_FINISHED = frozenset(s for s in RequestStatus if s.is_finished)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Pad every request's drafts to this many when any request of the step has drafts, so that
    # verify steps are uniform (and replay a CUDA graph). None: no padding.
    pad_drafts_to: int | None = None
    # Schedule a request whose last token is still on the device (its next step reads it there). False
    # (pipeline parallelism): it waits until that token is read back.
    schedule_pending: bool = True
    # Steps kept in flight at once (pipeline stages): each step takes at most its share of the requests,
    # so that the stages get micro-batches of similar size.
    micro_batches: int = 1
    # --scheduling-policy priority: waiting requests in (priority, arrival) order; a waiting request ahead of
    # a running one takes its slot (one a step) or its pages. False: first come, first served, fair slots.
    priority: bool = False
    # Fair slots (module docstring): the most slots one request's sequences hold while another request waits.
    # None: max_num_seqs (no share).
    max_seqs_per_request: int | None = None
    # Fair budget: while another request waits, one prompt chunk computes at most this many tokens of a step, so
    # that a long prompt leaves the rest of the budget to the prompts behind it (vLLM's
    # long_prefill_token_threshold). None: no cap.
    long_prefill_tokens: int | None = None
    # --enable-lora: steps carry each sequence's adapter slot (StepBatch.lora_slots).
    lora: bool = False

    def __post_init__(self) -> None:
        share = self.max_seqs_per_request
        if share is not None and not (isinstance(share, int) and 1 <= share <= self.max_num_seqs):
            raise ValueError(f"max_seqs_per_request must be a whole number from 1 to max_num_seqs "
                             f"({self.max_num_seqs}), got {share!r}")
        cap = self.long_prefill_tokens
        if cap is not None and not (isinstance(cap, int) and cap >= 1):
            raise ValueError(f"long_prefill_tokens must be a positive whole number, got {cap!r}")

    @property
    def share(self) -> int:
        return self.max_num_seqs if self.max_seqs_per_request is None else self.max_seqs_per_request


@dataclass
class EngineStats(SpecDecodeCounters):
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_finished: int = 0
    finished_reasons: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (the per-request counters are SpecDecodeCounters').
    spec_num_drafted_steps: int = 0  # engine steps that verified drafts
    # The speculation policy: drafts per request of its last decision (0: plain steps), its probes (one drafted
    # step while drafting is off) and its switches between drafting and plain steps.
    spec_draft_length: int = 0
    spec_policy_probes: int = 0
    spec_policy_switches: int = 0
    # Histograms read by the metrics (vLLM's inter_token_latency_seconds and iteration_tokens_total): the seconds
    # between a request's outputs after its first, and the tokens each step computes.
    inter_token_latency: BucketCounts = field(default_factory=lambda: BucketCounts(ITL_BUCKETS))
    step_tokens: BucketCounts = field(default_factory=lambda: BucketCounts(STEP_TOKEN_BUCKETS))


@dataclass
class SchedulerOutput:
    batch: StepBatch  # (the runner's snapshot of the step)
    requests: list[Request]  # the live requests of the batch's sequences, in order (the engine's side)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class RequestUpdate:
    """What one step changed for one request, for output processing (detokenization, stop strings,
    logprob entries, RequestOutputs), which runs off the critical path."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, proposer: DraftProposer | None = None,
                 state_slots: StateSlotPool | None = None):
        """state_slots: a hybrid model's recurrent-state slots (one per running request: taken when it is admitted,
        given back when it finishes or is preempted; a preempted request is recomputed from its first token, or from
        a prefix-cache hit). With prefix caching such a model's state is saved where its prompt chunk crosses a
        snapshot point (inside the step, or at its end), and the step carries the state copies
        (StepBatch.state_loads / state_saves; engine/kv_cache.py)."""
        self.config = config
        self.kv = kv
        self.state_slots = state_slots
        self.proposer = proposer
        # Whether the requests whose next step is a decode draft for it (the engine's speculation policy sets
        # it before each step); the policy, told every verify step's acceptance.
        self.drafting = True
        # A length below the proposer's K that the policy gave the drafting steps (a draft-length ladder): drafts are
        # cut and padded to it; None: K.
        self.draft_length: int | None = None
        self.policy: SpeculationPolicy | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.running_changes = 0  # requests that joined or left `running` so far (the policy's "same batch" test)
        self.num_preemptions = 0
        self._steps = 0  # steps scheduled so far (fair rows: which sequences ran least recently)
        self.num_fair_row_skips = 0  # sequences that skipped a step to fair rows (each skip counted)
        self._turn_ranks: dict[int, int] = {}
        self.stats = EngineStats()
        self._last_output_time: float | None = None  # (update_from_output's previous `now`)
        self._arrivals = itertools.count()
        # Deltas for the runner's per-request device state, handed over with the next step (StepBatch): requests
        # first scheduled with a seed, requests that ended, requests preempted.
        self._seeded: list[tuple[str, int]] = []
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        # Drafts made since the engine last took them: (request id, draft probabilities, drafts on the device,
        # how many of them the request keeps); the engine hands them to the runner (take_drafts).
        self._new_drafts: list[tuple[str, object, object, int]] = []

    # ------------------------------------------------------------------ queue management
    def add(self, req: Request) -> None:
        req.arrival_order = next(self._arrivals)
        if self.config.priority:
            self._insert_waiting(req)
        else:
            self.waiting.append(req)
        if self.proposer is not None:
            self.proposer.on_request_start(req)

    @staticmethod
    def _rank(req: Request) -> tuple[int, int]:
        """Priority order: lower `priority` first, then earlier arrival."""
        return req.params.priority, req.arrival_order

    def _insert_waiting(self, req: Request) -> None:
        bisect.insort_right(self.waiting, req, key=self._rank)

    def _victim(self) -> Request:
        """The running request that gives way when pages run out: the last running one, i.e. the most recently
        admitted, or under the priority policy the last in priority order (`running` is kept in that order). The
        running loop of `schedule` walks `running` from the front, so the victim is never a request it has
        already scheduled this step (it is the request being scheduled, or one after it)."""
        return self.running[-1]

    def _yield_slot(self) -> None:
        """Priority policy: every slot taken and a waiting request ahead of the last running one in priority
        order: that one is preempted (at most one a step)."""
        if not self.waiting or len(self.running) < self.config.max_num_seqs:
            return
        head = self.waiting[0]
        victim = self._victim()
        if head.params.priority < victim.params.priority:
            self._preempt(victim)
            logger.debug("%s (priority %d) takes the slot of %s (priority %d)", head.request_id,
                         head.params.priority, victim.request_id, victim.params.priority)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take req out of the queues and give its pages back (a second call changes nothing)."""
        was_finished = req.is_finished
        req.status = status
        if was_finished:
            return
        if req in self.running:
            self.running.remove(req)
            self.running_changes += 1
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self._release_slot(req)
        req.clear_drafts()
        self._finished_ids.append(req.request_id)
        req.metrics.finished_time = time.time()
        self.stats.num_finished += 1
        self.stats.finished_reasons[status.value] = self.stats.finished_reasons.get(status.value, 0) + 1
        if self.proposer is not None:
            self.proposer.on_request_finish(req)
        if self.policy is not None:
            self.policy.forget(req.request_id)

    def decoding_requests(self) -> list[Request]:
        """Running requests whose next step is a decode (at most their last token left to compute)."""
        return [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]

    def remaining_tokens(self, req: Request) -> int:
        """The most tokens this request may still produce (its max_tokens, the context's end)."""
        left = self.config.max_model_len - req.num_tokens
        if req.params.max_tokens is not None:
            left = min(left, req.params.max_tokens - req.num_output_tokens)
        return max(0, left)

    def set_drafting(self, drafting: bool) -> None:
        """From the next read-back on, decodes draft (or not). (Drafts on the requests now belong to the step in
        flight, which verifies them: they stay.)"""
        self.drafting = drafting

    def _release_slot(self, req: Request) -> None:
        if req.state_slot is not None:
            self.state_slots.release(req.state_slot)
            req.state_slot = None
        req.state_replay = 0

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.running_changes += 1
        self.kv.free(victim)
        self._release_slot(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.runner_outputs = 0  # (the runner forgets its copy: they all go again when it is scheduled)
        victim.clear_drafts()
        if self.proposer is not None:
            self.proposer.on_request_preempt(victim)
        self._preempted_ids.append(victim.request_id)
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.priority:
            self._insert_waiting(victim)
        else:
            self.waiting.appendleft(victim)
        logger.debug("preempted %s (pages exhausted); it will be recomputed", victim.request_id)

    def _share_slots(self) -> None:
        """Fair slots (module docstring): the waiting sequences of requests under their share, in queue order, go
        to the front of the queue; where the free slots do not cover them, sequences of the requests holding the
        most slots above their share are preempted (never below the share)."""
        cap, max_seqs = self.config.share, self.config.max_num_seqs
        if not self.waiting or cap >= max_seqs:
            return
        held = Counter(r.group_id for r in self.running)
        entitled: list[Request] = []
        taking: Counter = Counter()
        passed_over = False  # (a sequence at its share ahead of an entitled one: the queue is reordered)
        reorder = False
        for r in self.waiting:
            g = r.group_id
            if held[g] + taking[g] < cap:
                taking[g] += 1
                entitled.append(r)
                reorder |= passed_over
                if len(entitled) >= max_seqs:
                    break
            else:
                passed_over = True
        if not entitled:
            return
        need = len(entitled) - (max_seqs - len(self.running))
        while need > 0:
            group, most = max(held.items(), key=lambda kv: kv[1])
            if most <= cap:
                break
            victim = next(r for r in reversed(self.running) if r.group_id == group)
            self._preempt(victim)
            held[group] -= 1
            need -= 1
            reorder = True
            logger.debug("%s held %d of %d sequence slots while others waited: %s preempted", group, most,
                         max_seqs, victim.request_id)
        if not reorder:
            return
        # (the entitled ones first, in their order; then the rest, preempted ones first as before)
        chosen = set(map(id, entitled))
        rest = [r for r in self.waiting if id(r) not in chosen]
        self.waiting = deque(entitled + rest)

    def _sliced_out(self) -> set[int]:
        """Fair rows (module docstring): the running sequences that skip this step (their ids), of the requests
        holding more slots than their share while another request, at or under its share, runs or waits."""
        share = self.config.share
        if self.config.priority or share >= self.config.max_num_seqs or not self.running:
            return set()
        held = Counter(r.group_id for r in self.running)
        over = {g for g, n in held.items() if n > share}
        if not over or not (any(n <= share for n in held.values()) or any(g not in over for g in self._waiting_counts())):
            return set()
        skip: set[int] = set()
        for g in over:
            members = sorted((r for r in self.running if r.group_id == g), key=lambda r: r.last_scheduled)
            skip.update(id(r) for r in members[share:])
            # (the order they were picked in breaks the next tie: those picked last this step go last next time)
            self._turn_ranks.update((id(r), rank) for rank, r in enumerate(members[:share]))
        return skip

    # ------------------------------------------------------------------ one step
    def _ends_before_next_token(self, req: Request) -> bool:
        """A request whose pending token already reaches max_tokens or the context ends with it: it
        needs no further step."""
        total = req.num_tokens + req.num_pending_tokens
        max_tokens = req.params.max_tokens
        return total >= self.config.max_model_len or (
            max_tokens is not None and req.num_output_tokens + req.num_pending_tokens >= max_tokens)

    def _release_out_of_window(self, req: Request) -> None:
        """A windowed model: req's pages below its window go back to the pool (KVCacheManager.release_out_of_window);
        a drafter keeping rows for those pages writes them first."""
        if self.kv.release_out_of_window(req) and self.proposer is not None:
            self.proposer.on_pages_released()

    def _num_new_tokens(self, req: Request, budget: int, pad_to: int) -> tuple[int, int]:
        """(tokens req computes this step, of which draft positions): its uncomputed known tokens plus
        its drafts (padded to pad_to for a decode), within the budget and the context. Drafts that do
        not fit are dropped (a verify needs all of its rows)."""
        known = req.num_tokens + req.num_pending_tokens - req.num_computed_tokens
        drafts = req.spec_token_ids
        if pad_to and known == 1 and not req.num_pending_tokens and len(drafts) < pad_to:
            # Padding rows repeat the last real token; their outputs are never read.
            filler = drafts[-1] if drafts else req.all_token_ids[-1]
            req.spec_num_real = len(drafts)
            drafts.extend([filler] * (pad_to - len(drafts)))
        else:
            req.spec_num_real = len(drafts)
        n = min(known + len(drafts), budget, self.config.max_model_len - req.num_computed_tokens)
        if drafts:
            keep = max(0, n - known)
            del drafts[keep:]
            req.spec_num_real = min(req.spec_num_real, keep)
        return n, max(0, n - known)

    def _block_ahead(self, req: Request, n: int) -> int:
        """Slots past a verify step's rows for the drafter's next block, when the proposer drafts right after
        the step (its block then starts at the first position the step did not keep, at most K + 1 on)."""
        proposer = self.proposer
        if proposer is None or not proposer.drafts_after_verify:
            return 0
        ahead = proposer.lookahead_slots
        return ahead if req.num_computed_tokens + n + ahead <= self.config.max_model_len else 0

    def _cut_at_snapshot(self, req: Request, n: int, first: int) -> int:
        """Recurrent-state snapshots: a prompt chunk from `first` may cross one of req's snapshot points (the state
        there is saved inside the step, between two passes of each linear-attention layer); one that would cross a
        second ends at it (the state after it is saved; the rest of the prompt follows in the next step)."""
        point = self.kv.snapshot_point(req, first)
        if not (point and first < point < first + n):
            return n
        after = self.kv.snapshot_point(req, point)
        if after and after < first + n and self.kv.can_snapshot():
            return after - first
        return n

    def _reserve_snapshot(self, req: Request, n: int) -> None:
        """Each of req's snapshot points within this step's rows (at most two: one inside, one at the end, as
        _cut_at_snapshot leaves it) saves its state there (StepBatch.state_saves: slot, snapshot, rows before it)."""
        if not self.kv.num_snapshots:
            return
        first = req.num_computed_tokens
        point = self.kv.snapshot_point(req, first)
        while point and point <= first + n:
            snap = self.kv.reserve_snapshot(req, point)
            if snap is None:
                return  # (none to be had: nothing is saved)
            self._state_saves.append((req.state_slot, snap, point - first))
            point = self.kv.snapshot_point(req, point)

    def _cap_prompt_chunk(self, req: Request, n: int) -> int:
        """Fair budget (SchedulerConfig.long_prefill_tokens): req's prompt chunk of n tokens, cut to the cap while
        a request of another user request waits."""
        cap = self.config.long_prefill_tokens
        if cap is None or n <= cap or req.spec_token_ids:
            return n
        waiting = self._waiting_counts()
        if len(waiting) > (req.group_id in waiting):
            return cap
        return n

    def _waiting_counts(self) -> Counter:
        """The waiting sequences by group (counted once a step, when first asked; admission takes its own out)."""
        if self._waiting_groups is None:
            self._waiting_groups = Counter(r.group_id for r in self.waiting)
        return self._waiting_groups

    def schedule(self) -> SchedulerOutput:
        self._state_loads: list[tuple[int, int]] = []  # (snapshot id, state slot): before the step's forward
        self._state_saves: list[tuple[int, int, int]] = []  # (state slot, snapshot id, rows of the step before it)
        self._state_backups: list[int] = []  # state slots backed up before the forward (they verify drafts)
        # ... and (slot, kept rows) restored from that backup and replayed before it (some drafts were rejected)
        self._state_replays: list[tuple[int, int]] = []
        budget = self.config.max_num_batched_tokens
        self._waiting_groups: Counter | None = None  # (the waiting requests' groups, counted once a step when needed)
        scheduled: list[tuple[Request, int, int]] = []  # (request, tokens, draft rows)
        preempted: list[Request] = []
        pad_to = (self.config.pad_drafts_to or 0) if any(r.spec_token_ids for r in self.running) else 0
        if pad_to and self.draft_length:  # (a ladder length has verify graphs of its own: pad to it)
            pad_to = min(pad_to, self.draft_length)
        cap = self.config.max_num_seqs
        if self.config.micro_batches > 1:
            cap = -(-min(cap, len(self.running) + len(self.waiting)) // self.config.micro_batches)

        if self.config.priority:
            self._yield_slot()
        else:
            self._share_slots()
        self._turn_ranks = {}
        sliced_out = self._sliced_out()
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cap:
            req = self.running[i]
            if req.num_pending_tokens and (not self.config.schedule_pending or self._ends_before_next_token(req)):
                i += 1  # finishes with the token in flight, or waits for it
                continue
            if id(req) in sliced_out:
                i += 1  # fair rows: its request is over its share while a smaller one runs or waits
                self.num_fair_row_skips += 1
                self._release_out_of_window(req)  # (what its next step will not read goes back meanwhile)
                continue
            # (a windowed model: pages no query of this step or a later one reaches go back first)
            self._release_out_of_window(req)
            n, draft_rows = self._num_new_tokens(req, budget, pad_to)
            if not draft_rows:
                n = self._cap_prompt_chunk(req, n)
            if not draft_rows and self.kv.num_snapshots:
                n = self._cut_at_snapshot(req, n, req.num_computed_tokens)
            ahead = self._block_ahead(req, n) if draft_rows else 0
            if ahead and not self.kv.allocate(req, n + ahead):
                ahead = 0  # (its drafts are then made after the step is read back, as without)
            while not self.kv.allocate(req, n):
                victim = self._victim()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                break  # req was the last running request; nothing after it to schedule
            self._reserve_snapshot(req, n)
            if req.state_replay:
                self._state_replays.append((req.state_slot, req.state_replay))
                req.state_replay = 0
            if draft_rows and req.state_slot is not None:
                self._state_backups.append(req.state_slot)
            scheduled.append((req, n, draft_rows))
            budget -= n
            i += 1

        # Admit waiting requests, first come first served, unless pages ran short this step; a request at its
        # share of the slots lets the ones behind it go first while they wait (fair slots).
        skipped: list[Request] = []
        share = self.config.share
        held = queued = hungry = None
        if share < self.config.max_num_seqs and not self.config.priority and self.waiting:
            held = Counter(r.group_id for r in self.running)
            queued = self._waiting_counts()
            hungry = {g for g in queued if held[g] < share}  # requests waiting below their share
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted
               and len(scheduled) < cap):
            req = self.waiting[0]
            if req.num_pending_tokens:
                break  # preempted with a token still in flight: wait until it is read
            if held is not None and held[req.group_id] >= share and hungry:
                skipped.append(self.waiting.popleft())  # at its share while another request waits below its own
                continue
            shared_from = None
            if req.share_from is not None:
                sibling = req.share_from
                # (wait for the sibling's prompt pages: scheduled, or with recurrent state computed, since its
                #  snapshot is found by the prefix-cache lookup once the step that saved it is read back)
                started = sibling.num_output_tokens + (0 if self.state_slots is not None else sibling.num_pending_tokens)
                if not sibling.is_finished and started == 0:
                    skipped.append(self.waiting.popleft())
                    continue
                if (sibling.num_computed_tokens >= req.num_prompt_tokens - 1 and self.state_slots is None
                        and not sibling.is_finished):
                    self.kv.share_prefix(sibling, req, req.num_prompt_tokens - 1)
                    shared_from = sibling
                # (recurrent state: the pages alone do not carry it; the prefix-cache lookup below resumes from the
                #  sibling's snapshot. A finished sibling's pages went back to the pool: the lookup finds those the
                #  prefix cache kept)
                req.share_from = None
            cached = [] if req.num_computed_tokens else self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
            n = self._cap_prompt_chunk(req, n)
            if self.kv.num_snapshots:
                n = self._cut_at_snapshot(req, n, req.num_computed_tokens + num_cached)
            if not self.kv.allocate(req, n, cached):
                if shared_from is not None:
                    # (the shared pages go back: a waiting request holding pages would keep them from the running
                    #  ones, which could then only preempt one another, never finishing; it shares again when admitted)
                    self.kv.free(req)
                    req.num_computed_tokens = 0
                    req.share_from = shared_from
                break
            self._release_out_of_window(req)  # (of a prefix-cache hit or a shared prompt)
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = req.num_computed_tokens
                self.kv.record_lookup(req, req.num_computed_tokens)
                req.metrics.first_scheduled_time = time.time()
                if req.seed is not None:
                    self._seeded.append((req.request_id, req.seed))
            self.waiting.popleft()
            if self.state_slots is not None and req.state_slot is None:
                # (fewer requests run than there are slots; a fresh slot's content is never read unless a prefix-cache
                #  hit loads it from the snapshot at the hit's end: nothing else (a sibling's pages) gives models with
                #  state a head start)
                req.state_slot = self.state_slots.allocate()
                if cached:
                    self._state_loads.append((self.kv.snapshot_of(cached[-1]), req.state_slot))
                assert req.num_computed_tokens == len(cached) * self.kv.block_size, \
                    "a request with recurrent state must start at its first token or at a snapshot"
            self._reserve_snapshot(req, n)
            req.status = RequestStatus.RUNNING
            if self.config.priority:  # (kept in priority order: see _victim)
                bisect.insort_right(self.running, req, key=self._rank)
            else:
                self.running.append(req)
            self.running_changes += 1
            scheduled.append((req, n, 0))
            budget -= n
            g = req.group_id
            if self._waiting_groups is not None:  # (req is no longer one of them)
                self._waiting_groups[g] -= 1
                if not self._waiting_groups[g]:
                    del self._waiting_groups[g]
            if held is not None:
                held[g] += 1
                if not queued[g] or held[g] >= share:
                    hungry.discard(g)
        self.waiting.extendleft(reversed(skipped))
        return self._make_output(scheduled, preempted)

    def _make_output(self, scheduled: list[tuple[Request, int, int]], preempted: list[Request]) -> SchedulerOutput:
        """Snapshot the step's numbers, and each sequence's record for the runner (ScheduledSeq: its window of tokens,
        its page-table change, ...), and count its positions as computed."""
        start, samples, drafts, pending, outputs, draft_rows, on_device = [], [], [], [], [], [], []
        seqs: list[ScheduledSeq] = []
        table_change = self.kv.table_change
        # (models with KV cache groups: the windowed layers' tables change too; engine/kv_groups.py)
        window_change = getattr(self.kv, "window_table_change", None)
        record = tuple.__new__  # (a record made so skips the NamedTuple's own __new__: 0.2 us less a sequence)
        self._steps += 1
        for i, (req, n, rows) in enumerate(scheduled):
            req.last_scheduled = (self._steps, self._turn_ranks.get(id(req), 0))
            first, in_flight = req.num_computed_tokens, req.num_pending_tokens
            known = len(req.all_token_ids)
            m = (1 + req.spec_num_real) if rows else max(0, first + n - known - in_flight + 1)
            pending_input = in_flight > 0 and first == known
            start.append(first)
            samples.append(m)
            drafts.append(req.spec_num_real if rows else 0)
            pending.append(pending_input)
            outputs.append(len(req.output_token_ids) + in_flight)
            draft_rows.append(rows)
            if rows and req.spec_num_real and req.spec_on_device:
                on_device.append(i)
            new_outputs = None
            if req.penalized:
                new_outputs = req.output_token_ids[req.runner_outputs:]
                req.runner_outputs += len(new_outputs)
            scored = req.prompt_logprobs
            pages = table_change(req)
            window_pages = window_change(req) if window_change is not None else None
            if (pending_input and n == 1 and pages is None and new_outputs is None and scored is None
                    and window_pages is None):
                # Nothing new for the runner (penalized requests always bring their new outputs, if none): the
                # request's one shared record. (A record a step per sequence, kept while the step is in flight, made
                # the collector run every step and a full collection every few hundred: 4 % of a batch-256 decode
                # on the H200.)
                rec = req.idle_record
                if rec is None:
                    rec = req.idle_record = record(ScheduledSeq, (req.request_id, (), None, req.params,
                                                                  req.stop_token_ids, req.prompt_token_ids, None, None,
                                                                  None))
                seqs.append(rec)
            else:
                seqs.append(record(ScheduledSeq, (
                    req.request_id,
                    window(req.all_token_ids, req.spec_token_ids, first + 1, n - 1) if pending_input
                    else window(req.all_token_ids, req.spec_token_ids, first, n),
                    pages, req.params, req.stop_token_ids, req.prompt_token_ids, new_outputs,
                    None if scored is None else len(scored) - 1, window_pages)))
            req.num_computed_tokens = first + n
            if m:
                req.num_pending_tokens += 1
        batch = StepBatch(seqs, [n for _, n, _ in scheduled], start=start,
                          num_sample_rows=samples, num_drafts=drafts, pending_input=pending, num_output_tokens=outputs,
                          num_draft_rows=draft_rows, device_drafts=on_device,
                          plain_speculation=self.proposer is not None and not self.drafting and not any(draft_rows),
                          draft_cut=(self.draft_length or 0) if any(draft_rows) else 0,
                          state_slots=[r.state_slot for r, _, _ in scheduled] if self.state_slots is not None else [],
                          state_loads=self._state_loads, state_saves=self._state_saves,
                          state_backups=self._state_backups, state_replays=self._state_replays,
                          lora_slots=[r.lora_slot for r, _, _ in scheduled] if self.config.lora else [])
        if scheduled:  # (an empty step is not launched: its deltas wait for the next one)
            batch.seeded, self._seeded = self._seeded, []
            batch.finished_request_ids, self._finished_ids = self._finished_ids, []
            batch.preempted_request_ids, self._preempted_ids = self._preempted_ids, []
        return SchedulerOutput(batch, [r for r, _, _ in scheduled], preempted)

    # ------------------------------------------------------------------ after the step
    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[RequestUpdate]:
        """Apply a finished step: tokens, rollback of rejected drafts, prefix-cache pages, stops, drafts
        for the next step. -> one update per request with something new for its output."""
        batch = out.batch
        now = time.time()
        stats = self.stats
        stats.step_tokens.add(batch.num_tokens)
        # Inter-token latencies: requests whose last output came with the previous step's (most of a batch) share
        # one gap, counted once at the end; the others (a first decode after a prefill elsewhere, a preempted one)
        # one at a time.
        itl, previous, with_previous = stats.inter_token_latency, self._last_output_time, 0
        updates: list[RequestUpdate] = []
        commits: list[CommittedTokens] = []
        done: list[tuple[Request, RequestStatus]] = []
        proposer = self.proposer
        collect_commits = proposer is not None and proposer.takes_commits
        all_sampled, all_logprobs, all_prompt_lp = result.sampled_token_ids, result.logprobs, result.prompt_logprobs
        # (the next verify step's rows and its block: positions num_tokens - 1 .. num_tokens + 2q - 2)
        keep_ahead = (proposer.lookahead_slots + proposer.num_draft_tokens
                      if proposer is not None and proposer.drafts_after_verify else 0)
        drafted_step = any(batch.num_drafts)
        for i, req in enumerate(out.requests):
            sampled = all_sampled[i]
            if batch.num_sample_rows[i]:
                req.num_pending_tokens -= 1
            status = req.status
            if status in _FINISHED:
                continue  # aborted or stopped while this step ran: its rows are void
            preempted = status is RequestStatus.PREEMPTED
            n, start, draft_rows = batch.num_scheduled[i], batch.start[i], batch.num_draft_rows[i]
            num_drafts = batch.num_drafts[i]
            accepted = len(sampled) - 1 if num_drafts else 0
            num_valid = n - draft_rows + accepted if sampled else n - draft_rows
            if not preempted:
                # KV of rejected and padding draft positions is not valid: wind back.
                req.num_computed_tokens -= n - num_valid
                if draft_rows and n > num_valid and req.state_slot is not None:
                    # Recurrent state advanced past the rejected rows and cannot be wound back: before the next step
                    # the runner restores the backup taken before this one and replays the kept rows' saved inputs
                    # through the linear-attention layers (runtime/state_slots.py), which kept 1 + K rows a slot.
                    if n > proposer.num_draft_tokens + 1:
                        raise RuntimeError(f"a verify step of {n} rows for {req.request_id}: the recurrent state keeps "
                                           f"the inputs of {proposer.num_draft_tokens + 1} rows a slot for a replay")
                    req.state_replay = num_valid
                if start < req.num_prompt_tokens:
                    stats.num_prompt_tokens += min(start + num_valid, req.num_prompt_tokens) - start
                if collect_commits:
                    hidden = result.hidden[i] if result.hidden else None
                    commits.append(CommittedTokens(req, start, num_valid, hidden, num_valid if draft_rows else None))
            if req.spec_token_ids:
                req.clear_drafts()  # (their device part: the engine tells the runner, DeviceDrafts.consumed)
            prompt_lp = all_prompt_lp[i] if all_prompt_lp else None
            if result.pooled and result.pooled[i] is not None:  # --runner pooling: the prompt is done
                req.embedding = result.pooled[i]
                req.metrics.first_token_time = now
                updates.append(RequestUpdate(req, []))
                done.append((req, RequestStatus.FINISHED_STOPPED))
                continue
            if not sampled:
                if prompt_lp:
                    updates.append(RequestUpdate(req, [], None, prompt_lp))
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            elif req.last_token_time == previous:
                with_previous += 1
            else:
                itl.add(now - req.last_token_time)
            req.last_token_time = now
            if num_drafts and n == 1 + draft_rows and self.policy is not None:
                self.policy.observe_verify(req.request_id, accepted, batch.draft_cut or None)
            if num_drafts:
                req.metrics.count_verify(num_drafts, accepted)
                stats.count_verify(num_drafts, accepted)
            emitted, status = self._append_tokens(req, sampled)
            logprobs = all_logprobs[i][: len(emitted)] if all_logprobs[i] is not None else None
            updates.append(RequestUpdate(req, emitted, logprobs, prompt_lp))
            if status is not None:
                done.append((req, status))
            elif n > num_valid and not preempted:
                # Pages of rejected positions go back, except those the next verify step and the block behind it
                # reserve again (a block drafted behind this step wrote there, at the slots the next verify reuses).
                keep = keep_ahead if draft_rows else 0
                self.kv.trim(req, min(req.num_tokens + keep, self.config.max_model_len))

        if with_previous:
            itl.add(now - previous, with_previous)
        self._last_output_time = now
        if drafted_step:
            stats.spec_num_drafted_steps += 1
        if self.kv.enable_prefix_caching:
            for req in out.requests:
                if req.status not in _FINISHED:
                    self.kv.cache_computed_pages(req)
        if collect_commits:
            proposer.on_commit(commits)
        for req, status in done:
            self.finish(req, status)
        if self.proposer is not None and self.drafting:
            self.prepare_drafts()
        return updates

    def _append_tokens(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens one by one, stopping exactly where plain decoding would on a stop token or a
        length limit (stop strings are the output processor's). -> (the tokens appended, the status
        that ends the request or None)."""
        outputs, all_tokens = req.output_token_ids, req.all_token_ids
        stops, min_tokens = req.stop_token_set, req.params.min_tokens
        max_outputs, max_len = req.max_output_tokens, self.config.max_model_len
        for k, token in enumerate(tokens):
            outputs.append(token)
            all_tokens.append(token)
            if token in stops and len(outputs) >= min_tokens:
                self.stats.num_generation_tokens += k + 1
                req.stop_reason = None if token in req.eos_token_ids else token
                return tokens[: k + 1], RequestStatus.FINISHED_STOPPED
            if len(outputs) >= max_outputs or len(all_tokens) >= max_len:
                self.stats.num_generation_tokens += k + 1
                return tokens[: k + 1], RequestStatus.FINISHED_LENGTH
        self.stats.num_generation_tokens += len(tokens)
        return tokens, None

    def prepare_drafts(self) -> None:
        """Drafts for every running request whose next step is a decode, with the lookahead pages a
        drafter writes into."""
        proposer = self.proposer
        candidates = []
        for req in self.running:
            if req.is_finished or req.num_computed_tokens != req.num_tokens - 1:
                continue
            if proposer.lookahead_slots and not self.kv.allocate(req, proposer.lookahead_slots):
                continue  # no pages for the drafter's scratch rows: decode plainly this time
            candidates.append(req)
        if not candidates:
            return
        for req, draft in zip(candidates, proposer.propose(candidates), strict=True):
            if not draft.token_ids and self.policy is not None:
                # The proposer has nothing for it (n-gram without a match): in a batch that counts as accepting
                # nothing, or a batch where none has a draft would stay in drafting's synchronous steps; alone,
                # as a plain step (SpeculationPolicy.observe_empty).
                self.policy.observe_empty(req.request_id, len(candidates))
            # Never draft past max_tokens or the context: those tokens could not be kept.
            room = self.config.max_model_len - req.num_tokens
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - req.num_output_tokens)
            k = max(0, min(len(draft.token_ids), room - 1, self.draft_length or len(draft.token_ids)))
            req.spec_token_ids = list(draft.token_ids[:k])
            req.spec_on_device = draft.device_tokens is not None and k > 0
            self._new_drafts.append((req.request_id, draft.probs, draft.device_tokens, k))

    def take_drafts(self) -> list[tuple[str, object, object, int]]:
        """The drafts made since the last call: (request id, probabilities or None, drafts on the device or None,
        how many the request keeps), for the runner (which owns their device part)."""
        drafts, self._new_drafts = self._new_drafts, []
        return drafts
