"""The speculation policy: drafting only where measured acceptance pays for the measured verify step.

The policy's arithmetic is tested alone (no torch); the engine tests run real drafters on the CPU and read
the engine's counters: a drafter that is never right is switched off within a few steps and the outputs stay
those of plain decoding; a drafter that becomes right is found again by the probes; the DFlash drafter keeps
its context through a plain stretch whose steps overlap (its rows are written behind each step).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import CUDA_KV, assert_pages_returned
from test_dflash import write_drafter

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError
from atlas.speculative.policy import SpeculationPolicy, bucket_of
from atlas.speculative.proposer import Draft, DraftProposer


def _measured(policy: SpeculationPolicy, batch: int, plain_s: float, verify_s: float, times: int = 3) -> None:
    for _ in range(times):
        policy.observe_step(False, batch, plain_s)
        policy.observe_step(True, batch, verify_s)


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 16, 17, 256)] == [1, 2, 4, 4, 8, 16, 32, 256]


def test_drafting_pays_only_where_acceptance_beats_the_cost_ratio():
    policy = SpeculationPolicy(num_draft_tokens=4)
    _measured(policy, 16, plain_s=0.010, verify_s=0.020)  # a verify step costs 2 plain steps
    ids = [f"r{i}" for i in range(16)]
    for r in ids:
        policy.observe_verify(r, 0)
    assert policy.expected_tokens(ids) == pytest.approx(1.0)
    assert not policy.decide(ids)
    for _ in range(6):  # acceptance 3 a step: 4 tokens per verify step against a cost of 2
        for r in ids:
            policy.observe_verify(r, 3)
    assert policy.expected_tokens(ids) > 2.1
    assert policy.decide(ids) and policy.draft_length == 4
    # The same acceptance where verifying costs 5 plain steps: not worth it.
    big = [f"b{i}" for i in range(200)]
    _measured(policy, 200, plain_s=0.010, verify_s=0.050)
    for _ in range(6):
        for r in big:
            policy.observe_verify(r, 3)
    assert not policy.decide(big) and policy.draft_length == 0


def test_before_any_verify_step_is_measured_drafting_off_still_probes():
    """Every proposal so far was empty (no verify step to measure): the policy stays off but probes, spaced as if
    a verify step cost `unmeasured_ratio` plain steps, so a request that later has drafts is found."""
    policy = SpeculationPolicy(num_draft_tokens=4)
    policy.observe_verify("a", 0)
    decisions = [policy.decide(["a"]) for _ in range(200)]
    spacing = math.ceil((policy.unmeasured_ratio - 1.0) / policy.probe_budget)
    assert sum(decisions) == policy.probes == 200 // spacing


def test_drafts_never_accepted_never_pay_however_cheap_a_verify_step_looks():
    """On a busy host a verify step's measured period can come out below a plain step's: a draft that is never
    accepted must still not look worth drafting (the ratio is at least 1)."""
    policy = SpeculationPolicy(num_draft_tokens=3)
    _measured(policy, 16, plain_s=0.006, verify_s=0.005)
    ids = [f"r{i}" for i in range(16)]
    for r in ids:
        policy.observe_verify(r, 0)
    assert policy.cost_ratio(16) == 1.0
    decisions = [policy.decide(ids, [32] * 16) for _ in range(40)]
    assert sum(decisions) == policy.probes == 40 // policy.min_probe_interval  # (the probes alone)


def test_a_short_first_period_does_not_hide_the_real_ones():
    """The first plain step after a verify step is launched while the device is idle: its period is the host's
    alone. The periods after it are the step's, several times longer, and must not be taken for idle gaps."""
    policy = SpeculationPolicy(num_draft_tokens=7)
    policy.observe_step(False, 1, 0.0005)
    for _ in range(6):
        policy.observe_step(False, 1, 0.004)
        policy.observe_step(True, 1, 0.006)
    assert policy.cost_ratio(1) == pytest.approx(1.5)
    policy.observe_step(True, 1, 1.0)  # (an idle gap: ignored)
    assert policy.cost_ratio(1) == pytest.approx(1.5)


