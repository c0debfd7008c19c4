"""The scheduler and the page manager alone, in plain Python: no model, no runner, no torch.

Each test drives Scheduler.schedule() / update_from_output() by hand, the model's tokens made up on the host.
"""

from __future__ import annotations

import subprocess
import sys

from atlas.engine.kv_cache import KVCacheManager
from atlas.engine.request import Request, RequestStatus
from atlas.engine.scheduler import Scheduler, SchedulerConfig
from atlas.runtime.batch import StepResult
from atlas.sampling_params import SamplingParams

NEXT = 7  # the token every made-up step samples


def _scheduler(num_pages: int = 64, block_size: int = 4, max_seqs: int = 4, budget: int = 64, max_len: int = 256,
               prefix_caching: bool = False) -> Scheduler:
    kv = KVCacheManager(num_pages, block_size, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len), kv)


def _request(rid: str, prompt_len: int, parent: str | None = None, index: int = 0, **params) -> Request:
    return Request(rid, parent or rid, index, None, list(range(100, 100 + prompt_len)), SamplingParams(**params), [])


def _step(s: Scheduler, sampled=None):
    """One step: schedule, then the made-up model's tokens (NEXT for every sample row, or sampled[request id]).
    -> (the step's batch, its updates)."""
    out = s.schedule()
    batch = out.batch
    tokens = [(sampled or {}).get(r.request_id, [NEXT]) if m else [] for r, m in zip(batch.seqs, batch.num_sample_rows, strict=True)]
    updates = s.update_from_output(out, StepResult(tokens, [None] * batch.num_seqs, []))
    return batch, updates


def _ids(batch) -> list[str]:
    return [r.request_id for r in batch.seqs]


def _pages_balance(s: Scheduler, requests: list[Request]) -> None:
    """Every page is free or held by exactly the requests that list it (no prefix sharing in these tests)."""
    held = [p for r in requests for p in r.page_ids]
    assert len(held) == len(set(held))
    assert s.kv.num_free_pages + len(held) == s.kv.num_pages


