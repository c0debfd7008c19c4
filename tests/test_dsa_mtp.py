"""MTP drafting for the DSA families (DeepSeek-V3.2, GLM-5): the MTP block is a DSA layer with its own lightning
indexer and indexer cache. Its math against the spec's dense reference built on transformers' own decoder layer at
index num_hidden_layers (contexts past index_topk, so the top-k selection matters); lossless greedy decoding under
batching, chunked prefill, prefix caching and preemption; and a drafter capped at a maximum context
(--speculative-max-model-len): never handed a position at or past its cap, the capture buffer shrunk to the cap
(the old buffer freed first), and serving going on at plain acceptance when the smaller buffer cannot be had."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import CUDA_KV, _add_mtp_module, _build, _correction_bias, assert_pages_returned
from spec_stats import TINY_VOCAB
from test_dflash import RecordingAllocator, _install
from test_dsa import V32
from test_glm5 import GLM5
from test_mtp import assert_module_matches_reference

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
FAMILIES = {"v32": V32, "glm5": GLM5}


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw})


def _checkpoint(root, family: str, seed: int = 0, **overrides):
    out = _build(root, f"{family}-mtp-{seed}", dict(FAMILIES[family], num_nextn_predict_layers=1), None, seed,
                 overrides, randomize=_correction_bias)
    _add_mtp_module(out, seed)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa-mtp")
    return {family: _checkpoint(root, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """V3.2 with a 5-token vocabulary: its MTP drafts are often right, so acceptance shows."""
    return _checkpoint(tmp_path_factory.mktemp("dsa-mtp-tiny"), "v32", seed=4, vocab_size=TINY_VOCAB)


def _prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _plain(ckpt, prompts) -> list[list[int]]:
    outs = _llm(ckpt, enable_prefix_caching=False).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dsa_mtp_module_matches_the_spec_reference(checkpoints, family):
    """The module's rows and drafts against the dense reference on transformers' DSA decoder layer (test_mtp's
    check: two chunks of commits, 30 rows against a top-k of 8, then 3 chained drafts); its block has an indexer
    of its own, never a shared layer's."""
    ckpt = checkpoints[family]
    assert _llm(ckpt, speculative="mtp").engine.proposer.module.block.self_attn.indexer is not None
    assert_module_matches_reference(ckpt, _prompts(384, [30], seed=4)[0])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dsa_mtp_greedy_equals_plain_under_pressure(checkpoints, family):
    """Batched, chunked prefill across the top-k, prefix-cache hits and forced preemption."""
    ckpt = checkpoints[family]
    shared = _prompts(384, [24], seed=7)[0]
    prompts = [shared + p for p in _prompts(384, [3, 17, 9, 30, 1, 12], seed=8)]
    expected = _plain(ckpt, prompts)
    llm = _llm(ckpt, speculative="mtp", speculative_policy="always", num_draft_tokens=2, num_gpu_blocks_override=24,
               max_num_batched_tokens=32, max_model_len=80, max_num_seqs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.stats.hits > 0
    assert_pages_returned(llm)


def test_dsa_mtp_drafts_are_accepted(tiny):
    prompts = _prompts(TINY_VOCAB, [7, 12, 20, 9, 15], seed=3)
    expected = _plain(tiny, prompts)
    llm = _llm(tiny, speculative="mtp", speculative_policy="always", num_draft_tokens=3)
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)] == \
        expected
    stats = llm.engine.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_pages_returned(llm)


def test_dsa_mtp_under_tensor_parallelism_equals_one_device(tiny):
    """Two ranks on gloo: the driver drafts with the module built whole (its DSA indexer included), every rank
    verifies; the tokens of one device, drafts accepted."""
    from test_parallel import ENGINE, PARALLEL

    prompts = _prompts(TINY_VOCAB, [7, 12, 20, 9], seed=3)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY)]
    llm = LLM(str(tiny), tensor_parallel_size=2, speculative="mtp", num_draft_tokens=2, **ENGINE, **PARALLEL)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.stats.spec_num_accepted_tokens > 0
    finally:
        llm.shutdown()


# --------------------------------------------------------------------------- a drafter capped at a context
CAP = 24


def _record_positions(proposer) -> list[int]:
    """Every position the module is run at, from now on."""
    seen: list[int] = []
    forward = proposer.module.forward

    def recorded(input_ids, hidden, positions, kv_caches, meta):
        seen.extend(positions.tolist())
        return forward(input_ids, hidden, positions, kv_caches, meta)

    proposer.module.forward = recorded
    return seen


