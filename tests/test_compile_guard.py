"""Trial compiles of new constraints in a worker process, within a time and a memory limit.

Real grammar engines in real worker processes: a trial past its limit kills its worker (its core and memory come
back) and is refused naming the flag, the next constraint gets a new worker, the engine's own compile threads never
see a refused constraint, and the engine's error messages reach the client unchanged.
"""

from __future__ import annotations

import pytest

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig
from atlas.errors import InvalidRequestError
from atlas.sampling_params import StructuredOutputsParams
from atlas.structured.compile_guard import CompileGuard
from atlas.structured.grammar import make_backend
from atlas.structured.json_schema import GrammarCompileError

ENGINE = dict(kv_cache_memory="32MiB", max_model_len=256)
# A schema whose compile takes a while (200 KB): far past a millisecond, well within the default limits.
BIG = {"type": "object", "additionalProperties": False,
       "properties": {f"p{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(20)]} for i in range(800)},
       "required": [f"p{i}" for i in range(800)]}
SMALL = StructuredOutputsParams(regex="[a-z]{3}")


@pytest.fixture(scope="module")
def tokenizer():
    llm = LLM(**ENGINE)
    return llm.engine.tokenizer.hf, llm.engine.model_config.vocab_size


def test_a_trial_past_its_time_limit_kills_its_worker_and_a_new_one_serves_the_next(tokenizer):
    tok, vocab = tokenizer
    guard = CompileGuard("llguidance", tok, vocab, [0], timeout=60.0, memory_bytes=4 << 30)
    try:
        guard.check(SMALL)  # (the worker is up)
        worker = guard._workers.idle()[0]
        guard.timeout = 0.001
        with pytest.raises(GrammarCompileError, match=r"within 0.001 s \(--structured-outputs-compile-timeout\)"):
            guard.check(StructuredOutputsParams(json=BIG))
        assert guard.killed == 1 and worker.proc.poll() is not None  # (the compile's process is gone)
        guard.timeout = 60.0
        guard.check(SMALL)
        guard.check(StructuredOutputsParams(json=BIG))  # (the same schema, given time, compiles)
        assert guard.killed == 1
    finally:
        guard.close()


def test_a_worker_grown_by_a_compile_is_replaced_and_the_next_trial_is_served(tokenizer, monkeypatch):
    """A worker whose memory grew past RECYCLE_GROWTH_BYTES (-1 here: every worker) is replaced after the compile
    that grew it: that process is gone, and the next trial runs in a new one."""
    from atlas.structured import compile_guard

    tok, vocab = tokenizer
    guard = CompileGuard("llguidance", tok, vocab, [0], timeout=60.0, memory_bytes=4 << 30)
    try:
        guard.check(SMALL)  # (the worker is up)
        worker = guard._workers.idle()[0]
        monkeypatch.setattr(compile_guard, "RECYCLE_GROWTH_BYTES", -1)
        guard.check(StructuredOutputsParams(json=BIG))
        assert guard.recycled == 1 and guard.killed == 0 and worker.proc.poll() is not None
        with pytest.raises(GrammarCompileError):
            guard.check(StructuredOutputsParams(regex="["))  # (a new worker answers, with the engine's refusal)
        assert guard.recycled == 2
    finally:
        guard.close()


def test_a_trial_past_its_memory_limit_is_refused_naming_the_flag(tokenizer):
    tok, vocab = tokenizer
    guard = CompileGuard("llguidance", tok, vocab, [0], timeout=60.0, memory_bytes=1 << 20)
    try:
        with pytest.raises(GrammarCompileError, match=r"more than 1 MiB \(--structured-outputs-compile-memory\)"):
            guard.check(StructuredOutputsParams(json=BIG))
        assert guard.killed == 1
    finally:
        guard.close()


def test_the_trial_refuses_with_the_grammar_engines_own_message(tokenizer):
    tok, vocab = tokenizer
    spec = StructuredOutputsParams(json={"type": "object", "not": {"required": ["a"]}})
    with pytest.raises(GrammarCompileError) as direct:
        make_backend("llguidance", tok, vocab, [0]).compile(spec)
    guard = CompileGuard("llguidance", tok, vocab, [0], timeout=60.0, memory_bytes=4 << 30)
    try:
        with pytest.raises(GrammarCompileError) as trial:
            guard.check(spec)
        assert str(trial.value) == str(direct.value) and trial.value.param == direct.value.param
        assert guard.killed == 0
    finally:
        guard.close()


def test_a_refused_trial_never_reaches_the_engines_compile_threads():
    llm = LLM(structured_outputs_compile_memory="1MiB", **ENGINE)
    params = SamplingParams(max_tokens=4, structured_outputs={"json": BIG})
    with pytest.raises(InvalidRequestError, match="--structured-outputs-compile-memory"):
        llm.generate(["x"], params)
    manager = llm.engine.structured
    assert manager.guard is not None and manager._backend is None  # (the engine's own engines were never built)
    # Plain requests go on as before.
    assert len(llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids) == 3


def test_zero_compiles_in_the_engine_threads_only():
    assert EngineConfig(structured_outputs_compile_memory="0").compile_memory_bytes is None
    assert EngineConfig().compile_memory_bytes == 4 << 30
    llm = LLM(structured_outputs_compile_memory="0", **ENGINE)
    out = llm.generate(["x"], SamplingParams(max_tokens=4, temperature=0, structured_outputs={"choice": ["ab"]}))
    assert out[0].outputs[0].text == "ab" and llm.engine.structured.guard is None