def test_the_scheduler_the_request_and_the_page_manager_import_no_torch():
    code = ("import sys\n"
            "import atlas.engine.scheduler, atlas.engine.request, atlas.engine.kv_cache, atlas.runtime.batch\n"
            "print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "[]"


def test_admission_is_first_come_first_served_within_the_sequence_slots():
    s = _scheduler(max_seqs=2)
    reqs = [_request(f"r{i}", 3, max_tokens=2) for i in range(3)]
    for r in reqs:
        s.add(r)
    batch, _ = _step(s)
    assert _ids(batch) == ["r0", "r1"] and [r.request_id for r in s.waiting] == ["r2"]
    assert batch.num_scheduled == [3, 3] and batch.start == [0, 0] and batch.num_sample_rows == [1, 1]
    batch, updates = _step(s)  # r0 and r1 decode their second (last) token: their slots come free
    assert _ids(batch) == ["r0", "r1"] and batch.num_scheduled == [1, 1]
    assert [u.new_token_ids for u in updates] == [[NEXT], [NEXT]]
    assert reqs[0].status is RequestStatus.FINISHED_LENGTH and reqs[0].output_token_ids == [NEXT, NEXT]
    assert reqs[0].page_ids == [] and s.kv.num_free_pages + len(reqs[2].page_ids) == s.kv.num_pages
    batch, _ = _step(s)
    assert _ids(batch) == ["r2"] and batch.num_scheduled == [3]


def test_chunked_prefill_keeps_to_the_token_budget():
    s = _scheduler(budget=10)
    long, short = _request("long", 25), _request("short", 3)
    s.add(long)
    s.add(short)
    batch, _ = _step(s)
    assert _ids(batch) == ["long"] and batch.num_scheduled == [10] and batch.num_sample_rows == [0]
    assert long.num_computed_tokens == 10 and long.output_token_ids == [] and short.status is RequestStatus.WAITING
    batch, _ = _step(s)
    assert _ids(batch) == ["long"] and batch.start == [10] and batch.num_scheduled == [10]
    batch, _ = _step(s)  # the prompt's last 5 tokens (its first token sampled), then the short prompt
    assert _ids(batch) == ["long", "short"] and batch.num_scheduled == [5, 3] and batch.num_sample_rows == [1, 1]
    assert long.output_token_ids == [NEXT] and short.output_token_ids == [NEXT]
    batch, _ = _step(s)
    assert batch.num_scheduled == [1, 1] and sum(batch.num_scheduled) <= 10


def test_preemption_frees_the_latest_arrivals_pages_and_recomputes_it_first():
    # 6 pages of 4 tokens: two prompts of 8 take 4; each decode page past them takes one more.
    s = _scheduler(num_pages=6, block_size=4)
    first, second = _request("first", 8), _request("second", 8)
    s.add(first)
    s.add(second)
    _step(s)  # prompts: 2 pages each, one token each
    assert s.kv.num_free_pages == 2
    for _ in range(4):  # tokens 10..13 need a third page each: the last 2 free pages
        _step(s)
    assert len(first.page_ids) == len(second.page_ids) == 3 and s.kv.num_free_pages == 0
    batch, _ = _step(s)  # position 12: first needs a fourth page; none is free, so the latest arrival gives way
    assert _ids(batch) == ["first"] and batch.preempted_request_ids == ["second"]  # (the runner drops its drafts)
    assert second.status is RequestStatus.PREEMPTED and second.page_ids == [] and second.num_computed_tokens == 0
    assert s.num_preemptions == 1 and second.metrics.num_preemptions == 1 and list(s.waiting) == [second]
    assert len(first.page_ids) == 4
    batch, _ = _step(s)  # (second waits: its 4 pages are not free)
    assert _ids(batch) == ["first"] and batch.preempted_request_ids == [] and list(s.waiting) == [second]
    _pages_balance(s, [first, second])
    generated = list(second.output_token_ids)
    assert generated  # (kept: it is recomputed from its prompt and what it generated)
    first.params.max_tokens = first.num_output_tokens + 1  # first ends after its next token: its pages come back
    first.max_output_tokens = first.params.max_tokens
    batch, _ = _step(s)
    assert first.status is RequestStatus.FINISHED_LENGTH and first.page_ids == []
    batch, _ = _step(s)
    assert _ids(batch) == ["second"] and batch.start == [0] and batch.num_scheduled == [8 + len(generated)]
    assert second.output_token_ids == [*generated, NEXT] and second.status is RequestStatus.RUNNING
    assert batch.finished_request_ids == ["first"]
    _pages_balance(s, [first, second])


def _fair(max_seqs: int, share: int | None, **kw) -> Scheduler:
    kv = KVCacheManager(kw.pop("num_pages", 1024), kw.pop("block_size", 4), kw.pop("prefix_caching", False))
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=kw.pop("budget", 4096),
                                     max_model_len=256, max_seqs_per_request=share), kv)


def _big(s: Scheduler, n: int, prompt_len: int = 4, max_tokens: int = 200, group: str | None = None,
         parent: str = "big") -> list[Request]:
    samples = []
    for i in range(n):
        r = Request(f"{parent}#{i}", parent, i, None, list(range(100, 100 + prompt_len)),
                    SamplingParams(max_tokens=max_tokens), [], group_id=group)
        if i:
            r.share_from = samples[0]
        samples.append(r)
        s.add(r)
    return samples


def _running_of(s: Scheduler, group: str) -> int:
    return sum(r.group_id == group for r in s.running)


def test_alone_a_request_with_many_samples_uses_every_slot():
    s = _fair(max_seqs=16, share=8)
    _big(s, 128)
    for _ in range(3):  # (the first sample's prompt, then its siblings on its pages)
        _step(s)
    assert len(s.running) == 16 and all(r.parent_id == "big" for r in s.running) and s.num_preemptions == 0


