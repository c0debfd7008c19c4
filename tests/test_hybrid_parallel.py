"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) under tensor and pipeline parallelism, on CPU
with gloo, against one device: the Gated DeltaNet heads split over the tensor-parallel ranks (each rank's state slots
hold only its heads), the layers over the pipeline stages (each stage's state pools hold only its layers; a stage of
linear-attention layers only keeps no KV pages), and the memory plan counts each rank's own state. Greedy tokens and
their logprobs equal one device's plain greedy ones with prompts chunked under a 16-token budget in steps that mix
prefill and decode rows, with prefix-cache hits that resume from recurrent-state snapshots, with n-gram drafts
verified (some accepted, some rejected: the state restored) and across preemption; every page, state slot and
snapshot comes back. The layouts the model cannot be split into are refused by name."""

from __future__ import annotations

import pytest
from test_hybrid_models import _vlm_layout, build_hybrid
from test_hybrid_prefix_cache import assert_all_returned
from test_hybrid_speculation import PROMPTS, build_echo_hybrid, record_restores
from test_parallel import count_steps_in_flight

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig, ModelConfig
from atlas.errors import ConfigError
from atlas.layers.linear_attention import state_bytes_per_sequence
from atlas.runtime.parallel_groups import check_model

NEW = 16
ENGINE = dict(block_size=8, kv_cache_memory="8MiB", max_num_batched_tokens=16, max_num_seqs=8,
              skip_tokenizer_init=True, num_cpu_threads=1)
PARALLEL = dict(distributed_timeout=10.0)
# Prompts that extend earlier ones: prefix hits that resume from the state snapshot at their last cached page.
AGAIN = [PROMPTS[0] + [1, 2, 3], PROMPTS[2] + [4]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-parallel")
    out = {name: build_echo_hybrid(root, name, None) for name in ("qwen3_next", "qwen3_5")}
    # (Qwen3.5's published layout: the language model under model.language_model., which a stage's reads follow)
    out["qwen3_5-vlm"] = _vlm_layout(out["qwen3_5"], root / "qwen3_5-vlm")
    out["qwen3_5_moe"] = build_hybrid(root, "qwen3_5_moe", None)
    # (full attention in layers 0 and 1: the first stage keeps no recurrent state, yet hands out the model's slots)
    out["qwen3_5-full-first"] = build_hybrid(root, "qwen3_5", None, tag="-full-first", layer_types=[
        "full_attention", "full_attention", "linear_attention", "linear_attention"])
    return out


def _greedy(llm, prompts) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens, their logprobs (which a wrong state moves even where the tiny models' tokens stay), and the
    prompt tokens that prefix hits skipped."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=1))
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                for o in outs]
    return tokens, logprobs, sum(o.num_cached_tokens for o in outs)


def _run(llm) -> list[tuple]:
    """Six prompts at once under a 16-token budget (chunked, in steps with others' decode rows), then two that
    extend earlier ones (prefix hits that resume from a state snapshot); everything returned after each."""
    first = _greedy(llm, PROMPTS)
    assert_all_returned(llm)
    again = _greedy(llm, AGAIN)
    assert_all_returned(llm)
    return [first, again]


def _assert_same(got: list[tuple], want: list[tuple], same_hits: bool) -> None:
    for (tokens, logprobs, cached), (want_tokens, want_logprobs, want_cached) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for row, want_row in zip(logprobs, want_logprobs, strict=True):
            assert row == pytest.approx(want_row, abs=2e-4)
        assert cached == want_cached if same_hits else (cached > 0) == (want_cached > 0)
    assert got[1][2] > 0


@pytest.mark.parametrize("name, tp, pp, spec, ep, preempt", [
    # (grouped in_proj_qkvz / in_proj_ba; MoE with a shared expert, the routed experts whole on their rank)
    ("qwen3_next", 2, 1, True, True, False),
    ("qwen3_5-vlm", 1, 2, True, False, False),  # (stage 0: two linear-attention layers, no KV pages)
    # (four ranks, every expert sharded; asynchronous scheduling, steps in flight on both stages; 16 pages: requests
    #  preempted and recomputed, their slots given back)
    ("qwen3_5_moe", 2, 2, False, False, True),
    ("qwen3_5-full-first", 1, 2, False, False, False),
])
def test_greedy_equals_one_device(dirs, name, tp, pp, spec, ep, preempt):
    engine_kw = dict(ENGINE, num_gpu_blocks_override=16, max_model_len=64, state_snapshots=8) if preempt else ENGINE
    one = LLM(str(dirs[name]), **engine_kw)
    want = _run(one)
    kw = dict(speculative="ngram", speculative_policy="always", ngram_min=1) if spec else {}
    if ep:
        kw["enable_expert_parallel"] = True
    llm = LLM(str(dirs[name]), tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw, **engine_kw, **PARALLEL)
    try:
        engine = llm.engine
        restores = record_restores(llm)
        in_flight = count_steps_in_flight(engine)
        # (pipeline stages schedule micro-batches: their prefix hits need only happen)
        _assert_same(_run(llm), want, same_hits=pp == 1)
        assert (engine.scheduler.num_preemptions > 0) == (one.engine.scheduler.num_preemptions > 0) == preempt
        if spec:
            stats = engine.scheduler.stats
            assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens and restores
        if pp > 1 and not spec:
            assert max(in_flight) >= 1  # (the stages overlapped)
        _assert_state_is_per_rank(engine, one.engine, tp, pp)
        if all(layer.recurrent is not None for layer in engine.runner.model.model.layers):  # (its pages: the other stage's)
            assert not engine.runner.kv_caches and engine.plan.page_bytes == 0 < engine.plan.num_pages
    finally:
        llm.shutdown()


def _assert_state_is_per_rank(engine, one, tp: int, pp: int) -> None:
    """The driver's pools and memory plan hold its own heads (1 / tp of each layer's) of its stage's layers."""
    runner, ref = engine.runner, one.runner
    if not any(layer.recurrent is not None for layer in runner.model.model.layers):  # (a stage of full-attention layers only)
        assert not runner.state_specs and runner.state_bytes == runner.snapshot_bytes == 0
        assert engine.kv.num_snapshots == one.kv.num_snapshots > 0  # (it counts the model's snapshot ids)
        return
    assert len(runner.state_specs) == (2 if pp > 1 else len(ref.state_specs))
    for got, full in zip(runner.state_specs, ref.state_specs, strict=False):
        assert (got.num_heads * tp, got.conv_dim * tp) == (full.num_heads, full.conv_dim)
    conv, ssm = runner.state_pools[0]
    assert (conv.shape[1], ssm.shape[1]) == (runner.state_specs[0].conv_dim, runner.state_specs[0].num_heads)
    per_slot = state_bytes_per_sequence(runner.state_specs, runner.dtype)
    assert per_slot * tp * len(ref.state_specs) == (state_bytes_per_sequence(ref.state_specs, ref.dtype)
                                                    * len(runner.state_specs))
    # (with speculation, each slot's saved verify-step rows too: this rank's conv channels and heads)
    inputs = runner.num_state_slots * runner.states.verify_rows * sum(s.verify_row_values for s in runner.state_specs)
    assert runner.state_bytes == (per_slot * (runner.num_state_slots + runner.num_state_backups)
                                  + inputs * runner.dtype.itemsize)
    assert engine.plan.breakdown["recurrent state"] == runner.state_bytes
    assert engine.plan.breakdown["recurrent-state snapshots"] == runner.snapshot_bytes > 0


