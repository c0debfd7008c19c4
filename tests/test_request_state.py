"""The runner's per-request device state (runtime/request_state.py), driven by the deltas steps bring."""

from __future__ import annotations

import torch

from atlas.engine.request import Request
from atlas.runtime.batch import StepBatch
from atlas.runtime.request_state import RequestStates
from atlas.runtime.request_tables import snapshot_batch
from atlas.sampling_params import SamplingParams


def _seq(rid: str) -> Request:
    return Request(rid, rid, 0, None, [1, 2, 3], SamplingParams(), [])


def _batch(rids: list[str], **deltas) -> StepBatch:
    return snapshot_batch([_seq(r) for r in rids], [1] * len(rids), **deltas)


def test_a_seeded_request_draws_as_a_generator_seeded_with_its_seed_and_keeps_drawing_through_preemption():
    states = RequestStates(torch.device("cpu"))
    first = _batch(["a", "b"], seeded=[("a", 5)])
    states.bind(first)
    assert first.generators[1] is None
    reference = torch.Generator().manual_seed(5)
    drawn = torch.rand(3, generator=first.generators[0])
    assert torch.equal(drawn, torch.rand(3, generator=reference))
    later = _batch(["a"], preempted_request_ids=["a"])  # (recomputed after a preemption: the same generator)
    states.bind(later)
    assert later.generators[0] is first.generators[0]
    assert torch.equal(torch.rand(2, generator=later.generators[0]), torch.rand(2, generator=reference))
    states.bind(_batch(["b"], finished_request_ids=["a"]))
    assert states.get("a") is None and len(states) == 0


def test_drafts_are_bound_to_the_step_that_verifies_them_then_consumed():
    states = RequestStates(torch.device("cpu"))
    tokens, probs = torch.tensor([4, 5, 6]), torch.full((3, 8), 0.125)
    states.set_drafts([("a", probs, tokens, 2), ("b", None, None, 2), ("c", None, tokens, 0)])
    assert len(states) == 1  # (host drafts and empty ones leave no state)
    batch = _batch(["b", "a"])
    states.bind(batch)
    assert list(batch.draft_tokens) == [1] and batch.draft_tokens[1].tolist() == [4, 5]
    assert batch.draft_probs[1].shape == (2, 8) and batch.generators == [None, None]
    states.consumed(batch.seqs)
    assert len(states) == 0 and batch.draft_tokens[1].tolist() == [4, 5]  # (the step keeps what it bound)


def test_a_preemption_voids_drafts_and_a_read_back_makes_them_the_hosts():
    states = RequestStates(torch.device("cpu"))
    states.set_drafts([("a", torch.ones(3, 4), torch.tensor([7, 8, 9]), 3)])
    assert states.read_drafts("a", 2) == [7, 8] and states.read_drafts("a", 2) is None
    assert states.has_draft_probs("a")
    states.cut_draft_probs("a", 1)
    assert states.get("a").draft_probs.shape == (1, 4)
    states.bind(_batch(["b"], preempted_request_ids=["a"]))
    assert not states.has_draft_probs("a")