def test_a_newcomer_runs_at_the_next_step_while_a_request_with_n_128_holds_every_slot():
    s = _fair(max_seqs=16, share=8)
    samples = _big(s, 128)
    for _ in range(3):
        _step(s)
    assert _running_of(s, "big") == 16
    newcomer = _request("small", 5, max_tokens=3)
    s.add(newcomer)
    batch, _ = _step(s)
    assert "small" in _ids(batch) and newcomer.status is RequestStatus.RUNNING
    # One slot was wanted: one sample gave it (the most recently admitted), its pages back.
    (preempted,) = [r for r in samples if r.status is RequestStatus.PREEMPTED]
    assert s.num_preemptions == 1 and _running_of(s, "big") == 15
    assert preempted.page_ids == [] and preempted.num_computed_tokens == 0 and preempted.num_output_tokens == 2
    while newcomer.status is RequestStatus.RUNNING:
        _step(s)
    assert newcomer.status is RequestStatus.FINISHED_LENGTH and newcomer.output_token_ids == [NEXT] * 3
    _step(s)
    assert _running_of(s, "big") == 16 and s.num_preemptions == 1
    # The preempted sample resumes where it was: its outputs are kept, its tokens recomputed, and it goes on.
    assert preempted.status is RequestStatus.RUNNING and preempted.num_computed_tokens == preempted.num_tokens - 1
    assert preempted.output_token_ids == [NEXT] * 3


def test_while_a_small_request_runs_a_request_over_its_share_computes_only_its_share_a_step_in_turn():
    """Fair rows: each step of the newcomer's life holds 8 of the big request's 15 running samples (its share), the
    ones that ran least recently; none is starved, every output is right, and once the newcomer is gone every
    sample runs each step again."""
    s = _fair(max_seqs=16, share=8)
    samples = _big(s, 16, max_tokens=40)
    for _ in range(3):
        _step(s)
    batch, _ = _step(s)
    assert batch.num_seqs == 16  # (alone: every sample, every step)
    newcomer = _request("small", 5, max_tokens=6)
    s.add(newcomer)
    runs = {r.request_id: 0 for r in samples}
    steps = 0
    while newcomer.status is not RequestStatus.FINISHED_LENGTH:
        batch, _ = _step(s)
        steps += 1
        big = [r.request_id for r in batch.seqs if r.request_id in runs]
        assert "small" in _ids(batch) and len(big) == 8
        for rid in big:
            runs[rid] += 1
    running = [r.request_id for r in s.running]
    # In turn: the 15 running samples ran within one step of each other's count (the preempted one not at all).
    counts = sorted(runs[rid] for rid in running)
    assert counts[-1] - counts[0] <= 1 and steps == 6
    batch, _ = _step(s)
    assert batch.num_seqs == 16 and _running_of(s, "big") == 16
    for _ in range(200):
        if not s.has_unfinished():
            break
        _step(s)
    assert all(r.output_token_ids == [NEXT] * 40 for r in samples) and newcomer.output_token_ids == [NEXT] * 6
    assert s.kv.num_free_pages == s.kv.num_pages


def test_fair_rows_are_off_when_the_share_is_every_slot_or_the_policy_is_priority():
    for config in (dict(max_seqs_per_request=None), dict(max_seqs_per_request=4, priority=True)):
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=256, **config),
                      KVCacheManager(1024, 4, False))
        _big(s, 3, max_tokens=20)
        for _ in range(3):
            _step(s)
        s.add(_request("small", 4, max_tokens=4))
        batch, _ = _step(s)
        assert batch.num_seqs == 4, config


def test_many_newcomers_take_the_big_requests_slots_down_to_its_share_and_then_wait_their_turn():
    s = _fair(max_seqs=16, share=8)
    _big(s, 64)
    for _ in range(3):
        _step(s)
    small = [_request(f"s{i}", 4, max_tokens=50) for i in range(12)]
    for r in small:
        s.add(r)
    batch, _ = _step(s)
    assert _running_of(s, "big") == 8 and [r.request_id for r in s.running if r.group_id != "big"] == \
        [f"s{i}" for i in range(8)]
    assert [r.request_id for r in list(s.waiting)[:4]] == [f"s{i}" for i in range(8, 12)]  # (first come, first served)
    _step(s)
    assert _running_of(s, "big") == 8 and s.num_preemptions == 8  # at its share: it keeps its slots


