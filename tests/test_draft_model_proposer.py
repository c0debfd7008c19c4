"""Draft-model drafting (`--speculative draft_model --draft-model PATH`): a smaller checkpoint with the target's
vocabulary drafts K tokens by K greedy decode steps over its own paged KV cache. Lossless greedy decoding under
batching, chunked prefill, prefix caching and preemption; drafts equal to the drafter's own greedy continuation
(its KV cache kept right); sampling; pages returned; the setups it refuses; vLLM's --speculative-config."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from chained_drafting import greedy_then_mixed, through_static_buffers
from conftest import assert_pages_returned, build_checkpoint, hf_greedy, hf_model

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
# Few pages, small chunks, several sequences: preemption, chunked prefill, prefix-cache hits.
PRESSURE = dict(num_gpu_blocks_override=24, block_size=8, max_num_batched_tokens=48, max_num_seqs=6,
                max_model_len=160)
SMALL = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 384, (int(torch.randint(10, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tokenizer_dir):
    """A small random Qwen3 (another seed, 1 layer, hidden 32) with the target's tokenizer and vocabulary."""
    return build_checkpoint(tmp_path_factory.mktemp("drafter"), "Qwen3ForCausalLM", tokenizer_dir, seed=7, **SMALL)


@pytest.fixture(scope="module")
def plain_outputs(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="32MiB", max_model_len=160, enable_prefix_caching=False)
    prompts = _prompts(10)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs]


def _spec(target, drafter, **kw) -> LLM:
    return LLM(str(target), speculative="draft_model", draft_model=str(drafter), speculative_policy="always", **kw)


def _generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.mark.parametrize("k", [1, 4])
def test_target_as_its_own_drafter_accepts_nearly_everything(qwen3_dir, plain_outputs, k):
    prompts, expected = plain_outputs
    llm = _spec(qwen3_dir, qwen3_dir, num_draft_tokens=k, kv_cache_memory="32MiB", max_model_len=160)
    # (its steps' K rows past a step, and the next verify step's: one device drafts right behind a verify step)
    proposer = llm.engine.proposer
    assert proposer.num_draft_tokens == k and proposer.drafts_after_verify and proposer.lookahead_slots == k + 1
    assert _generate(llm, prompts) == expected
    stats = llm.engine.stats
    assert stats.spec_num_verify_steps > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens
    assert llm.engine.proposer.positions_skipped > 0  # (accepted drafts' K/V written by propose are kept)
    assert_pages_returned(llm)
    assert not llm.engine.proposer._written


def test_default_k_is_four(qwen3_dir, drafter_dir):
    llm = _spec(qwen3_dir, drafter_dir, kv_cache_memory="8MiB", max_model_len=128)
    proposer = llm.engine.proposer
    assert proposer.num_draft_tokens == 4 and proposer.capture_layers() == ()
    assert proposer.kv_bytes_per_token() == 1 * 2 * 1 * 16 * 4  # (1 layer, K and V, 1 kv head x 16, float32)
    assert proposer.weight_bytes() > 0


def test_self_drafter_under_pressure_keeps_its_cache_right(qwen3_dir, plain_outputs):
    """Preemption, chunked prefill and prefix-cache hits: the drafter's cache follows the target's pages, so a
    drafter that is the target still accepts nearly everything."""
    prompts, expected = plain_outputs
    llm = _spec(qwen3_dir, qwen3_dir, num_draft_tokens=3, **PRESSURE)
    assert _generate(llm, prompts) == expected
    for _ in range(2):  # the second run reads the first one's pages from the prefix cache
        again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
        assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens > 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.stats.hits > 0
    stats = llm.engine.stats
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
    assert_pages_returned(llm)


def test_small_drafter_greedy_equals_plain_under_pressure(qwen3_dir, drafter_dir, plain_outputs):
    prompts, expected = plain_outputs
    llm = _spec(qwen3_dir, drafter_dir, num_draft_tokens=4, **PRESSURE)
    assert _generate(llm, prompts) == expected
    for _ in range(2):  # the second run reads the first one's pages from the prefix cache
        again = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY)[0]
        assert again.outputs[0].token_ids == expected[1]
    assert again.num_cached_tokens > 0
    stats = llm.engine.stats
    assert stats.spec_num_verify_steps > 0 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


