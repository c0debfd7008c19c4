"""Continuous batching, chunked prefill, preemption, prefix caching, n > 1 and aborts: the engine's
outputs never depend on how requests were batched, and every page comes back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_pages_returned, hf_greedy, hf_model, step_input_numbers

from atlas import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 90, (n,), generator=g).tolist()
    return [torch.randint(1, 384, (n_,), generator=g).tolist() for n_ in lengths]


def _token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """Greedy tokens of each prompt run alone, with a roomy page pool."""
    llm = LLM(str(qwen3_dir), kv_cache_memory="32MiB", enable_prefix_caching=False)
    prompts = _prompts(14)
    expected = [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts]
    return prompts, expected


def test_reference_matches_transformers(qwen3_dir, reference):
    prompts, expected = reference
    model = hf_model(qwen3_dir)
    assert hf_greedy(model, prompts[0], 24) == expected[0]
    assert hf_greedy(model, prompts[5], 24) == expected[5]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batched_chunked_preempted_equals_one_at_a_time(qwen3_dir, reference, prefix_caching):
    prompts, expected = reference
    # 24 pages of 8 tokens = 192 token slots for 14 requests of up to 113 tokens: preemption is forced.
    # A 40-token budget forces chunked prefill, mixed with decodes.
    llm = LLM(str(qwen3_dir), num_gpu_blocks_override=24, block_size=8, max_num_batched_tokens=40, max_model_len=128,
              max_num_seqs=8, enable_prefix_caching=prefix_caching)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert _token_ids(outs) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


def test_step_tensors_are_aligned_for_the_kernels(qwen3_dir, reference):
    """Triton compiles a kernel variant per pattern of 16-byte pointer alignment and of integer arguments
    divisible by 16: every per-step device tensor (slices of packed buffers) starts on a 16-byte boundary and
    page-table rows hold a multiple of 16 entries, whatever the step's shape, so no variant first appears
    mid-serve. Outputs stay those of each prompt run alone."""
    prompts, expected = reference
    llm = LLM(str(qwen3_dir), kv_cache_memory="32MiB", block_size=8, max_num_batched_tokens=40, max_num_seqs=8)
    runner, steps = llm.engine.runner, []
    prepare = runner.prepare_inputs

    def recorded(batch):
        steps.append(prepare(batch))
        return steps[-1]

    runner.prepare_inputs = recorded
    assert _token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)) == expected
    shapes = set()
    for inputs in steps:
        meta = inputs.meta
        tensors = [inputs.input_ids, inputs.positions, inputs.sample_rows, meta.query_start_loc, meta.seq_lens,
                   meta.page_tables, meta.slot_mapping]
        tensors += [meta.programs.req, meta.programs.q0] if meta.programs is not None else []
        assert [t.data_ptr() % 16 for t in tensors] == [0] * len(tensors), (meta.num_reqs, meta.num_tokens)
        assert meta.page_tables.stride(0) % 16 == 0
        shapes.add((meta.num_reqs, meta.num_tokens))
    assert len(shapes) > 8  # (mixed chunks and decodes of many sizes)
    assert_pages_returned(llm)


@pytest.mark.parametrize("spec", [None, "ngram", "dflash"])
def test_the_uniform_shortcut_prepares_what_the_general_path_does(qwen3_dir, reference, spec, tmp_path):
    """Uniform steps (every sequence q rows, all sampled: plain decodes, verifies of whole drafts) take a short
    way through the input arithmetic (InputPreparer.decode_shortcut): every step of a mixed run (chunked
    prefills, decodes of changing batch sizes, n-gram verify steps with whole and ragged drafts) is prepared
    both ways and must give the same numbers; outputs stay those of each prompt run alone."""
    prompts, expected = reference
    kwargs = {"ngram": dict(speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1)}.get(spec, {})
    if spec == "dflash":
        from test_dflash import write_drafter

        drafter = write_drafter(tmp_path, hidden=64, layer_ids=[0, 1], mask_token_id=383, block_size=4)
        kwargs = dict(speculative="dflash", speculative_policy="always", draft_model=str(drafter))
    llm = LLM(str(qwen3_dir), kv_cache_memory="32MiB", block_size=8, max_num_batched_tokens=40, max_num_seqs=8,
              **kwargs)
    runner, taken = llm.engine.runner, []
    prepare = runner.prepare_inputs

    def both_ways(batch):
        prepare(batch)  # (creates the preparer on the first step)
        preparer = runner.inputs
        preparer.decode_shortcut = False
        general = step_input_numbers(prepare(batch))
        preparer.decode_shortcut = True
        inputs = prepare(batch)
        fast = step_input_numbers(inputs)
        assert fast.keys() == general.keys()
        for key, value in general.items():
            same = torch.equal(fast[key], value) if isinstance(value, torch.Tensor) else fast[key] == value
            assert same, (key, fast[key], value)
        uniform = len(set(batch.num_scheduled)) == 1 and batch.num_sample_rows == batch.num_scheduled
        taken.append(batch.num_scheduled[0] if uniform else 0)
        return inputs

    runner.prepare_inputs = both_ways
    assert _token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)) == expected
    assert 1 in taken and 0 in taken  # (uniform decodes and other steps were compared)
    if spec == "dflash":  # (whole blocks of drafts: uniform verify steps)
        assert any(q > 1 for q in taken)
    assert_pages_returned(llm)


def test_prefix_cache_hit_computes_only_the_tail(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", block_size=8)
    shared = list(range(10, 74))  # 64 tokens = 8 full pages
    first = llm.generate({"prompt_token_ids": shared + [1, 2, 3]}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    computed_before = llm.engine.stats.num_prompt_tokens
    second = llm.generate({"prompt_token_ids": shared + [4, 5, 6, 7, 8]}, GREEDY)[0]
    assert second.num_cached_tokens == 64
    assert llm.engine.stats.num_prompt_tokens - computed_before == 5  # only the uncached tail
    stats = llm.engine.kv.stats
    assert stats.hits == 64 and stats.queries == 67 + 69

    plain = LLM(str(qwen3_dir), kv_cache_memory="16MiB", block_size=8, enable_prefix_caching=False)
    again = plain.generate({"prompt_token_ids": shared + [4, 5, 6, 7, 8]}, GREEDY)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == second.outputs[0].token_ids
    assert_pages_returned(llm)
    assert_pages_returned(plain)


def test_identical_prompt_reuses_all_but_last_page(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", block_size=8)
    prompt = {"prompt_token_ids": list(range(20, 52))}  # exactly 4 pages
    a = llm.generate(prompt, GREEDY)[0]
    b = llm.generate(prompt, GREEDY)[0]
    # The last token must be recomputed to produce logits, so its page is not taken from the cache.
    assert b.num_cached_tokens == 24
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_pages_returned(llm)


def test_lru_eviction_keeps_serving_correctly(qwen3_dir, reference):
    prompts, expected = reference
    llm = LLM(str(qwen3_dir), num_gpu_blocks_override=20, block_size=8, max_model_len=128)
    for p, e in zip(prompts[:6], expected[:6], strict=True):
        assert llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids == e
    # The pool is small, so old cached pages were evicted; re-running still gives the same answers.
    for p, e in zip(prompts[:6], expected[:6], strict=True):
        assert llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids == e
    assert_pages_returned(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_greater_than_one_shares_prompt_pages(qwen3_dir, prefix_caching):
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", block_size=8, enable_prefix_caching=prefix_caching)
    prompt = {"prompt_token_ids": list(range(30, 71))}  # 41 tokens: 5 full pages + 1
    single = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    before = llm.engine.stats.num_prompt_tokens
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == single for c in out.outputs)
    computed = llm.engine.stats.num_prompt_tokens - before
    if prefix_caching:
        assert computed == 3 * 1  # every sequence hits the 40 cached tokens and computes the last one
    else:
        assert computed == 41 + 2 * 1  # siblings share the first sequence's 5 full pages
    sampled = llm.generate(prompt, SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    texts = {tuple(c.token_ids) for c in sampled.outputs}
    assert len(texts) > 1  # siblings draw different samples
    again = llm.generate(prompt, SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in sampled.outputs]
    assert_pages_returned(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_siblings_admitted_after_the_first_one_finished_compute_the_same_prompt(qwen3_dir, prefix_caching):
    """One sequence at a time (max_num_seqs=1): sequence 0 of an n = 3 request has finished, and its pages have gone
    back, before its siblings are admitted. They must not take its pages (a finished sequence holds none); the
    prefix cache, where on, gives them the prompt instead. Greedy siblings equal a single greedy request's tokens,
    and seeded samples equal those of an engine that runs all three together."""
    kw = dict(kv_cache_memory="16MiB", block_size=8, enable_prefix_caching=prefix_caching)
    one_at_a_time = LLM(str(qwen3_dir), max_num_seqs=1, **kw)
    prompt = {"prompt_token_ids": list(range(30, 71))}  # 41 tokens: 5 full pages + 1
    single = one_at_a_time.generate(prompt, GREEDY)[0].outputs[0].token_ids
    out = one_at_a_time.generate(prompt, SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [single] * 3
    seeded = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    together = LLM(str(qwen3_dir), **kw).generate(prompt, seeded)[0]
    apart = one_at_a_time.generate(prompt, seeded)[0]
    assert [c.token_ids for c in apart.outputs] == [c.token_ids for c in together.outputs]
    assert_pages_returned(one_at_a_time)


def test_a_sibling_that_cannot_be_admitted_holds_no_pages_while_it_waits(qwen3_dir):
    """Sequence 1 of an n = 2 request shares sequence 0's prompt pages when admitted; when the rest of its prompt then
    finds no free page it goes back to the queue, and must give those pages back: held by a waiting sequence, they
    had kept the running ones short on a tight pool, which then preempted one another forever (this workload
    spun for thousands of steps). Outputs equal a roomy engine's, every page comes back."""
    roomy = LLM(str(qwen3_dir), block_size=8, max_model_len=128, enable_prefix_caching=False)
    tight = LLM(str(qwen3_dir), block_size=8, max_model_len=128, enable_prefix_caching=False,
                num_gpu_blocks_override=17)
    requests = {"b": (list(range(10, 90)), 1), "a": (list(range(100, 140)), 2)}
    outputs = {}
    for llm in (roomy, tight):
        core = llm.engine
        for rid, (prompt, n) in requests.items():
            core.add_request(prompt, SamplingParams(n=n, max_tokens=40, temperature=0, ignore_eos=True), rid)
        out, steps = {}, 0
        while core.has_unfinished():
            for o in core.step():
                if o.finished:
                    out[o.request_id] = [c.token_ids for c in o.outputs]
            assert not any(r.page_ids for r in core.scheduler.waiting), "a waiting sequence holds KV pages"
            steps += 1
            assert steps < 500, "the engine is not making progress"
        outputs[llm is tight] = out
    assert core.scheduler.num_preemptions > 0
    assert outputs[True] == outputs[False]
    assert_pages_returned(tight)