def test_every_prompt_of_one_api_request_counts_toward_one_share():
    s = _fair(max_seqs=8, share=4)
    for p in range(2):  # two prompts x n = 8: two parents, one user request
        _big(s, 8, parent=f"cmpl-{p}", group="cmpl")
    for _ in range(3):
        _step(s)
    assert len(s.running) == 8 and {r.group_id for r in s.running} == {"cmpl"}
    s.add(_request("other", 4))
    batch, _ = _step(s)
    assert "other" in _ids(batch) and _running_of(s, "cmpl") == 7 and s.num_preemptions == 1


def test_requests_at_their_share_do_not_leave_slots_idle():
    s = _fair(max_seqs=16, share=4)
    a, b = _big(s, 10, parent="a"), _big(s, 10, parent="b")
    for _ in range(4):
        _step(s)
    # Both are above their share, and neither waits below it: every slot is used, nothing is preempted.
    assert len(s.running) == 16 and s.num_preemptions == 0
    assert {r.parent_id for r in s.running} == {"a", "b"} and len(a) == len(b) == 10


def test_single_requests_at_their_share_wait_first_come_first_served():
    s = _fair(max_seqs=4, share=2)
    for rid in ("a", "b", "c", "d"):
        s.add(_request(rid, 4))
    _step(s)
    s.add(_request("e", 4))
    batch, _ = _step(s)
    assert s.num_preemptions == 0 and "e" not in _ids(batch) and [r.request_id for r in s.waiting] == ["e"]


def test_share_of_max_num_seqs_is_first_come_first_served():
    s = _fair(max_seqs=4, share=4)
    _big(s, 8)
    for _ in range(3):
        _step(s)
    newcomer = _request("small", 4)
    s.add(newcomer)
    _step(s)
    assert newcomer.status is RequestStatus.WAITING and s.num_preemptions == 0


def test_fair_slots_keep_prefix_cache_and_sibling_pages_balanced():
    """Preempted samples give their pages back (shared prompt pages by reference), and every page is free
    once all have finished, with prefix caching on."""
    s = _fair(max_seqs=8, share=4, num_pages=256, prefix_caching=True)
    samples = _big(s, 16, prompt_len=9, max_tokens=12)
    for _ in range(3):
        _step(s)
    others = [_request(f"o{i}", 6, max_tokens=5) for i in range(3)]
    for r in others:
        s.add(r)
    for _ in range(200):
        if not s.has_unfinished():
            break
        _step(s)
    assert not s.has_unfinished() and s.num_preemptions > 0
    assert all(r.output_token_ids == [NEXT] * 12 for r in samples)
    assert all(r.output_token_ids == [NEXT] * 5 for r in others)
    assert s.kv.num_free_pages == s.kv.num_pages


def test_a_share_outside_one_to_max_num_seqs_is_refused():
    import pytest

    for bad in (0, 9, 2.5):
        with pytest.raises(ValueError, match="max_seqs_per_request must be a whole number from 1 to max_num_seqs"):
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_seqs_per_request=bad)


def test_finishing_gives_the_pages_back_once_and_the_runner_hears_of_it_with_the_next_step():
    s = _scheduler()
    a, b = _request("a", 9), _request("b", 5)
    s.add(a)
    s.add(b)
    _step(s)
    assert len(a.page_ids) == 3
    free = s.kv.num_free_pages
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert a.page_ids == [] and s.kv.num_free_pages == free + 3 and a not in s.running
    assert s.stats.num_finished == 1 and s.stats.finished_reasons == {"abort": 1}
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert s.schedule().is_empty  # (nothing to launch: the deltas wait)
    c = _request("c", 2)
    s.add(c)
    batch, _ = _step(s)
    assert _ids(batch) == ["c"] and batch.finished_request_ids == ["a", "b"]
    batch, _ = _step(s)
    assert batch.finished_request_ids == []