def test_layouts_the_linear_heads_do_not_split_into_are_refused(dirs):
    """2 key heads and 4 value heads in the linear-attention layers (4 attention heads, 2 KV heads): 4 ranks would
    split the attention but not the linear-attention heads."""
    cfg = ModelConfig.from_path(dirs["qwen3_next"])
    with pytest.raises(ConfigError, match="--tensor-parallel-size 4 does not divide the model's 2 linear-attention "
                                          "key heads"):
        check_model(EngineConfig(tensor_parallel_size=4), cfg)
    check_model(EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2), cfg)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 4 does not divide"):
        LLM(str(dirs["qwen3_5"]), tensor_parallel_size=4, **ENGINE)


class _Slice:
    """A lazy safetensors slice of `tensor` that records the rows read."""

    def __init__(self, tensor):
        self.tensor, self.read = tensor, []

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, index):
        rows = index[0] if isinstance(index, tuple) else index
        self.read.append((rows.start, rows.stop))
        return self.tensor[index]


def test_a_rank_reads_only_its_key_head_groups_of_qwen3_next_grouped_projections():
    """in_proj_qkvz / in_proj_ba store rows grouped by key head: a rank reads its groups alone, and its loaders get
    from them exactly the rows of the whole tensor put in head order that are its own; another rank's rows are not
    there."""
    import torch

    from atlas.layers.linear import narrow_loaded
    from atlas.layers.linear_attention import (
        grouped_ba_of_rank,
        grouped_qkvz_of_rank,
        split_grouped_ba,
        split_grouped_qkvz,
    )

    nk, nv, dk, dv, hidden, tp = 4, 8, 3, 2, 5, 2
    per_head = 2 * dk + 2 * (nv // nk) * dv
    qkvz, ba = torch.randn(nk * per_head, hidden), torch.randn(2 * nv, hidden)
    whole_qkv, whole_z = split_grouped_qkvz(qkvz, nk, nv, dk, dv)
    whole_b, whole_a = split_grouped_ba(ba, nk, nv)
    key, value = nk // tp * dk, nv // tp * dv
    for rank in range(tp):
        lazy = _Slice(qkvz)
        qkv, z = grouped_qkvz_of_rank(lazy, nk, nv, dk, dv, tp, rank)
        assert lazy.read == [(rank * per_head * nk // tp, (rank + 1) * per_head * nk // tp)]
        for first, rows in [(rank * key, key), (nk * dk + rank * key, key), (2 * nk * dk + rank * value, value)]:
            assert torch.equal(narrow_loaded(qkv, 0, first, rows), whole_qkv[first: first + rows])
        assert torch.equal(narrow_loaded(z, 0, rank * value, value), whole_z[rank * value: (rank + 1) * value])
        with pytest.raises(ValueError, match="another tensor-parallel rank"):
            narrow_loaded(z, 0, (1 - rank) * value, value)
        b, a = grouped_ba_of_rank(_Slice(ba), nk, nv, tp, rank)
        heads = nv // tp
        assert torch.equal(narrow_loaded(b, 0, rank * heads, heads), whole_b[rank * heads: (rank + 1) * heads])
        assert torch.equal(narrow_loaded(a, 0, rank * heads, heads), whole_a[rank * heads: (rank + 1) * heads])


def test_step_messages_carry_the_state_slots_and_copies():
    """Every rank applies a step's state copies to its own pools at the driver's slot and snapshot ids."""
    from atlas.engine.request import Request
    from atlas.runtime.parallel_protocol import StepInfo, decode_step, encode_step
    from atlas.runtime.request_tables import snapshot_batch

    a = Request("a", "a", 0, None, [1, 2, 3], SamplingParams(), [])
    b = Request("b", "b", 0, None, [4, 5], SamplingParams(), [])
    a.page_ids, b.page_ids = [0], [1]
    states = dict(state_slots=[3, 0], state_loads=[(1, 3)], state_saves=[(0, 2, 4)], state_backups=[0],
                  state_replays=[(3, 2)])
    batch, _ = decode_step(encode_step(snapshot_batch([a, b], [3, 2], **states), StepInfo(1)))
    assert {k: getattr(batch, k) for k in states} == states
    plain, _ = decode_step(encode_step(snapshot_batch([b], [2]), StepInfo(1)))
    assert plain.state_slots == plain.state_loads == plain.state_replays == []
