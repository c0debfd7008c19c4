"""Prefix caching for the hybrid models (Qwen3-Next, Qwen3.5; the Mamba-2 layers of Granite 4.0-H and Nemotron-H, Jamba's Mamba layers): a prefix hit resumes from a snapshot
of the recurrent state at the hit's last page (engine/kv_cache.py), so greedy tokens with prefix caching equal
transformers' (and so equal those without it) for shared prefixes shorter than a page, of whole pages and of pages
plus a few tokens, in chunked prefill under a small token budget, for n > 1 siblings and across preemption; the hits
happen (counters), every page, slot and snapshot is accounted for after each batch, and the memory plan counts the
snapshots."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import assert_pages_returned, hf_greedy, hf_model
from test_hybrid_models import build_hybrid, greedy

from atlas import LLM, SamplingParams
from atlas.errors import OutOfMemoryPlanError

BS = 8
A = list(range(100, 137))  # 37 tokens: its snapshot is at 32, the last page boundary before its last token
PROMPTS = {
    "A": A,
    "A+3": A + [7, 8, 9],  # pages + a few tokens: resumes at 32
    "A32+1": A[:32] + [1],  # exactly the 4 shared pages: resumes at 32, computes 1 token
    "B": A[:16] + list(range(50, 61)),  # 27 tokens: 2 pages shared with A but no snapshot at 16 (a full prefill)
    "C": A[:5] + [9] * 10,  # shares less than a page
    "D": A[:16] + list(range(70, 81)),  # shares B's first 2 pages (A's): resumes from B's snapshot at 16
}
NEW = 12


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("hybrid-prefix")
    from conftest import _build
    from test_ssm_hybrids import CONFIGS as MAMBA2

    dirs = {name: build_hybrid(root, name, tokenizer_dir) for name in ("qwen3_next", "qwen3_5")}
    dirs["granite"] = _build(root, "granite", MAMBA2["moe"], tokenizer_dir, 0, {})  # (Mamba-2 layers)
    dirs["nemotron_h"] = _build(root, "nemotron_h", MAMBA2["nemotron_h"], tokenizer_dir, 0, {})
    dirs["jamba"] = _build(root, "jamba", MAMBA2["jamba"], tokenizer_dir, 0, {})  # (Mamba version 1)
    return dirs


@pytest.fixture(scope="module")
def expected(dirs):
    out = {}
    for name, path in dirs.items():
        model = hf_model(path)
        out[name] = {k: hf_greedy(model, p, NEW) for k, p in PROMPTS.items()}
    return out


def assert_all_returned(llm) -> None:
    """Pages and state slots back; every snapshot either free or held by a cached page no request holds."""
    engine = llm.engine
    assert_pages_returned(llm)
    slots = engine.scheduler.state_slots
    assert slots.num_free == slots.num_slots
    kv = engine.kv
    pool = kv.pool
    held = list(pool.snapshot.values())
    assert sorted(held + pool.free_snapshots) == list(range(kv.num_snapshots))
    for page in pool.snapshot:
        h = pool.page_hash[page]
        assert h is not None and pool.cached[h] == page and pool.ref_cnt[page] == 0


def run(llm, keys, **kw):
    return dict(zip(keys, greedy(llm, [PROMPTS[k] for k in keys], n=NEW, **kw), strict=True))


@pytest.mark.parametrize("name, budget, sync", [("qwen3_next", None, False), ("qwen3_5", 16, False),
                                                ("qwen3_next", 16, True), ("granite", None, False),
                                                ("granite", 16, False), ("nemotron_h", 16, True),
                                                ("jamba", None, False)])
def test_prefix_hits_resume_from_snapshots(dirs, expected, name, budget, sync):
    """A alone (its snapshot saved at 32), then four prompts at once: two resume at 32, B's chain of 2 pages has no
    snapshot (a full prefill, saving snapshots at 16, where it parts from A, and at 24), C shares less than a page;
    then B again resumes at 24, and D, which shares A's and B's first 2 pages, at 16. With
    budget 16 the prompts are chunked (A in 16 + 16 + 5); sync: synchronous scheduling."""
    kw = dict(max_num_batched_tokens=budget) if budget else {}
    if sync:
        kw["async_scheduling"] = False
    llm = LLM(str(dirs[name]), kv_cache_memory="8MiB", block_size=BS, max_num_seqs=4, state_snapshots=4, **kw)
    kv = llm.engine.kv
    assert kv.enable_prefix_caching and kv.num_snapshots == 4
    want = expected[name]
    assert run(llm, ["A"]) == {"A": want["A"]}
    assert kv.stats.hits == 0
    if budget is None:  # (A's prompt in one step: its snapshot at 32 is taken inside it, between two passes)
        assert llm.engine.stats.num_steps == NEW
    assert_all_returned(llm)
    keys = ["A+3", "A32+1", "B", "C"]
    assert run(llm, keys) == {k: want[k] for k in keys}
    assert kv.stats.hits == 32 + 32
    assert_all_returned(llm)
    assert run(llm, ["B"]) == {"B": want["B"]}
    assert kv.stats.hits == 32 + 32 + 24
    assert_all_returned(llm)
    assert run(llm, ["D"]) == {"D": want["D"]}
    assert kv.stats.hits == 32 + 32 + 24 + 16
    assert_all_returned(llm)
    # the same prompts without prefix caching: the same tokens
    off = LLM(str(dirs[name]), kv_cache_memory="8MiB", block_size=BS, max_num_seqs=4, enable_prefix_caching=False,
              **kw)
    assert run(off, list(PROMPTS)) == want


def test_n_samples_and_repeats(dirs, expected):
    """n = 3: the first sibling computes the prompt, the other two wait for it and resume from its snapshot at 32;
    the same prompt again resumes all three there."""
    llm = LLM(str(dirs["qwen3_5"]), kv_cache_memory="8MiB", block_size=BS, max_num_seqs=4, state_snapshots=4)
    params = SamplingParams(n=3, max_tokens=NEW, temperature=0, ignore_eos=True)
    for hits in (2 * 32, 5 * 32):
        out = llm.generate([{"prompt_token_ids": PROMPTS["A+3"]}], params)[0]
        assert [c.token_ids for c in out.outputs] == [expected["qwen3_5"]["A+3"]] * 3
        assert_all_returned(llm)
        assert len(llm.engine.kv.pool.snapshot) == 1
        assert llm.engine.kv.stats.hits == hits


def test_a_single_snapshot_goes_to_the_latest_prompt(dirs, expected):
    """--state-snapshots 1: C's prompt takes A's snapshot (A's pages stay cached without it); A32+1 then finds A's
    4 pages without one (a full prefill, exact) and takes C's back for their end, from which A+3 resumes."""
    llm = LLM(str(dirs["qwen3_5"]), kv_cache_memory="8MiB", block_size=BS, max_num_seqs=4, state_snapshots=1)
    kv, want = llm.engine.kv, expected["qwen3_5"]
    for keys, hits in ((["A"], 0), (["C"], 0), (["A32+1"], 0), (["A+3"], 32)):
        assert run(llm, keys) == {k: want[k] for k in keys}
        assert kv.stats.hits == hits
        assert_all_returned(llm)
        assert len(kv.pool.snapshot) == 1


def test_preemption_and_eviction(dirs, expected):
    """Too few pages: requests are preempted and recomputed (resuming from a snapshot when their page is still
    cached); cached pages are evicted and their snapshots with them. Tokens still equal transformers'."""
    llm = LLM(str(dirs["qwen3_next"]), num_gpu_blocks_override=9, block_size=BS, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16)
    keys = ["A", "A+3", "B", "C"]
    assert run(llm, keys) == {k: expected["qwen3_next"][k] for k in keys}
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_returned(llm)
    assert run(llm, ["A32+1"]) == {"A32+1": expected["qwen3_next"]["A32+1"]}
    assert_all_returned(llm)


def test_memory_plan_counts_snapshots(dirs, caplog):
    path = str(dirs["qwen3_5"])
    with caplog.at_level(logging.INFO, logger="atlas"):
        llm = LLM(path, kv_cache_memory="8MiB", block_size=BS, max_num_seqs=8, state_snapshots=5)
    assert "5 recurrent-state snapshots" in caplog.text
    runner, plan = llm.engine.runner, llm.engine.plan
    per_seq = sum(spec.bytes_per_sequence(torch.float32) for spec in runner.state_specs)
    assert plan.breakdown["recurrent state"] == per_seq * 9
    assert plan.breakdown["recurrent-state snapshots"] == per_seq * 5
    assert plan.num_pages == (8 * 2**20 - per_seq * 14) // plan.page_bytes
    assert [tuple(c.shape) for c in runner.state_pools[0]] == [(14, 128, 2), (14, 4, 16, 16)]
    assert llm.engine.kv.num_snapshots == 5
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="atlas"):
        llm = LLM(path, kv_cache_memory="8MiB", block_size=BS, max_num_seqs=8, state_snapshots=0)
    assert "prefix caching is off" in caplog.text and not llm.engine.kv.enable_prefix_caching
    assert "recurrent-state snapshots" not in llm.engine.plan.breakdown
    with pytest.raises(OutOfMemoryPlanError, match="--state-snapshots"):
        LLM(path, kv_cache_memory=f"{per_seq * 40}", block_size=BS, max_num_seqs=8, state_snapshots=40)
    # By default a quarter of --max-num-seqs.
    assert LLM(path, kv_cache_memory="8MiB", block_size=BS, max_num_seqs=8).engine.kv.num_snapshots == 2


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_mixed_steps_through_the_graphs_static_buffers_keep_snapshots(dirs, expected, name):
    """--tuning mixed_graph_recurrent_rows=16 with static_steps (on a CPU: the mixed-step graphs' static buffers,
    uncaptured): under a 16-token budget, prompt chunks beside other requests' decodes take those buffers, the
    linear-attention layers reading every sequence's rows, slot and in-step snapshot from them and going token by
    token (B's snapshot at 24 falls inside its second chunk). Tokens equal transformers', the prefix hits are the
    eager engine's, and the snapshots taken there serve later hits (B again, D)."""
    llm = LLM(str(dirs[name]), kv_cache_memory="8MiB", block_size=BS, max_num_seqs=4, state_snapshots=4,
              max_num_batched_tokens=16, tuning={"static_steps": "1", "mixed_graph_recurrent_rows": "16"})
    mixed = llm.engine.runner.mixed_graphs
    assert mixed is not None and mixed.states is not None
    inside = []
    load = mixed.states.load
    mixed.states.load = lambda size, meta: (inside.extend(meta.state_splits if meta else ()), load(size, meta))[1]
    want, kv = expected[name], llm.engine.kv
    assert run(llm, ["A"]) == {"A": want["A"]}
    keys = ["A+3", "A32+1", "B", "C"]
    assert run(llm, keys) == {k: want[k] for k in keys}
    assert kv.stats.hits == 32 + 32
    assert mixed.steps_run > 0 and inside  # (some of them with a snapshot inside a sequence's rows)
    assert_all_returned(llm)
    assert run(llm, ["B"]) == {"B": want["B"]}
    assert run(llm, ["D"]) == {"D": want["D"]}
    assert kv.stats.hits == 32 + 32 + 24 + 16
    assert_all_returned(llm)