def test_with_nothing_waiting_the_request_that_ends_last_decides():
    """A static batch (nothing waiting for a slot) where half the requests repeat themselves (every draft
    accepted) and half never accept: by throughput drafting pays (mean 3 tokens a step against a cost of 2),
    but the requests that accept nothing have as far to go and every drafted step would lengthen the batch's
    time by the ratio; once those are nearly done, the others' remainders decide."""
    policy = SpeculationPolicy(num_draft_tokens=4)
    _measured(policy, 16, plain_s=0.010, verify_s=0.020)
    loopers, plain = [f"l{i}" for i in range(8)], [f"p{i}" for i in range(8)]
    for _ in range(12):
        for r in loopers:
            policy.observe_verify(r, 4)
        for r in plain:
            policy.observe_verify(r, 0)
    ids = loopers + plain
    assert policy.expected_tokens(ids) == pytest.approx(3.0, abs=0.05)
    assert policy.decide(ids)  # requests wait for a slot (remaining unknown): throughput counts
    # Twelve steps of nothing bring the non-accepting requests' shrunk means below one draft: below the cost.
    assert policy.expected_tokens(ids, [100] * 16) < 1.0 + 1.0
    assert not policy.decide(ids, [100] * 16)
    for _ in range(30):
        for r in plain:
            policy.observe_verify(r, 0)
    assert policy.expected_tokens(ids, [100] * 16) < 1.2
    # The non-accepting requests have 5 tokens left, the loopers 100 (5 a verify step; their shrunk means, pulled
    # towards the others' nothing, say 2.7): several times shorter, more than the cost.
    assert policy.expected_tokens(ids, [100] * 8 + [5] * 8) > 2.5
    assert policy.decide(ids, [100] * 8 + [5] * 8)
    # One request: both tests agree.
    assert policy.expected_tokens(["l0"], [50]) == pytest.approx(policy.expected_tokens(["l0"]))


def test_with_nothing_waiting_requests_that_accept_in_bursts_keep_drafting():
    """Drafts on code are accepted in bursts: 4 in one step, none in the next two. Sixteen requests in a wave,
    in three phases of that pattern, each gain 1 + 4/3 tokens a verify step over their lives, more than the cost
    ratio of 1.8; the least of their short running means is far lower (a request just after two misses), and
    read alone it would keep the wave plain. The wall-time test reads each request's whole-life mean instead."""
    policy = SpeculationPolicy(num_draft_tokens=4, acceptance_weight=0.5)  # (short means of about 3 steps)
    _measured(policy, 16, plain_s=0.010, verify_s=0.018)
    ids = [f"r{i}" for i in range(16)]
    for step in range(9):
        for i, r in enumerate(ids):
            policy.observe_verify(r, 4 if (step + i) % 3 == 0 else 0)
    assert min(1.0 + policy.acceptance[r] for r in ids) < 1.8  # the short means: one would say "plain"
    assert policy.expected_tokens(ids, [100] * 16) == pytest.approx(1.0 + 4 / 3, abs=0.1)
    assert policy.decide(ids, [100] * 16)


def test_with_nothing_waiting_a_request_that_never_accepted_is_read_by_the_recent_onset_rate():
    """A request that has accepted nothing yet is, in the wall-time test, worth the mean of all requests over the share
    of its remaining steps expected after its first acceptance, at the rate at which the recent verify steps of such
    requests saw one (onset_window). Twelve requests repeating themselves (every draft accepted from the first step)
    and four that never match: after ten steps the recent such steps are all misses, so the four are worth nothing and
    the wave stays plain; shrunk towards the others' mean (the rule before, onset_window=0), they still looked worth
    two drafts after ten misses, and the wave drafted. Sixteen requests whose first acceptances come one a step (code:
    a request that has not matched yet mostly matches soon): the recent onsets keep the eight not yet started worth
    drafting for."""
    def wave(window: int | None, accepted) -> tuple[float, bool]:  # (window None: the default)
        policy = SpeculationPolicy(num_draft_tokens=4, **({} if window is None else {"onset_window": window}))
        _measured(policy, 16, plain_s=0.010, verify_s=0.015)
        ids = [f"r{i}" for i in range(16)]
        for step in range(10):
            for i, r in enumerate(ids):
                n = accepted(i, step)
                if n is not None:
                    policy.observe_verify(r, n)
        return policy.expected_tokens(ids, [100] * 16), policy.decide(ids, [100] * 16)

    def repeats(i: int, step: int) -> int:
        return 4 if i < 12 else 0

    def staggered(i: int, step: int) -> int | None:  # (eight steps: requests 8-15 have not matched yet)
        return None if step >= 8 else (4 if i <= step else 0)

    assert wave(None, repeats) == (1.0, False)
    gain, drafts = wave(0, repeats)
    assert gain > 1.5 * 1.05 and drafts
    gain, drafts = wave(None, staggered)
    assert gain > 1.5 * 1.05 and drafts
    # A lone request's step with no draft counts as a plain step short of paying (observe_empty), not as a first
    # acceptance: it stays among the requests that have accepted nothing.
    policy = SpeculationPolicy(num_draft_tokens=4)
    _measured(policy, 1, plain_s=0.010, verify_s=0.020)
    policy.observe_empty("alone", 1)
    assert policy.totals["alone"][0] > 0 and list(policy._onsets) == [False]


