"""The model runner's per-request state on the device, keyed by request id (vLLM's persistent input batch is the
model; the host tables beside it: runtime/request_tables.py): a seeded request's sampling generator, and the drafts
a proposer left for a request's next verify step (their ids while they stay on the device, their distributions when
they were sampled).

The scheduler and the Request hold host numbers only; this state changes by deltas. Each StepBatch brings the
requests first scheduled with a seed (a generator is made: the same seed, so the same draws as ever), the requests
that ended (forgotten) and those preempted (their drafts are void; a preempted request keeps its generator, whose
draws go on where they were). The engine hands over each batch of new drafts (`set_drafts`) and drops those a step
consumed (`consumed`). At launch a step binds what it uses (`bind`), so that it reads no state that changes after it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from atlas.runtime.batch import ScheduledSeq, StepBatch


@dataclass
class DeviceRequestState:
    generator: torch.Generator | None = None
    draft_tokens: torch.Tensor | None = None  # [k] drafts left on the device (Draft.device_tokens), until read back
    draft_probs: torch.Tensor | None = None  # [k, V] the drafts' distributions, when they were sampled

    @property
    def empty(self) -> bool:
        return self.generator is None and self.draft_tokens is None and self.draft_probs is None


class RequestStates:
    """Every request's device state that is not empty (most requests have none: no seed, drafts on the host)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.states: dict[str, DeviceRequestState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def get(self, request_id: str) -> DeviceRequestState | None:
        return self.states.get(request_id)

    def _apply_deltas(self, batch: StepBatch) -> None:
        states = self.states
        for rid in batch.finished_request_ids:
            states.pop(rid, None)
        for rid in batch.preempted_request_ids:
            state = states.get(rid)
            if state is not None:
                state.draft_tokens = state.draft_probs = None
                if state.empty:
                    del states[rid]
        for rid, seed in batch.seeded:
            # (the generator the request always had: seeded once, on the runner's device, drawn from only here)
            states.setdefault(rid, DeviceRequestState()).generator = torch.Generator(device=self.device).manual_seed(seed)

    def bind(self, batch: StepBatch) -> None:
        """At a step's launch: apply its deltas, then give it its sequences' generators and drafts."""
        self._apply_deltas(batch)
        states = self.states
        if not states:
            return
        found = [states.get(seq.request_id) for seq in batch.seqs]
        batch.generators = [s.generator if s is not None else None for s in found]
        for i, s in enumerate(found):
            if s is None:
                continue
            if s.draft_tokens is not None:
                batch.draft_tokens[i] = s.draft_tokens
            if s.draft_probs is not None:
                batch.draft_probs[i] = s.draft_probs

    def set_drafts(self, drafts: Iterable[tuple[str, torch.Tensor | None, torch.Tensor | None, int]]) -> None:
        """New drafts (Scheduler.take_drafts): (request id, probabilities, drafts on the device, how many the request
        keeps). They replace the request's earlier ones."""
        states = self.states
        for rid, probs, device, k in drafts:
            probs = probs[:k] if probs is not None and k else None
            tokens = None if device is None or not k else device if device.shape[0] == k else device[:k]
            state = states.get(rid)
            if state is None:
                if probs is None and tokens is None:
                    continue
                state = states[rid] = DeviceRequestState()
            state.draft_tokens, state.draft_probs = tokens, probs
            if state.empty:
                del states[rid]

    def consumed(self, seqs: Iterable[ScheduledSeq]) -> None:
        """A step's sequences verified their drafts (or had none): they are gone."""
        states = self.states
        if not states:
            return
        for seq in seqs:
            state = states.get(seq.request_id)
            if state is not None:
                state.draft_tokens = state.draft_probs = None
                if state.empty:
                    del states[seq.request_id]

    def read_drafts(self, request_id: str, n: int) -> list[int] | None:
        """The first n of a request's drafts left on the device, read back (a wait for the device), after which they
        are the host's; None when it has none there."""
        state = self.states.get(request_id)
        if state is None or state.draft_tokens is None:
            return None
        values = state.draft_tokens[: min(n, state.draft_tokens.shape[0])].tolist()
        state.draft_tokens = None
        return values

    def has_draft_probs(self, request_id: str) -> bool:
        state = self.states.get(request_id)
        return state is not None and state.draft_probs is not None

    def cut_draft_probs(self, request_id: str, k: int) -> None:
        """Keep the distributions of a request's first k drafts (none: k = 0)."""
        state = self.states.get(request_id)
        if state is not None and state.draft_probs is not None:
            state.draft_probs = state.draft_probs[:k] if k else None
