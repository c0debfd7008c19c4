"""Asynchronous scheduling (the next step is scheduled and launched before the last one's tokens are
read; decode inputs come from the device) changes nothing a user sees: tokens, text, stops, logprobs,
seeded samples and finish reasons equal the synchronous engine's, under chunking and preemption, and
every page comes back."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_pages_returned

from atlas import LLM, SamplingParams


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g).tolist()
    return [torch.randint(1, 384, (k,), generator=g).tolist() for k in lengths]


def _summary(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              round(c.cumulative_logprob, 3) if c.cumulative_logprob is not None else None,
              [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in c.logprobs] if c.logprobs else None)
             for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def workload(qwen3_dir):
    """Requests whose stop tokens and stop strings really occur mid-generation (found by a first run),
    mixed lengths, min_tokens, logprobs, prompt logprobs, seeded sampling with n = 2 and penalties."""
    prompts = _prompts(10, seed=5)
    probe = LLM(str(qwen3_dir), kv_cache_memory="16MiB", async_scheduling=False)
    free = probe.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[ids[12]], logprobs=2))
        elif kind == 1 and len(text.strip()) > 8:
            params.append(SamplingParams(max_tokens=30, temperature=0, stop=[text[len(text) // 2: len(text) // 2 + 3]],
                                         ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=7 + i, temperature=0, min_tokens=5, stop_token_ids=[ids[2]],
                                         ignore_eos=True, prompt_logprobs=1))
        elif kind == 3:
            params.append(SamplingParams(n=2, max_tokens=20, temperature=0.9, top_p=0.9, seed=11 + i, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=18, temperature=0.7, seed=3, repetition_penalty=1.3,
                                         presence_penalty=0.5, ignore_eos=True))
    return prompts, params


@pytest.mark.parametrize("pressure", [False, True])
def test_async_scheduling_gives_the_synchronous_outputs(qwen3_dir, workload, pressure):
    prompts, params = workload
    kwargs = dict(kv_cache_memory="16MiB")
    if pressure:  # chunked prefill mixed with decodes, and preemption for lack of pages
        kwargs = dict(num_gpu_blocks_override=28, block_size=8, max_num_batched_tokens=40, max_model_len=128,
                      max_num_seqs=6)
    requests = [{"prompt_token_ids": p} for p in prompts]
    sync = LLM(str(qwen3_dir), async_scheduling=False, **kwargs)
    expected = sync.generate(requests, params)
    asynchronous = LLM(str(qwen3_dir), async_scheduling=True, **kwargs)
    got = asynchronous.generate(requests, params)
    for i, (a, b) in enumerate(zip(_summary(got), _summary(expected), strict=True)):
        for ca, cb in zip(a, b, strict=True):
            assert ca == cb, (i, params[i], [(x, y) for x, y in zip(ca, cb, strict=True) if x != y])
    assert [o.prompt_logprobs is not None for o in got] == [p.prompt_logprobs is not None for p in params]
    reasons = {c.finish_reason for o in got for c in o.outputs}
    assert reasons == {"stop", "length"}
    assert {type(c.stop_reason) for o in got for c in o.outputs if c.finish_reason == "stop"} >= {int, str}
    if pressure:
        assert asynchronous.engine.scheduler.num_preemptions > 0
    assert_pages_returned(asynchronous)
    stats = asynchronous.engine.stats
    assert stats.num_generation_tokens == sum(len(c.token_ids) for o in got for c in o.outputs)


def test_steps_overlap_and_decode_inputs_come_from_the_device(qwen3_dir):
    """The engine launches step N + 1 before it reads step N back, and those decode rows take their
    input token from step N's samples on the device."""
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB")
    engine, runner = llm.engine, llm.engine.runner
    events: list[str] = []
    pending_rows = []
    real_launch = runner.launch

    def launch(batch):
        events.append("launch")
        pending_rows.append(sum(batch.pending_input))
        handle = real_launch(batch)
        real_result = handle.result

        def result():
            events.append("result")
            return real_result()

        handle.result = result
        return handle

    runner.launch = launch
    prompts = _prompts(4, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert "launch,launch,result" in ",".join(events)
    assert max(pending_rows) == len(prompts)  # a whole decode batch fed from the device
    sync = LLM(str(qwen3_dir), kv_cache_memory="16MiB", async_scheduling=False)
    assert [o.outputs[0].token_ids for o in got] == [
        o.outputs[0].token_ids for o in sync.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert_pages_returned(llm)
    assert engine.stats.num_generation_tokens == 4 * 12


def test_abort_with_a_step_in_flight(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", block_size=8)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
           for p in _prompts(3, seed=4)]
    for _ in range(4):
        engine.step()
    assert engine._inflight
    engine.abort_request(ids[1])
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert set(outs) == {ids[0], ids[2]}
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs.values())
    assert_pages_returned(llm)