def test_abort_returns_pages(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", block_size=8, max_num_batched_tokens=32)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in _prompts(6, seed=3)]
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_pages < engine.kv.num_pages
    for rid in ids:
        assert engine.abort_request(rid)
    assert not engine.abort_request(ids[0])  # already gone
    assert_pages_returned(llm)
    # The engine keeps working after aborts.
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 24
    assert_pages_returned(llm)


def test_max_model_len_finishes_with_length(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB", max_model_len=40)
    out = llm.generate({"prompt_token_ids": list(range(1, 31))},
                       SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 10
    assert out.outputs[0].finish_reason == "length"
    assert_pages_returned(llm)


def test_max_num_seqs_bounds_running_requests(qwen3_dir, reference):
    prompts, expected = reference
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", max_num_seqs=3)
    engine = llm.engine
    for p in prompts[:8]:
        engine.add_request({"prompt_token_ids": p}, GREEDY)
    results = {}
    while engine.has_unfinished():
        assert len(engine.scheduler.running) <= 3
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert [results[f"req-{i}"] for i in range(8)] == expected[:8]
    assert_pages_returned(llm)


def test_a_dropped_engine_frees_its_memory(qwen3_dir):
    """An LLM that goes out of scope gives its KV cache and weights back once collected (benchmarks and
    notebooks build several engines in one process; on a GPU a leaked one holds tens of GiB)."""
    import gc
    import weakref

    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB")
    llm.engine.runner.capture_step_graphs(2, [1], use_graphs=False)  # (graphs refer back to the runner)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY)
    cache = weakref.ref(llm.engine.runner.kv_caches[0])
    weight = weakref.ref(next(llm.engine.runner.model.parameters()))
    del llm
    gc.collect()
    assert cache() is None and weight() is None


def test_released_step_graphs_leave_the_eager_path(qwen3_dir):
    """A parallel engine drops its step graphs before it leaves its process groups (their captured
    collectives can hang the teardown): the engine still decodes, eagerly, with the same tokens."""
    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB")
    runner = llm.engine.runner
    runner.capture_step_graphs(4, [1], use_graphs=False)  # (the static-buffer path of the graphs)
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=7)]
    with_graphs = _token_ids(llm.generate(prompts, GREEDY))
    runner.release_graphs()
    assert runner.step_graphs == {}
    assert _token_ids(llm.generate(prompts, GREEDY)) == with_graphs
    assert_pages_returned(llm)


def test_a_frozen_startup_heap_leaves_collections_the_serving_objects(qwen3_dir):
    """What the server and parallel workers do once their engine is built (atlas.heap): afterwards a full
    collection traverses only the objects made since (here 200 requests added), not the start-up heap. In a
    child process, so that this one's heap is not frozen."""
    code = (
        "import gc, sys\n"
        "from atlas import LLM, SamplingParams\n"
        "from atlas.heap import freeze_startup_heap\n"
        "llm = LLM(sys.argv[1], kv_cache_memory='8MiB')\n"
        "before = len(gc.get_objects())\n"
        "frozen = freeze_startup_heap()\n"
        "params = SamplingParams(max_tokens=2)\n"
        "for i in range(200):\n"
        "    llm.engine.add_request({'prompt_token_ids': [1 + i % 300] * 40}, params)\n"
        "print(before, frozen, len(gc.get_objects()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(qwen3_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, frozen, tracked = map(int, out.stdout.split()[-3:])
    assert frozen >= 0.9 * before > 10_000
    assert tracked < 0.1 * frozen


def _big_and_newcomers(llm, prompts: list[list[int]]) -> tuple[dict[str, list[list[int]]], list[str], int]:
    """One API request of two prompts x n = 4 (one group) fills all 8 slots; then two single requests arrive.
    -> (every request's tokens, the order in which they ended, the step at which each newcomer first ran)."""
    engine = llm.engine
    big = SamplingParams(n=4, max_tokens=40, temperature=0, ignore_eos=True)
    for i in (1, 2):
        engine.add_request({"prompt_token_ids": prompts[i]}, big, f"big-{i}", group="big")
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 8  # (alone: it uses every slot)
    for i in (0, 3):
        engine.add_request({"prompt_token_ids": prompts[i]}, GREEDY, f"small-{i}")
    tokens: dict[str, list[list[int]]] = {}
    order: list[str] = []
    first_ran: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        for r in engine.scheduler.running:
            first_ran.setdefault(r.parent_id, steps)
        for out in outs:
            if out.finished and out.request_id not in tokens:
                tokens[out.request_id] = [c.token_ids for c in out.outputs]
                order.append(out.request_id)
    assert_pages_returned(llm)
    return tokens, order, max(first_ran["small-0"], first_ran["small-3"])


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_request_with_many_sequences_cannot_hold_every_slot(qwen3_dir, reference, prefix_caching):
    """Fair slots: newcomers run within a step of arriving (two of the big request's sequences are preempted and
    recomputed later) and end long before it; the outputs are the same as with the share off, where they wait
    for every sequence of the big request to end; every page comes back either way."""
    prompts, expected = reference
    shared = LLM(str(qwen3_dir), kv_cache_memory="32MiB", max_num_seqs=8, enable_prefix_caching=prefix_caching)
    assert shared.engine.scheduler.config.share == 4  # (the default: half of --max-num-seqs)
    tokens, order, first = _big_and_newcomers(shared, prompts)
    assert first == 1 and order[:2] == ["small-0", "small-3"]
    assert shared.engine.scheduler.num_preemptions == 2
    unshared = LLM(str(qwen3_dir), kv_cache_memory="32MiB", max_num_seqs=8, enable_prefix_caching=prefix_caching,
                   max_num_seqs_per_request=8)
    tokens_off, order_off, first_off = _big_and_newcomers(unshared, prompts)
    assert first_off > 30 and order_off[-2:] == ["small-0", "small-3"]  # (they waited for the big request)
    assert unshared.engine.scheduler.num_preemptions == 0
    assert shared.engine.scheduler.num_fair_row_skips > 0 and unshared.engine.scheduler.num_fair_row_skips == 0
    assert tokens == tokens_off
    assert tokens["small-0"] == [expected[0]] and tokens["small-3"] == [expected[3]]


@pytest.mark.parametrize("speculative", ["ngram", "dflash"])
def test_fair_rows_with_drafts_give_the_plain_tokens(qwen3_dir, reference, speculative):
    """Fair rows skip some of the big request's sequences while the newcomers run; with drafts in flight (n-gram on
    the test model; the shipped model with its DFlash drafter) every sequence's greedy tokens are still those of
    plain decoding with the share off, and every page comes back."""
    if speculative == "ngram":
        path, prompts = str(qwen3_dir), reference[0]
    else:
        path = str(Path(__file__).resolve().parents[1] / "atlas" / "assets" / "default-model")
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(1, 8000, (n,), generator=g).tolist() for n in (9, 30, 17, 12)]
    plain = LLM(path, kv_cache_memory="32MiB", max_num_seqs=8, max_num_seqs_per_request=8)
    tokens_plain, _, _ = _big_and_newcomers(plain, prompts)
    spec = LLM(path, kv_cache_memory="32MiB", max_num_seqs=8, speculative=speculative, speculative_policy="always")
    tokens, _, first = _big_and_newcomers(spec, prompts)
    assert first == 1 and tokens == tokens_plain
    assert spec.engine.scheduler.num_fair_row_skips > 0 and plain.engine.scheduler.num_fair_row_skips == 0
    assert spec.engine.stats.spec_num_drafted_steps > 0