def test_an_empty_proposal_counts_as_nothing_in_a_batch_and_as_a_plain_step_alone():
    """n-gram finds a match in one step of three and then every draft is accepted. Alone, a step without a match
    is a plain step: the matches decide, and drafting pays (a verify step costs 2 plain ones and gives 5 tokens).
    In a batch the others' drafts are verified anyway and the request without a match gains nothing."""
    alone = SpeculationPolicy(num_draft_tokens=4)
    _measured(alone, 1, plain_s=0.010, verify_s=0.020)
    for step in range(12):
        if step % 3 == 0:
            alone.observe_verify("a", 4)
        else:
            alone.observe_empty("a", batch_size=1)
    assert alone.expected_tokens(["a"]) > 2.0 * 1.05
    assert alone.decide(["a"])
    # A lone request that never has a draft: worth less than a verify step by the margin, so it goes plain even
    # from a drafting engine (which goes on drafting while drafting merely pays).
    for _ in range(24):
        alone.observe_empty("b", batch_size=1)
    assert alone.expected_tokens(["b"]) == pytest.approx(2.0 / 1.05, abs=0.02)
    assert alone.drafting
    assert not alone.decide(["b"])
    batch = SpeculationPolicy(num_draft_tokens=4)
    _measured(batch, 2, plain_s=0.010, verify_s=0.020)
    for _ in range(6):
        batch.observe_verify("x", 4)
        batch.observe_empty("y", batch_size=2)
    assert batch.totals["y"] == [0.0, 6]  # (six verify steps that accepted nothing)
    assert alone.totals["b"][0] > 0


def test_probes_cost_at_most_the_budget_while_drafting_is_off():
    policy = SpeculationPolicy(num_draft_tokens=7, probe_budget=0.01)
    _measured(policy, 1, plain_s=0.004, verify_s=0.006)  # ratio 1.5: a probe loses half a plain step
    policy.observe_verify("a", 0)
    policy.observe_verify("a", 0)
    decisions = [policy.decide(["a"]) for _ in range(500)]
    probes = [i for i, d in enumerate(decisions) if d]
    assert len(probes) == policy.probes == 10  # every ceil(0.5 / 0.01) = 50 plain steps
    assert all(b - a == 50 for a, b in zip(probes, probes[1:], strict=False))
    assert sum(decisions) * 0.5 / len(decisions) <= 0.01 + 1e-9


def test_a_plain_decision_is_repeated_for_an_unchanged_batch_with_the_same_probes():
    """The engine repeats a "plain" decision without reading the requests while its batch is unchanged
    (decide_same_batch): the same steps probe as with a full decision every step, a drafted decision is never
    repeated, and the full decision still runs every `reuse_steps` + 1 steps."""
    def measured_policy() -> SpeculationPolicy:
        policy = SpeculationPolicy(num_draft_tokens=7, probe_budget=0.01, reuse_steps=16)
        _measured(policy, 1, plain_s=0.004, verify_s=0.006)  # a probe every 50 plain steps
        policy.observe_verify("a", 0)
        return policy

    full, repeating = measured_policy(), measured_policy()
    expected = [full.decide(["a"]) for _ in range(300)]
    got, full_decisions = [], 0
    for _ in range(300):
        again = repeating.decide_same_batch()
        if again is None:
            full_decisions += 1
            again = repeating.decide(["a"])
        got.append(again)
    assert got == expected and repeating.probes == full.probes == 6
    assert repeating.decisions == full.decisions == 300
    # (one full decision per 17 plain steps, plus each probe's and the one after it)
    assert full_decisions <= 300 // 17 + 1 + 2 * full.probes
    while not repeating.decide(["a"]):  # up to the next probe: the step after it is decided in full
        pass
    assert repeating.drafting and repeating.decide_same_batch() is None


def test_a_lone_probe_is_measured_with_the_steps_around_it_and_spaces_the_probes():
    """A probe's neighbours lose their overlap: the four periods plain, probe, plain, plain are measured together
    and what they take beyond three plain periods is the probe's cost, which spaces the probes (a verify step
    among verify steps costs 1.5 plain steps here, a lone probe 2.5)."""
    policy = SpeculationPolicy(num_draft_tokens=7, probe_budget=0.01)
    _measured(policy, 1, plain_s=0.004, verify_s=0.006)
    policy.observe_verify("a", 0)
    assert not policy.decide(["a"]) and policy._off_interval == 50  # (1.5 - 1) / 0.01
    for _ in range(3):
        policy.observe_gap()  # (a prompt chunk came between: the window starts over)
        # 22 ms: 2.5 plain steps beyond the other three (the plain and verify medians stay 4 and 6 ms)
        for drafted, seconds in ((False, 0.004), (True, 0.006), (False, 0.002), (False, 0.010)):
            policy.observe_step(drafted, 1, seconds)
    assert policy.probe_ratio(1, policy.cost_ratio(1)) == pytest.approx(2.5)
    assert not policy.decide(["a"]) and policy._off_interval == 150  # (2.5 - 1) / 0.01
    # Interrupted windows measure nothing: a gap inside one, or a drafted step after the probe.
    other = SpeculationPolicy(num_draft_tokens=7)
    _measured(other, 1, plain_s=0.004, verify_s=0.006)
    for pattern in ((False, True, None, False, False), (False, True, True, False, False)):
        for drafted in pattern:
            other.observe_gap() if drafted is None else other.observe_step(drafted, 1, 0.005)
    assert not other.probe_costs


