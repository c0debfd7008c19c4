"""AsyncEngine: the step loop in its own thread, outputs streamed to asyncio tasks."""

from __future__ import annotations

import asyncio

import pytest
from conftest import assert_pages_returned
from serving import wait_until

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig
from atlas.engine.async_engine import AsyncEngine, EngineDeadError
from atlas.errors import InvalidRequestError, PromptTooLongError

ENGINE = dict(kv_cache_memory="8MiB", max_model_len=128)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    eng = AsyncEngine.from_config(EngineConfig.from_kwargs(model=str(qwen3_dir), **ENGINE))
    yield eng
    eng.shutdown()


def test_generate_streams_cumulative_outputs_equal_to_offline(engine, qwen3_dir):
    prompts = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 60))]
    expected = LLM(str(qwen3_dir), **ENGINE).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)

    async def run(p):
        seen = []
        async for out in engine.generate({"prompt_token_ids": p}, GREEDY):
            seen.append(out)
        return seen

    async def main():
        return await asyncio.gather(*(run(p) for p in prompts))

    for seen, ref in zip(asyncio.run(main()), expected, strict=True):
        assert seen[-1].finished and all(not o.finished for o in seen[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in seen]
        assert lengths == sorted(lengths)  # cumulative
        assert seen[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert seen[-1].outputs[0].text == ref.outputs[0].text
    assert_pages_returned(engine.engine)


def test_add_errors_reach_the_caller_and_leave_nothing_queued(engine):
    async def main():
        with pytest.raises(PromptTooLongError):
            await engine.add_request({"prompt_token_ids": [3] * 200}, GREEDY)
        with pytest.raises(InvalidRequestError, match="token ids"):
            async for _ in engine.generate({"prompt_token_ids": [10**6]}, GREEDY):
                pass
        stream = await engine.add_request([4, 5, 6], GREEDY, request_id="dup")
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.add_request([4, 5, 6], GREEDY, request_id="dup")
        async for _ in stream:
            pass

    asyncio.run(main())
    assert wait_until(lambda: not engine.engine.has_unfinished())
    assert_pages_returned(engine.engine)


def test_closing_or_cancelling_aborts(engine):
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    core = engine.engine

    async def close_early():
        gen = engine.generate([7, 8, 9], long)
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()

    async def cancel_task():
        async def consume():
            async for _ in engine.generate([7, 8, 10], long):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    for scenario in (close_early, cancel_task):
        before = core.stats.num_generation_tokens
        asyncio.run(scenario())
        assert wait_until(lambda: not core.has_unfinished() and core.kv.num_free_pages == core.kv.num_pages)
        assert core.stats.num_generation_tokens - before < 100
    assert_pages_returned(core)


def test_shutdown_fails_open_streams(qwen3_dir):
    eng = AsyncEngine.from_config(EngineConfig.from_kwargs(model=str(qwen3_dir), **ENGINE))
    long = SamplingParams(max_tokens=110, temperature=0, ignore_eos=True)

    async def main():
        stream = await eng.add_request([3, 4, 5], long)
        await stream.__anext__()
        eng.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request([3, 4, 5], long)

    asyncio.run(main())
    assert not eng.healthy
    assert_pages_returned(eng.engine)
