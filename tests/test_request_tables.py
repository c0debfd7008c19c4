"""The runner's host tables of the running requests (runtime/request_tables.py): page tables and a penalized
request's output tokens, kept from the steps' records and deltas alone, equal what the live requests say."""

from __future__ import annotations

import copy

import numpy as np
import torch
from conftest import assert_pages_returned

from atlas import LLM, SamplingParams
from atlas.runtime.batch import ScheduledSeq, StepBatch
from atlas.runtime.request_tables import RequestTables


def _record(rid: str, pages=None, outputs=None) -> ScheduledSeq:
    return ScheduledSeq(rid, [1], pages, SamplingParams(), [], [], outputs)


def test_page_table_changes_build_the_tables_and_ended_or_preempted_requests_are_forgotten():
    tables = RequestTables(rows=2, width=4)
    whole = [4, 5]
    first = StepBatch([_record("a", (0, whole)), _record("b", (0, [9]), outputs=[3])], [1, 1])
    tables.bind(first)
    assert first.page_tables.lists() == [[4, 5], [9]] and first.output_tokens == {1: [3]}
    # a: a page added; b: unchanged, two more output tokens.
    second = StepBatch([_record("a", (2, [7])), _record("b", outputs=[8, 8])], [1, 1])
    tables.bind(second)
    assert second.page_tables.lists() == [[4, 5, 7], [9]] and second.output_tokens == {1: [3, 8, 8]}
    assert whole == [4, 5]  # (the record stays as the scheduler made it)
    # a: its pages from the second on trimmed, then one added; b preempted and back with its whole table, longer
    # than the array's rows were; c: a row more than the array had.
    third = StepBatch([_record("a", (1, [6])), _record("b", (0, list(range(30, 50))), outputs=[3, 8, 8]),
                       _record("c", (0, [1]))], [1, 1, 1], preempted_request_ids=["b"])
    tables.bind(third)
    assert third.page_tables.lists() == [[4, 6], list(range(30, 50)), [1]]
    assert third.output_tokens == {1: [3, 8, 8]}
    out = np.full((3, 32), -1, dtype=np.int32)  # (a step's table: each row's pages, then zeros)
    third.page_tables.fill(out)
    assert out[0].tolist() == [4, 6] + [0] * 30 and out[1, :21].tolist() == list(range(30, 50)) + [0]
    tables.bind(StepBatch([_record("b"), _record("c")], [1, 1], finished_request_ids=["a"]))
    assert set(tables.row_of) == {"b", "c"} and set(tables.output_tokens) == {"b"} and len(tables) == 2
    # a's row is free again, and holds zeros past the pages of the request that takes it.
    fourth = StepBatch([_record("d", (0, [8]))], [1])
    tables.bind(fourth)
    row = fourth.page_tables.rows[0]
    assert row == first.page_tables.rows[0] and tables.pages[row, :3].tolist() == [8, 0, 0]


def test_the_runner_tables_equal_the_live_requests_at_every_launch(qwen3_dir):
    """A real engine under page pressure (chunked prompts, preemption, prefix-cache hits), asynchronous scheduling,
    siblings sharing a prompt, penalties and prompt logprobs: at each launch the runner's tables, made from the
    records alone, are its requests' page tables and a penalized request's output tokens, and they hold the running
    requests only; no record changes after it is made (the scheduler goes on with the requests meanwhile)."""
    llm = LLM(str(qwen3_dir), num_gpu_blocks_override=28, block_size=8, max_num_batched_tokens=40, max_model_len=128,
              max_num_seqs=6)
    engine, runner, scheduler = llm.engine, llm.engine.runner, llm.engine.scheduler
    assert engine.async_scheduling
    made, checked = [], [0]
    schedule, bind = scheduler.schedule, runner.bind

    def recording_schedule():
        out = schedule()
        made.append((out.batch.seqs, copy.deepcopy(out.batch.seqs)))
        checked.append(out)
        return out

    def checking_bind(batch):
        bind(batch)
        out = checked[-1]
        assert out.batch is batch
        tables, bound = runner.tables, batch.page_tables.lists()
        for i, req in enumerate(out.requests):
            assert tables.page_table(req.request_id) == req.page_ids == bound[i]
            if req.params.needs_penalties:
                assert tables.output_tokens[req.request_id] == req.output_token_ids == batch.output_tokens[i]
        assert set(tables.row_of) == {r.request_id for r in scheduler.running}
        checked[0] += 1

    scheduler.schedule, runner.bind = recording_schedule, checking_bind
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 384, (int(n),), generator=g).tolist() for n in torch.randint(8, 50, (8,), generator=g)]
    prompts[7] = prompts[0][:16] + prompts[7]  # (admitted last: the first prompt's pages are a prefix-cache hit)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=1, presence_penalty=0.7, repetition_penalty=1.2,
                             ignore_eos=True),
              SamplingParams(n=2, max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params[i % 3] for i in range(len(prompts))])
    assert all(len(c.token_ids) == params[i % 3].max_tokens for i, o in enumerate(outs) for c in o.outputs)
    assert checked[0] > 20 and scheduler.num_preemptions > 0 and outs[7].num_cached_tokens >= 16
    assert all(seqs == before for seqs, before in made)
    assert_pages_returned(llm)