def test_a_probe_that_finds_acceptance_turns_drafting_back_on():
    policy = SpeculationPolicy(num_draft_tokens=4, acceptance_weight=0.5)
    _measured(policy, 4, plain_s=0.01, verify_s=0.013)
    ids = ["a", "b", "c", "d"]
    for r in ids:
        policy.observe_verify(r, 0)
    assert not policy.decide(ids)
    for r in ids:  # what one probe found: the text became predictable
        policy.observe_verify(r, 4)
    assert policy.decide(ids) and policy.switches == 2


def test_an_unmeasured_batch_size_borrows_the_nearest_measured_ratio_and_measures_plain_first():
    policy = SpeculationPolicy(num_draft_tokens=4)
    assert policy.decide(["a"])  # nothing measured: draft (an optimistic start), to measure a verify step
    policy.observe_step(True, 1, 0.02)
    policy.observe_step(True, 1, 0.02)
    assert not policy.decide(["a"])  # then a plain one
    policy.observe_step(False, 1, 0.01)
    policy.observe_step(False, 1, 0.01)
    assert policy.cost_ratio(1) == pytest.approx(2.0)
    assert policy.cost_ratio(64) == pytest.approx(2.0)  # (borrowed from bucket 1)
    _measured(policy, 64, 0.01, 0.04)
    assert policy.cost_ratio(48) == pytest.approx(4.0) and policy.cost_ratio(3) == pytest.approx(2.0)


def test_an_idle_gap_is_not_taken_for_a_step_and_new_requests_are_measured_first():
    policy = SpeculationPolicy(num_draft_tokens=4)
    _measured(policy, 8, 0.01, 0.02)
    policy.observe_step(False, 8, 5.0)  # the loop waited for requests between two launches
    assert policy.cost_ratio(8) == pytest.approx(2.0)
    for _ in range(20):
        policy.observe_verify("old", 0)
    # Until the recent mean of all requests follows prior_steps observations, a request not measured yet counts as
    # accepting half its drafts (or that mean, if more): alone, it is measured by a drafted step.
    assert policy.prior_steps > 20 and policy.expected_tokens(["new"]) == pytest.approx(3.0)
    measured = [f"m{i}" for i in range(15)]
    for r in measured * 10:
        policy.observe_verify(r, 0)
    # Then it counts at that mean: new requests are mostly like the recent ones (a wave of them among drafts never
    # accepted is not drafted for at its start), and a request whose text suits the drafter is found by a probe.
    assert policy.expected_tokens(["new"]) == pytest.approx(1.0, abs=0.01)
    assert policy.expected_tokens(["new", *measured]) < 1.01
    for _ in range(30):
        policy.observe_verify("good", 4)
    assert policy.expected_tokens(["new"]) > 3.5
    policy.forget("old")
    assert "old" not in policy.acceptance


def test_a_new_wave_like_the_last_is_not_probed_at_its_start():
    """Waves of 256 requests whose drafts are never accepted, a verify step costing 5 plain ones: a new wave starts
    plain, its requests counted at the recent mean (nothing), and the next probe comes when the spacing for a batch
    that gains nothing says (4 plain steps lost / probe_budget); counted at half their drafts, each wave's start
    looked nearly free to probe and drafted one step of 256 requests (an H200 run at 256 streams: 0.953x plain)."""
    for prior_steps, probed_at_start in ((0, True), (32, False)):
        policy = SpeculationPolicy(num_draft_tokens=7, prior_steps=prior_steps)
        _measured(policy, 256, 0.01, 0.05)
        first = [f"a{i}" for i in range(256)]
        for r in first:
            policy.observe_verify(r, 0)
        assert [policy.decide(first, [200] * 256) for _ in range(100)] == [False] * 100
        for r in first:
            policy.forget(r)
        second = [f"b{i}" for i in range(256)]
        starts = [policy.decide(second, [256 - i] * 256) for i in range(50)]
        assert any(starts) == probed_at_start, prior_steps
    # (and the wave is still probed, at that spacing: 400 plain steps since the last drafted one; prior_steps 32)
    later = [policy.decide(second, [200] * 256) for _ in range(400)]
    assert any(later) and policy.probes >= 1