def test_seeded_requests_reach_the_runner_once_with_their_own_seed():
    s = _scheduler()
    for i in range(2):
        s.add(_request(f"p#{i}", 3, parent="p", index=i, seed=11))
    s.add(_request("q", 3))
    batch, _ = _step(s)
    assert batch.seeded == [("p#0", 11), ("p#1", 12)]
    batch, _ = _step(s)
    assert batch.seeded == []


def test_a_verify_step_keeps_the_accepted_drafts_and_winds_back_the_rest():
    s = _scheduler(block_size=4)
    r = _request("r", 6)
    s.add(r)
    _step(s)  # prompt: 6 computed, one token sampled
    r.spec_token_ids = [40, 41, 42]
    batch, updates = _step(s, {"r": [40, 9]})  # the first draft accepted, then the target's own token
    assert batch.num_scheduled == [4] and batch.num_drafts == [3] and batch.num_sample_rows == [4]
    assert updates[0].new_token_ids == [40, 9] and r.output_token_ids == [NEXT, 40, 9]
    # positions 6 (the last token) and 7 (the accepted draft) hold valid KV; 8 and 9 (rejected) do not
    assert r.num_computed_tokens == 8 and r.num_tokens == 9 and r.spec_token_ids == []
    assert len(r.page_ids) == 3  # (pages up to the next token; the rejected positions' page went back)
    for counters in (r.metrics, s.stats):
        assert (counters.spec_num_draft_tokens, counters.spec_num_accepted_tokens,
                counters.spec_num_verify_steps) == (3, 1, 1)
    assert s.stats.spec_num_drafted_steps == 1 and s.stats.spec_mean_acceptance_length == 2.0
    assert s.stats.spec_acceptance_rate == 1 / 3


def test_drafts_that_do_not_fit_the_budget_are_dropped_whole():
    s = _scheduler(budget=3)
    r = _request("r", 2)
    s.add(r)
    _step(s)
    r.spec_token_ids = [5, 6, 7, 8]
    batch, _ = _step(s)
    assert batch.num_scheduled == [3] and batch.num_drafts == [2] and batch.num_draft_rows == [2]


def test_the_share_is_an_engine_flag_defaulting_to_half_the_slots():
    import argparse

    import pytest

    from atlas.config import ConfigError, EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert "--max-num-seqs-per-request" in parser.format_help()
    args = parser.parse_args(["--model", "m", "--max-num-seqs", "64", "--max-num-seqs-per-request", "8"])
    assert EngineConfig.from_cli_args(args).seqs_per_request == 8
    assert EngineConfig.from_cli_args(parser.parse_args(["--model", "m", "--max-num-seqs", "64"])).seqs_per_request == 32
    assert EngineConfig(model="m", max_num_seqs=1).seqs_per_request == 1
    with pytest.raises(ConfigError, match="from 1 to --max-num-seqs \\(64\\), got 0; raise --max-num-seqs or lower it"):
        EngineConfig(model="m", max_num_seqs=64, max_num_seqs_per_request=0)


def _fair_budget_scheduler(cap: int | None) -> Scheduler:
    kv = KVCacheManager(256, 4, False)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024,
                                     long_prefill_tokens=cap), kv)


def test_a_long_prompt_leaves_half_the_budget_to_a_newcomer():
    """Fair budget: alone, a long prompt's chunks take the whole step budget; once another request waits, its chunk
    is cut to the cap and the newcomer's prompt runs in the same step (its first token at once), where without the
    cap it waits for the whole long prompt."""
    for cap in (32, None):
        s = _fair_budget_scheduler(cap)
        long, short = _request("long", 600, max_tokens=4), _request("short", 16, max_tokens=4)
        s.add(long)
        batch, _ = _step(s)
        assert _ids(batch) == ["long"] and long.num_computed_tokens == 64  # (alone: the whole budget)
        s.add(short)
        steps_until_short = 0
        while short.num_output_tokens == 0:
            batch, _ = _step(s)
            steps_until_short += 1
            if cap is not None:
                assert long.num_computed_tokens <= 64 + 32 * steps_until_short
        if cap is not None:
            assert steps_until_short == 1
            assert long.num_computed_tokens == 64 + 32 and long.num_output_tokens == 0
        else:
            assert steps_until_short > 8  # (600 tokens at 64 a step first)
            assert long.num_computed_tokens >= 600
        while s.has_unfinished():
            _step(s)
        assert long.num_output_tokens == 4 and short.num_output_tokens == 4
        assert s.kv.num_free_pages == s.kv.num_pages