def test_capped_drafter_is_never_handed_a_position_past_its_cap(tiny, monkeypatch):
    """Prompts shorter and longer than the cap, generations that cross it: the tokens of plain decoding; the module
    runs at positions below the cap only; requests draft while their chain fits below the cap and not after; the
    capture buffer is planned for a full step, then shrunk to the cap with the old buffer gone first."""
    allocator = RecordingAllocator()
    _install(monkeypatch, allocator)
    prompts = _prompts(TINY_VOCAB, [5, 12, 30, 9, 40], seed=5)
    expected = _plain(tiny, prompts)
    k = 3
    llm = _llm(tiny, speculative="mtp", speculative_policy="always", num_draft_tokens=k, max_num_seqs=4,
               max_num_batched_tokens=64, speculative_max_model_len=CAP)
    proposer = llm.engine.proposer
    assert proposer.prefill_hidden_rows(64) == CAP and llm.engine.runner.capture.rows == CAP
    assert [c["rows"] for c in allocator.calls] == [64, CAP] and allocator.calls[1]["previous_alive"] == 0
    assert llm.engine.runner.capture.prefill_enabled
    seen = _record_positions(proposer)
    drafted: dict[str, list[int]] = {}
    propose = proposer.propose

    def recording_propose(requests):
        drafts = propose(requests)
        for req, d in zip(requests, drafts, strict=True):
            if d.read_tokens():
                drafted.setdefault(req.request_id, []).append(req.num_computed_tokens)
        return drafts

    proposer.propose = recording_propose
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert seen and max(seen) == CAP - 1  # (rows up to the cap's last position were run; none past it)
    # A request drafts only while its chain (positions n - 1 .. n + k - 2 for n computed tokens) fits below the cap.
    assert drafted and all(n + k - 2 < CAP for ns in drafted.values() for n in ns)
    assert llm.engine.stats.spec_num_accepted_tokens > 0
    assert not proposer.state  # (no request's drafting state is kept past its end)
    assert_pages_returned(llm)


def test_capped_drafter_serves_on_when_the_smaller_buffer_cannot_be_had(tiny, monkeypatch, caplog):
    """The shrunk buffer's allocation fails (injected): one warning, prefill capture off, the buffer back at what
    decode and verify rows need, and the tokens of plain decoding."""
    allocator = RecordingAllocator(fail_call=2)
    _install(monkeypatch, allocator)
    prompts = _prompts(TINY_VOCAB, [5, 12, 30, 9], seed=6)
    expected = _plain(tiny, prompts)
    with caplog.at_level(logging.WARNING):
        llm = _llm(tiny, speculative="mtp", speculative_policy="always", num_draft_tokens=2, max_num_seqs=4,
                   max_num_batched_tokens=64, speculative_max_model_len=CAP)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "capture buffer" in warnings[0].getMessage()
    capture = llm.engine.runner.capture
    assert not capture.prefill_enabled and capture.rows == capture.min_rows == 4 * 3
    assert [c["rows"] for c in allocator.calls] == [64, CAP, 12]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats.spec_num_verify_steps > 0
    assert_pages_returned(llm)


@pytest.mark.parametrize("kw,needle", [
    ({"speculative": "ngram", "speculative_max_model_len": 64}, "takes no cap"),
    ({"speculative_max_model_len": 64}, "--speculative-max-model-len needs --speculative"),
    ({"speculative": "mtp", "speculative_max_model_len": 1}, "must be an integer >= 2")])
def test_the_cap_is_refused_where_it_means_nothing(tiny, kw, needle):
    with pytest.raises(ConfigError, match=needle):
        _llm(tiny, **kw)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("cap", [None, CAP])
def test_dsa_mtp_on_cuda_equals_plain(tiny, cap):
    """On the GPU (the DSA Triton kernels, eager), fp32: the tokens of plain decoding, drafts accepted, capped
    or not."""
    prompts = _prompts(TINY_VOCAB, [7, 12, 30, 9, 15], seed=3)
    kw = dict(device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256, skip_tokenizer_init=True, dtype="float32")
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny), **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY)]
    llm = LLM(str(tiny), speculative="mtp", speculative_policy="always", num_draft_tokens=3,
              speculative_max_model_len=cap, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert llm.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)