def test_always_drafts_every_step():
    policy = SpeculationPolicy(num_draft_tokens=3, always=True)
    _measured(policy, 4, 0.01, 0.05)
    assert all(policy.decide(["a", "b"]) for _ in range(20)) and policy.switches == 0


# ---------------------------------------------------------------------------------------------- in the engine
def _prompts(n: int, seed: int, length: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for _ in range(n)]


def _generate(llm, prompts, max_tokens):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    """A random DFlash drafter for the conftest Qwen3 target: its drafts are almost never right."""
    return write_drafter(tmp_path_factory.mktemp("policy-drafter"), hidden=64, layer_ids=[0, 1], mask_token_id=383,
                         num_layers=1, block_size=5, heads=4, kv_heads=2, head_dim=16, intermediate=96, seed=7)


def test_a_drafter_that_is_never_right_is_switched_off_within_a_few_steps(qwen3_dir, random_drafter):
    prompts = _prompts(16, seed=1)
    plain = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=16)
    expected = _generate(plain, prompts, 48)
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=16, speculative="dflash",
              draft_model=str(random_drafter))
    assert llm.engine.policy is not None and not llm.engine.policy.always
    assert _generate(llm, prompts, 48) == expected  # lossless, policy on
    stats = llm.engine.stats
    # A few drafted steps measure the cost and acceptance, then plain steps (probes aside: the step times are
    # measured on a shared CPU, so the bound leaves room for a noisy ratio).
    assert 0 < stats.spec_num_drafted_steps <= stats.num_steps // 3, stats
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens // 4
    assert stats.spec_policy_switches >= 1 and stats.num_steps > 40
    assert_pages_returned(llm)


def test_ngram_under_the_policy_gives_plain_outputs_with_its_switches(qwen3_dir):
    """A tiny random model's greedy text falls into loops that n-gram lookup then predicts: the policy switches
    drafting on and off along the way (plain stretches overlapping their steps), outputs unchanged."""
    prompts = _prompts(16, seed=1)
    expected = _generate(LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=16), prompts, 48)
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=16, speculative="ngram", num_draft_tokens=4,
              ngram_min=1, ngram_max=1)
    assert llm.engine._plain_overlap  # (n-gram keeps nothing captured: its plain steps may overlap)
    assert _generate(llm, prompts, 48) == expected
    assert llm.engine.stats.spec_policy_switches >= 1
    assert_pages_returned(llm)


class _NeverHasADraft(DraftProposer):
    """An n-gram lookup that never finds a match: every proposal is empty."""

    def __init__(self, k: int):
        self.num_draft_tokens = k
        self.proposals = 0

    def propose(self, requests) -> list[Draft]:
        self.proposals += len(requests)
        return [Draft([]) for _ in requests]


def test_a_proposer_with_nothing_to_draft_turns_drafting_off(qwen3_dir):
    """No request ever gets a draft, so no verify step is ever measured: the empty proposals themselves must
    count as gaining nothing, or the engine would stay in drafting's synchronous steps for good."""
    prompts = _prompts(8, seed=4)
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=8, speculative="ngram", num_draft_tokens=4)
    llm.engine.proposer = _NeverHasADraft(4)
    expected = _generate(LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=8), prompts, 64)
    assert _generate(llm, prompts, 64) == expected
    policy = llm.engine.policy
    assert llm.engine.stats.spec_num_drafted_steps == 0
    # Proposals only on the first steps and the probes, not on every one of the 64 steps.
    assert llm.engine.proposer.proposals <= 8 * 8, (llm.engine.proposer.proposals, policy.probes)
    assert not llm.engine.scheduler.drafting
    assert_pages_returned(llm)


class _RightFromToken(DraftProposer):
    """Drafts wrong tokens for a request's first `right_from` outputs, then plain decoding's own continuation
    (`expected`): a text that turns predictable."""

    def __init__(self, k: int, expected: dict[tuple[int, ...], list[int]], right_from: int):
        self.num_draft_tokens = k
        self.expected = expected
        self.right_from = right_from

    def propose(self, requests) -> list[Draft]:
        drafts = []
        for r in requests:
            m = r.num_output_tokens
            truth = self.expected[tuple(r.prompt_token_ids)]
            if m < self.right_from:
                drafts.append(Draft([(t + 1) % 300 + 3 for t in truth[m: m + self.num_draft_tokens]]))
            else:
                drafts.append(Draft(truth[m: m + self.num_draft_tokens]))
        return drafts