def test_prompts_of_one_request_do_not_cut_each_other():
    """The cap is against other requests: two prompts of one API request (one group) waiting behind a long one of
    the same group leave its chunks whole."""
    s = _fair_budget_scheduler(32)
    first = Request("a#0", "a", 0, None, list(range(100, 400)), SamplingParams(max_tokens=2), [], group_id="g")
    second = Request("a#1", "a", 1, None, list(range(200, 216)), SamplingParams(max_tokens=2), [], group_id="g")
    s.add(first)
    s.add(second)
    batch, _ = _step(s)
    assert _ids(batch) == ["a#0"] and first.num_computed_tokens == 64


def test_the_prompt_chunk_cap_is_an_engine_flag_defaulting_to_half_the_budget():
    import argparse

    import pytest

    from atlas.config import ConfigError, EngineConfig
    from atlas.server.vllm_compat import REFUSED

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--model", "m", "--long-prefill-token-threshold", "512"])
    assert EngineConfig.from_cli_args(args).prompt_chunk_cap(8192) == 512
    assert EngineConfig(model="m").prompt_chunk_cap(8192) == 4096
    assert EngineConfig(model="m", long_prefill_token_threshold=0).prompt_chunk_cap(8192) is None
    with pytest.raises(ConfigError, match="--long-prefill-token-threshold"):
        EngineConfig(model="m", long_prefill_token_threshold=-1)
    assert not any("--long-prefill-token-threshold" in flags for flags in REFUSED)


class _RunnerCopy:
    """What a runner keeps of a step's records (runtime/request_tables.py does the same with its own code): each
    request's page table and a penalized request's output tokens, changed by the records alone."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.pages_sent = self.pages_held = 0

    def apply(self, batch) -> None:
        for rid in batch.finished_request_ids + batch.preempted_request_ids:
            self.tables.pop(rid, None)
            self.outputs.pop(rid, None)
        for seq in batch.seqs:
            if seq.pages is not None:
                first, pages = seq.pages
                assert first == 0 or seq.request_id in self.tables  # (a change of a table the runner holds)
                self.tables[seq.request_id] = self.tables.get(seq.request_id, [])[:first] + pages
                self.pages_sent += len(pages)
            self.pages_held += len(self.tables[seq.request_id])
            if seq.new_output_tokens is not None:
                self.outputs.setdefault(seq.request_id, []).extend(seq.new_output_tokens)


def _check_records(out, copy: _RunnerCopy) -> None:
    """The step's records against its live requests, as they are when the step is scheduled."""
    batch = out.batch
    copy.apply(batch)
    for i, (seq, req) in enumerate(zip(batch.seqs, out.requests, strict=True)):
        assert seq.request_id == req.request_id
        assert copy.tables[req.request_id] == req.page_ids
        start, n = batch.start[i], batch.num_scheduled[i]
        first = start + 1 if batch.pending_input[i] else start  # (a pending input is the device's)
        assert list(seq.tokens) == (req.all_token_ids + req.spec_token_ids)[first: start + n]
        assert batch.drafts(i) == req.spec_token_ids
        assert seq.params is req.params and seq.stop_token_ids == req.stop_token_ids
        assert seq.prompt_token_ids == req.prompt_token_ids
        if req.params.needs_penalties:
            assert copy.outputs[req.request_id] == req.output_token_ids
        else:
            assert seq.new_output_tokens is None and req.request_id not in copy.outputs
        assert seq.prompt_positions_scored == (None if req.prompt_logprobs is None else len(req.prompt_logprobs) - 1)