def _record_drafts(proposer) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, its drafts) of every draft `propose` makes from now on."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording(requests):
        drafts = propose(requests)
        seen.extend((list(r.all_token_ids), d.read_tokens()) for r, d in zip(requests, drafts, strict=True))
        return drafts

    proposer.propose = recording
    return seen


def _assert_drafter_greedy(seen, drafter_dir, k: int, samples: int = 25) -> None:
    reference = hf_model(drafter_dir)
    checked = seen[:: max(1, len(seen) // samples)]
    assert len(checked) >= min(10, len(seen)) and checked
    for tokens, drafts in checked:
        assert drafts == hf_greedy(reference, tokens, k)


def test_drafts_are_the_drafters_own_greedy_continuation(qwen3_dir, drafter_dir, plain_outputs):
    """Every draft equals the drafter's greedy continuation of the request's tokens (transformers' generate on
    the drafter checkpoint): its cache holds the right K/V at every position, under pressure too."""
    prompts, expected = plain_outputs
    llm = _spec(qwen3_dir, drafter_dir, num_draft_tokens=3, **PRESSURE)
    seen = _record_drafts(llm.engine.proposer)
    assert _generate(llm, prompts[:6]) == expected[:6]
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(seen) >= 10
    _assert_drafter_greedy(seen, drafter_dir, 3)
    assert_pages_returned(llm)


def test_decode_steps_through_the_graph_buffers(qwen3_dir, drafter_dir, plain_outputs):
    """The drafter's decode steps through the static buffers their CUDA graphs replay (run eagerly on the CPU,
    batches padded into scratch pages), under pressure (preemption, chunks, prefix hits): plain decoding's tokens,
    every draft still the drafter's own greedy continuation, and the eager steps' drafted and accepted counts."""
    prompts, expected = plain_outputs
    eager = _spec(qwen3_dir, drafter_dir, num_draft_tokens=3, **PRESSURE)
    assert eager.engine.proposer.graphs is None
    assert _generate(eager, prompts[:6]) == expected[:6]
    llm = _spec(qwen3_dir, drafter_dir, num_draft_tokens=3, **PRESSURE)
    proposer = llm.engine.proposer
    proposer.capture_step_graphs(llm.engine.runner.proposer_context(), use_graphs=False)
    runs = []
    graphed = proposer.graphs.run
    proposer.graphs.run = lambda *a: runs.append(a[2].num_reqs) or graphed(*a)
    seen = _record_drafts(proposer)
    assert _generate(llm, prompts[:6]) == expected[:6]
    assert runs and max(runs) > 1
    a, b = eager.engine.stats, llm.engine.stats
    assert (a.spec_num_draft_tokens, a.spec_num_accepted_tokens) == (b.spec_num_draft_tokens, b.spec_num_accepted_tokens)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_drafter_greedy(seen, drafter_dir, 3)
    assert_pages_returned(llm)


@pytest.mark.parametrize("own", [True, False], ids=["the-target-itself", "a-small-drafter"])
def test_steps_right_behind_verify_steps_give_the_same_drafts(qwen3_dir, drafter_dir, plain_outputs, own):
    """The drafter's steps queued right behind each uniform greedy verify step (the default on one device: the
    accepted count, the bonus token and the positions from the step's outputs on the device), through the static
    buffers CUDA graphs replay: plain decoding's tokens and the very drafts of drafting after the read-back
    (--tuning draft_after_verify=0), greedy and penalised sampled requests, each draft the drafter's own greedy
    continuation; under pressure (chunks, preemption, prefix hits) too. The target drafting for itself accepts
    whole runs (the last accepted draft's row is written behind the step), the small drafter next to nothing."""
    prompts, expected = plain_outputs
    drafter = qwen3_dir if own else drafter_dir
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = [t[:24] for t in expected]
    kwargs = dict(num_draft_tokens=3, max_num_seqs=6, max_model_len=160, block_size=8)
    host = through_static_buffers(_spec(qwen3_dir, drafter, kv_cache_memory="16MiB",
                                        tuning={"draft_after_verify": False}, **kwargs), 6)
    assert not host.engine.proposer.drafts_after_verify and host.engine.proposer.lookahead_slots == 3
    reference = greedy_then_mixed(host, prompts, params, 6)
    assert reference[0][: len(prompts)] == plain and not reference[3]
    for extra in ({"kv_cache_memory": "16MiB"}, {"num_gpu_blocks_override": 30, "max_num_batched_tokens": 48}):
        llm = through_static_buffers(_spec(qwen3_dir, drafter, **kwargs, **extra), 6)
        proposer = llm.engine.proposer
        assert proposer.drafts_after_verify and proposer.lookahead_slots == 4
        seen = _record_drafts(proposer)
        tokens, counts, drafts, queued, handed_out = greedy_then_mixed(llm, prompts, params, 6)
        assert tokens[: len(prompts)] == plain and sum(queued) > 0
        if "num_gpu_blocks_override" in extra:
            assert llm.engine.scheduler.num_preemptions > 0
        else:
            assert (tokens, counts, drafts) == reference[:3] and all(queued)
            assert (counts[1] > 0.5 * counts[0]) if own else counts[1] < 0.1 * counts[0]
        assert proposer.blocks_behind == sum(map(bool, queued))
        assert 0.8 * sum(queued) <= sum(handed_out) <= sum(queued)
        _assert_drafter_greedy(seen, drafter, 3)
        assert_pages_returned(llm)


def test_adaptive_policy_with_overlapped_plain_steps(qwen3_dir, drafter_dir, plain_outputs):
    """Under the default policy a drafter that does not pay is turned off and plain steps overlap (it captures
    nothing); its cache still follows every commit, so the probes' drafts are still its greedy continuation."""
    prompts, expected = plain_outputs
    llm = LLM(str(qwen3_dir), speculative="draft_model", draft_model=str(drafter_dir), num_draft_tokens=3,
              kv_cache_memory="16MiB", max_model_len=160)
    assert llm.engine._plain_overlap
    seen = _record_drafts(llm.engine.proposer)
    assert _generate(llm, prompts) == expected
    stats = llm.engine.stats
    assert 0 < stats.spec_num_verify_steps < sum(len(t) for t in expected) // 2  # (mostly plain steps)
    _assert_drafter_greedy(seen, drafter_dir, 3)
    assert_pages_returned(llm)


def test_drafter_of_another_family(qwen3_dir, plain_outputs, tmp_path, tokenizer_dir):
    """A Llama drafter with the same vocabulary drafts for the Qwen3 target."""
    prompts, expected = plain_outputs
    llama = build_checkpoint(tmp_path, "LlamaForCausalLM", tokenizer_dir, seed=5, **SMALL)
    llm = _spec(qwen3_dir, llama, num_draft_tokens=2, kv_cache_memory="16MiB", max_model_len=160)
    seen = _record_drafts(llm.engine.proposer)
    assert _generate(llm, prompts[:5]) == expected[:5]
    assert llm.engine.stats.spec_num_verify_steps > 0
    _assert_drafter_greedy(seen, llama, 2)
    assert_pages_returned(llm)


def test_sampling_keeps_working(qwen3_dir, drafter_dir):
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    llm = _spec(qwen3_dir, qwen3_dir, num_draft_tokens=3, kv_cache_memory="16MiB", max_model_len=128)
    first = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    again = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert first == again  # (seeded)
    assert all(len(t) == 20 and all(0 <= x < 384 for x in t) for t in first)
    assert llm.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)
    small = _spec(qwen3_dir, drafter_dir, num_draft_tokens=3, kv_cache_memory="16MiB", max_model_len=128)
    out = small.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(len(o.outputs[0].token_ids) == 20 for o in out)
    assert_pages_returned(small)


def test_bad_draft_models_are_refused_at_startup(qwen3_dir, drafter_dir, tmp_path, tokenizer_dir):
    with pytest.raises(ConfigError, match="--speculative draft_model needs --draft-model PATH"):
        LLM(str(qwen3_dir), speculative="draft_model", kv_cache_memory="8MiB")
    other_vocab = build_checkpoint(tmp_path, "Qwen3ForCausalLM", None, seed=2, vocab_size=400, **SMALL)
    with pytest.raises(ConfigError, match="vocabulary of 400 tokens, the target .* has 384"):
        _spec(qwen3_dir, other_vocab, kv_cache_memory="8MiB")
    bigger = build_checkpoint(tmp_path, "Qwen3ForCausalLM", tokenizer_dir, seed=3, num_hidden_layers=4)
    with pytest.raises(ConfigError, match="is bigger than the target"):
        _spec(qwen3_dir, bigger, kv_cache_memory="8MiB")
    quantized = tmp_path / "quantized"
    shutil.copytree(drafter_dir, quantized)
    raw = json.loads((quantized / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (quantized / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="is quantized .*unquantized drafters only"):
        _spec(qwen3_dir, quantized, kv_cache_memory="8MiB")
    from test_hybrid_models import build_hybrid

    hybrid = build_hybrid(tmp_path, "qwen3_5", None, seed=1, tag="drafter")  # (the same 384-token vocabulary)
    with pytest.raises(ConfigError, match="linear-attention layers with recurrent state.*--speculative mtp"):
        _spec(qwen3_dir, hybrid, kv_cache_memory="8MiB")
    with pytest.raises(ConfigError, match="--draft-model is for --speculative dflash or draft_model.*, not ngram"):
        LLM(str(qwen3_dir), speculative="ngram", draft_model=str(drafter_dir))
    with pytest.raises(ConfigError, match="--speculative-token-map is for --speculative dflash or mtp, not draft_model"):
        LLM(str(qwen3_dir), speculative="draft_model", draft_model=str(drafter_dir), speculative_token_map="x.pt")


def test_parallel_worker_stand_in(qwen3_dir, drafter_dir):
    from atlas.config import EngineConfig, ModelConfig
    from atlas.speculative import proposer_class, verify_only
    from atlas.speculative.draft_model import DraftModelProposer

    assert proposer_class("draft_model") is DraftModelProposer
    target = ModelConfig.from_path(qwen3_dir)
    for k, expected in ((None, 4), (6, 6)):
        config = EngineConfig(model=str(qwen3_dir), speculative="draft_model", draft_model=str(drafter_dir),
                              num_draft_tokens=k, pipeline_parallel_size=2)
        stand_in = verify_only(config, target)
        assert stand_in.num_draft_tokens == expected and stand_in.capture_layers() == ()


def test_vllm_speculative_config_is_translated():
    from atlas.cli import build_parser, parse_args

    args = parse_args(build_parser(), ["serve", "--speculative-config", json.dumps(
        {"method": "draft_model", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 5})])
    assert (args.speculative, args.draft_model, args.num_draft_tokens) == ("draft_model", "Qwen/Qwen3-0.6B", 5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
def test_decode_steps_replay_cuda_graphs_and_keep_plain_tokens_on_cuda(qwen3_dir, drafter_dir, plain_outputs):
    """On CUDA the drafter's decode steps replay captured graphs, whose pools stay within what the memory plan set
    aside for them, queued right behind the verify steps; float32 greedy tokens equal plain decoding's, each draft
    the drafter's own greedy continuation."""
    prompts, _ = plain_outputs
    common = dict(kv_cache_memory="64MiB", max_model_len=160, dtype="float32", max_num_seqs=8)
    plain = _generate(LLM(str(qwen3_dir), **common), prompts)
    llm = _spec(qwen3_dir, drafter_dir, num_draft_tokens=3, **common)
    proposer = llm.engine.proposer
    assert proposer.graphs is not None
    assert 0 < proposer.graphs.captured_mib * 2**20 <= llm.engine.plan.breakdown["drafter cuda graphs"]
    seen = _record_drafts(proposer)
    assert _generate(llm, prompts) == plain
    assert proposer.graphs.steps_run > 0 and llm.engine.stats.spec_num_verify_steps > 0
    assert proposer.blocks_behind > 0  # (greedy uniform verify steps: drafted right behind on the device)
    _assert_drafter_greedy(seen, drafter_dir, 3)
    assert_pages_returned(llm)