def _fixed_step_costs(policy: SpeculationPolicy, verify_over_plain: float) -> None:
    """The policy sees step periods from a fixed cost table, not the shared CPU's timings (which a loaded machine
    stretches at random): its decisions then follow from acceptance alone, and the step count is the same on
    every run."""
    observe = policy.observe_step

    def fixed(drafted: bool, batch_size: int, seconds: float, length: int | None = None) -> None:
        observe(drafted, batch_size, 0.01 * (verify_over_plain if drafted else 1.0), length)

    policy.observe_step = fixed


def test_drafting_comes_back_when_the_text_becomes_predictable(qwen3_dir):
    prompts = _prompts(4, seed=2)
    plain = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=4)
    expected = _generate(plain, prompts, 400)
    # An n-gram engine (its K + 1-row verify path), with this proposer in the n-gram drafter's place.
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=4, speculative="ngram", num_draft_tokens=4)
    llm.engine.proposer = _RightFromToken(4, {tuple(p): e for p, e in zip(prompts, expected, strict=True)}, 40)
    _fixed_step_costs(llm.engine.policy, verify_over_plain=1.3)
    assert _generate(llm, prompts, 400) == expected
    stats, policy = llm.engine.stats, llm.engine.policy
    assert policy.switches >= 2 and policy.probes >= 1  # off over the wrong drafts, on again after a probe
    assert policy.repeats > 0  # (plain steps of the unchanged batch repeated the decision; the probe still came)
    # Once back on, nearly every draft is accepted: far fewer steps than tokens.
    assert stats.spec_num_accepted_tokens > 200 and stats.num_steps < 200, (stats.num_steps, policy.probes)
    assert_pages_returned(llm)


def test_a_ladder_length_is_chosen_where_its_shorter_verify_step_pays():
    """Drafts accepted one after another with probability p (E_k = p + ... + p^k), a verify step of k drafts a
    request costing 1 + 0.5 k plain steps: at p = 0.7 the K = 4 step gives 2.77 tokens for 3 steps' cost (not worth
    it), one draft 1.7 for 1.5 (worth it), so the ladder drafts one where K alone would stay plain."""
    def policy_at(p: float, lengths: tuple[int, ...]) -> SpeculationPolicy:
        policy = SpeculationPolicy(num_draft_tokens=4, lengths=lengths)
        for _ in range(3):
            policy.observe_step(False, 8, 0.010)
            policy.observe_step(True, 8, 0.030)
        for r in ids:
            for _ in range(8):
                policy.observe_verify(r, sum(p ** i for i in range(1, 5)))
        return policy

    ids = [f"r{i}" for i in range(8)]
    assert not policy_at(0.7, ()).decide(ids)
    ladder = policy_at(0.7, (1, 2))
    assert ladder.expected_tokens(ids, length=2) == pytest.approx(1 + 0.7 + 0.49, abs=0.01)
    assert ladder.length_ratio(8, 1, ladder.cost_ratio(8)) == pytest.approx(1.5)  # (unmeasured: scaled by rows)
    assert ladder.decide(ids) and ladder.draft_length == 1 and ladder.lengths_chosen == {1: 1}
    # Acceptance near 1: the whole K pays best.
    good = policy_at(0.97, (1, 2))
    assert good.decide(ids) and good.draft_length == 4
    # Measured, a length's own cost replaces the scaled one: here a step of one or two drafts costs as much as K.
    for _ in range(3):
        ladder.observe_step(True, 8, 0.030, length=1)
        ladder.observe_step(True, 8, 0.030, length=2)
    assert ladder.length_ratio(8, 1, ladder.cost_ratio(8)) == pytest.approx(3.0)
    assert not ladder.decide(ids)


def test_a_cut_step_that_accepts_every_draft_counts_the_run_as_going_on():
    """A step cut to 2 drafts that accepts both says nothing of drafts 3 and 4: the request's mean (kept at K) takes
    2 plus what its rate gives for the two it did not have, not 2 (which would pull a good request down)."""
    policy = SpeculationPolicy(num_draft_tokens=4, lengths=(2,), acceptance_weight=1.0)
    a = 0.8 + 0.64 + 0.512 + 0.4096  # p = 0.8
    policy.observe_verify("r", a)
    policy.observe_verify("r", 2, cut=2)
    assert policy.acceptance["r"] == pytest.approx(2 + 0.8 + 0.64, abs=0.02)
    policy.observe_verify("r", 1, cut=2)  # (a rejection inside the cut: the run ended there)
    assert policy.acceptance["r"] == 1