def test_the_records_page_table_changes_rebuild_the_page_tables_and_their_tokens_are_the_requests():
    """Every step's records, applied to a copy of the runner's tables by their changes alone, give the scheduler's
    page tables, through chunked prompts, siblings sharing a prompt's pages, prefix-cache hits, verify steps whose
    rejected pages go back, preemption and re-admission; each record's tokens are its request's at the step's
    positions; a penalized request's output tokens arrive as they come, again whole after a preemption."""
    s = _scheduler(num_pages=14, block_size=4, max_seqs=4, budget=12, prefix_caching=True)
    prompt = list(range(100, 110))
    reqs = [_request("a", 10, max_tokens=14, presence_penalty=0.5),
            _request("b#0", 9, parent="b", max_tokens=12, prompt_logprobs=1),
            _request("b#1", 9, parent="b", index=1, max_tokens=12),
            # (a's prompt: a prefix hit)
            Request("c", "c", 0, None, prompt, SamplingParams(max_tokens=10, frequency_penalty=0.3), []),
            _request("d", 5, max_tokens=16, repetition_penalty=1.2)]
    reqs[2].share_from = reqs[1]
    for r in reqs[:3]:
        s.add(r)
    copy = _RunnerCopy()
    steps = 0
    while s.has_unfinished():
        if steps == 3:
            for r in reqs[3:]:
                s.add(r)
        for r in s.running:  # (every other step, a decode verifies two drafts)
            if steps % 2 and r.num_computed_tokens == r.num_tokens - 1 and s.remaining_tokens(r) > 3:
                r.spec_token_ids = [r.num_tokens % 50, 3]
        out = s.schedule()
        steps += 1
        _check_records(out, copy)
        batch = out.batch
        # (the first draft accepted, or none: the pages of rejected positions go back)
        tokens = [([req.spec_token_ids[0], NEXT] if d and steps % 4 == 1 else [NEXT]) if m else []
                  for req, m, d in zip(out.requests, batch.num_sample_rows, batch.num_drafts, strict=True)]
        s.update_from_output(out, StepResult(tokens, [None] * len(tokens), []))
    # (c, penalized, is preempted after some output tokens: the runner gets them all again)
    assert reqs[3].metrics.num_preemptions and reqs[3].num_cached_tokens and s.stats.spec_num_verify_steps
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert copy.pages_sent < copy.pages_held / 2  # (changes travel, not tables)


def test_the_records_of_asynchronous_steps_leave_a_pending_input_to_the_device_and_follow_released_pages():
    """Asynchronous scheduling (each step scheduled before the last one is read back): a decode's input token is
    still on the device, so its record holds none; a sliding window releases pages from the front of the tables
    (NULL_PAGE entries), which the records' changes carry too."""
    kv = KVCacheManager(12, 4, False, sliding_window=6)
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=256), kv)
    reqs = [_request(f"r{i}", 7 + i, max_tokens=20) for i in range(4)]
    for r in reqs:
        s.add(r)
    copy = _RunnerCopy()
    inflight = None
    pending_inputs, released, shared, made = 0, set(), 0, set()
    while s.has_unfinished() or inflight is not None:
        out = s.schedule()
        if not out.is_empty:
            _check_records(out, copy)
            pending_inputs += sum(out.batch.pending_input)
            released |= {r.request_id for r in out.requests if r.num_released_pages}
            # a decode that brings the runner nothing new (no page change) has its request's one record
            for seq, req, pending in zip(out.batch.seqs, out.requests, out.batch.pending_input, strict=True):
                if pending and seq.pages is None:
                    assert seq is req.idle_record and seq.tokens == ()
                    shared += id(seq) in made
                    made.add(id(seq))
                else:
                    assert seq is not req.idle_record
        if inflight is not None:
            tokens = [[NEXT] if m else [] for m in inflight.batch.num_sample_rows]
            s.update_from_output(inflight, StepResult(tokens, [None] * len(tokens), []))
        inflight = None if out.is_empty else out
    assert pending_inputs and released == {r.request_id for r in reqs} and shared > 20
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