class _GeometricDrafts(DraftProposer):
    """Plain decoding's own continuation with one draft made wrong: each draft is right with probability p until
    the first wrong one (seeded), the acceptance the ladder's arithmetic assumes."""

    def __init__(self, k: int, expected: dict[tuple[int, ...], list[int]], p: float):
        self.num_draft_tokens = k
        self.expected = expected
        self.p = p
        self.rng = random.Random(5)

    def propose(self, requests) -> list[Draft]:
        drafts = []
        for r in requests:
            m = r.num_output_tokens
            truth = list(self.expected[tuple(r.prompt_token_ids)][m: m + self.num_draft_tokens])
            right = 0
            while right < len(truth) and self.rng.random() < self.p:
                right += 1
            if right < len(truth):
                truth[right] = (truth[right] + 1) % 300 + 3
            drafts.append(Draft(truth))
        return drafts


def test_a_draft_length_ladder_drafts_shorter_steps_where_they_pay_and_stays_lossless(qwen3_dir):
    """With drafts right at p = 0.75 and a verify step of k drafts costing 1 + 0.5 k plain steps, K = 4 alone does
    not pay (3.05 tokens for 3 steps' cost), one or two drafts do (1.75 for 1.5, 2.31 for 2): the engine with
    `--tuning draft_lengths=1:2` verifies steps of fewer drafts (their own padding, their cut counted), one request
    at a time, and its tokens are plain decoding's."""
    prompts = _prompts(4, seed=3)
    expected = _generate(LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=1), prompts, 160)
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=1, speculative="ngram", num_draft_tokens=4,
              tuning="draft_lengths=1:2")
    llm.engine.proposer = _GeometricDrafts(4, {tuple(p): e for p, e in zip(prompts, expected, strict=True)}, 0.75)
    policy = llm.engine.policy
    assert policy.lengths == (1, 2)
    observe = policy.observe_step
    policy.observe_step = lambda drafted, n, seconds, length=None: observe(
        drafted, n, 0.01 * (1 + 0.5 * (length or 4) if drafted else 1.0), length)
    assert _generate(llm, prompts, 160) == expected
    chosen, stats = policy.lengths_chosen, llm.engine.stats
    assert chosen[1] + chosen[2] >= 20 and chosen[1] + chosen[2] > 2 * chosen[4], chosen  # (K: measuring, probes)
    # (the verify steps' drafts were cut: fewer than K a step on the whole)
    assert 0 < stats.spec_num_draft_tokens < 2.5 * stats.spec_num_verify_steps, stats
    assert_pages_returned(llm)


def test_a_draft_length_must_be_below_k(qwen3_dir):
    with pytest.raises(ConfigError, match="below --num-draft-tokens"):
        LLM(str(qwen3_dir), kv_cache_memory="16MiB", speculative="ngram", num_draft_tokens=4,
            tuning="draft_lengths=2:4")
    with pytest.raises(ConfigError, match="positive integers"):
        LLM(str(qwen3_dir), kv_cache_memory="16MiB", speculative="ngram", tuning="draft_lengths=a")


class _ScriptedPolicy(SpeculationPolicy):
    """Plain steps for the first `plain_decisions` decisions, then drafting (to test what the drafter keeps
    through a plain stretch, apart from the timing the real decisions follow)."""

    plain_decisions: int = 0

    def _decide(self, request_ids, remaining):
        return self.decisions > self.plain_decisions


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_the_dflash_context_survives_a_plain_stretch_whose_steps_overlap(device):
    """The shipped model and its trained drafter on code: drafting from the start, and drafting only after 40 plain
    steps (run with asynchronous scheduling, the drafter's context rows kept from each step's captured rows, on CUDA
    the decode graphs' outputs, and written in one batch before the first draft) accept alike over the drafted part;
    written right behind each step instead (--tuning draft_context_backlog=0), the same drafts; every run gives
    plain decoding's tokens (float32)."""
    from atlas.engine.core import default_model_path

    prompt = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
              "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef factorial(n):\n")
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    memory = dict(kv_cache_memory="16MiB" if device == "cpu" else CUDA_KV)
    common = dict(max_model_len=512, device=device, dtype="float32", **memory)
    model = str(default_model_path())
    expected = LLM(model, **common).generate([prompt], params)[0].outputs[0].token_ids
    always = LLM(model, speculative="dflash", speculative_policy="always", **common)
    assert always.generate([prompt], params)[0].outputs[0].token_ids == expected
    runs = {}
    for backlog in (False, True):  # (the last one, with the backlog as by default, is `late` below)
        late = LLM(model, speculative="dflash", tuning={"draft_context_backlog": backlog}, **common)
        engine = late.engine
        assert engine._plain_overlap and engine.runner.context_behind is not None
        scripted = _ScriptedPolicy(engine.proposer.num_draft_tokens)
        scripted.plain_decisions = 40
        engine.policy = engine.scheduler.policy = scripted
        assert late.generate([prompt], params)[0].outputs[0].token_ids == expected
        runs[backlog] = engine.stats.spec_num_accepted_tokens, engine.proposer.backlog_flushes
    # The plain stretch's rows went to the drafter in a batch or two, not one a step, and it drafted as from rows
    # written behind every step.
    assert 1 <= runs[True][1] <= 3 and runs[False][1] == 0, runs
    assert runs[True][0] == runs[False][0], runs
    # The drafted part: the last 80 tokens of `late`, against the same tokens drafted from the start.
    a, b = always.engine.stats, engine.stats
    rate_always = a.spec_num_accepted_tokens / a.spec_num_draft_tokens
    rate_late = b.spec_num_accepted_tokens / b.spec_num_draft_tokens
    assert b.spec_num_verify_steps > 5 and rate_always > 0.3
    # (measured on the CPU: 0.54 against 0.48; with the rows of the plain stretch left unwritten, 0.38)
    assert rate_late >= 0.95 * rate_always, (rate_late, rate_always)
    assert_pages_returned(late)


class _LadderScript(SpeculationPolicy):
    """Drafting every step, at K and each shorter length of the ladder in turn (apart from any timing)."""

    def _decide(self, request_ids, remaining):
        order = (self.num_draft_tokens, *self.lengths)
        self.length = order[self.decisions % len(order)]
        return True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_dflash_steps_at_every_ladder_length_give_plain_decodings_tokens(device):
    """The shipped model and its drafter with `--tuning draft_lengths=1:3`: steps of 1, 3 and K drafts in turn (on
    CUDA each length replays verify graphs of its own), the drafter's block cut to the step's length, its tokens
    plain decoding's (float32); the block is drafted after the read-back, not behind the verify step."""
    from atlas.engine.core import default_model_path

    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    params = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)
    memory = dict(kv_cache_memory="16MiB" if device == "cpu" else CUDA_KV)
    common = dict(max_model_len=512, device=device, dtype="float32", **memory)
    model = str(default_model_path())
    expected = LLM(model, **common).generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM(model, speculative="dflash", tuning={"draft_lengths": "1:3"}, **common)
    engine = llm.engine
    k = engine.proposer.num_draft_tokens
    assert engine.policy.lengths == (1, 3) and not engine.proposer.drafts_after_verify
    if device == "cuda":
        assert {2, 4, k + 1} <= set(engine.runner.step_graphs)
    scripted = _LadderScript(k, lengths=(1, 3))
    engine.policy = engine.scheduler.policy = scripted
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected
    assert all(scripted.lengths_chosen[n] >= 5 for n in (1, 3, k)), scripted.lengths_chosen
    if device == "cuda":  # (each length's steps padded to it, and replayed from its graphs)
        assert all(engine.runner.step_graphs[n + 1].steps_run > 0 for n in (1, 3, k))
    stats = engine.stats
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens < k * stats.spec_num_verify_steps
    assert_pages_returned(llm)


class _OneRequestDrafts(DraftProposer):
    """Right drafts for the first request only; the others get none (padded into the verify steps)."""

    def __init__(self, k: int, expected: list[int], prompt: list[int]):
        self.num_draft_tokens, self.expected, self.prompt = k, expected, prompt

    def propose(self, requests) -> list[Draft]:
        return [Draft(self.expected[r.num_output_tokens: r.num_output_tokens + self.num_draft_tokens]
                      if r.prompt_token_ids == self.prompt else []) for r in requests]


def test_decodes_without_drafts_in_a_verify_step_count_as_accepting_nothing(qwen3_dir):
    """A verify step gives a decode without drafts of its own one token, as a plain step would: the policy counts
    it, so one request whose drafts hit cannot keep a batch of others drafting."""
    prompts = _prompts(4, seed=3)
    expected = _generate(LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=4), prompts[:1], 60)[0]
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=4, speculative="ngram", num_draft_tokens=4,
              speculative_policy="always")
    llm.engine.proposer = _OneRequestDrafts(4, expected, prompts[0])
    core = llm.engine
    ids = [core.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
           for p in prompts]
    for _ in range(6):
        core.step()
    children = [r.request_id for r in core.scheduler.running]
    assert len(children) == len(ids) and all(c in core.policy.acceptance for c in children)
    first = next(r for r in core.scheduler.running if r.prompt_token_ids == prompts[0])
    assert core.policy.acceptance[first.request_id] > 2
    assert all(core.policy.acceptance[r.request_id] < 0.3 for r in core.scheduler.running if r is not first)
    assert core.policy.expected_tokens(children) < 2.2
    while core.has_unfinished():
        core.step()
    assert_pages_returned(llm)
