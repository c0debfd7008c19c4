"""KV cache groups (engine/kv_groups.py): models whose sliding-window layers sit beside global ones (Gemma 3, gpt-oss,
Gemma 4, a windowed Qwen3) keep the windowed layers' KV in a page pool of their own, released out of the window. The
page manager's two groups in lockstep (prefix hits cut back to what both still hold); whole engines against
transformers with a long generation's window pages bounded, prefix caching on and off, preemption, n-gram
speculation, a drafter with its own cache, a DFlash block queued behind each verify step, the CUDA graphs' static
inputs, pipeline and tensor parallelism; the memory plan's split; the same engines with the groups turned off; and
on a GPU (marked cuda) the Triton path in captured graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    CUDA_KV,
    assert_pages_returned,
    build_checkpoint,
    build_gemma3_checkpoint,
    build_gemma4_checkpoint,
    hf_greedy,
    hf_model,
)
from test_gpt_oss import build_gpt_oss_checkpoint

from atlas import LLM, SamplingParams
from atlas.engine.kv_cache import NULL_PAGE, KVCacheManager
from atlas.engine.kv_groups import GroupedKVCacheManager
from atlas.engine.request import Request
from atlas.runtime import memory

BS = 4
WINDOWS = {"gemma3": 12, "gpt_oss": 8, "gemma4": 6, "qwen3": 8}  # (the tiny checkpoints' local windows)
KINDS = ["gemma3", "gpt_oss", "gemma4"]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, rid, 0, None, tokens, SamplingParams(), [])


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _logprobs(outs) -> list[list[float]]:
    """Each sequence's log-probability of each of its tokens (requests made with logprobs=0)."""
    return [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
            for o in outs]


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probabilities of `tokens` after `prompt`, teacher-forced. (Greedy tokens alone can miss a
    wrong windowed layer: a tiny model's argmax may not move.)"""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


# ---------------------------------------------------------------------------------------------- page manager

def test_both_groups_allocate_in_lockstep_and_only_the_window_group_releases():
    kv = GroupedKVCacheManager(num_pages=20, block_size=4, enable_prefix_caching=True, window=6, num_window_pages=6)
    req = _request("a", list(range(100, 130)))  # 30 tokens
    assert kv.allocate(req, 8)
    table = req.window_table
    assert len(req.page_ids) == len(table.page_ids) == 2
    req.num_computed_tokens = 8
    assert kv.allocate(req, 4) and len(table.page_ids) == 3
    req.num_computed_tokens = 12  # its next query is position 12: it sees keys 7..12
    assert kv.release_out_of_window(req) == 1  # (page 0: positions 0..3)
    assert table.page_ids[0] == NULL_PAGE and kv.held_window_pages(req) == 2
    assert kv.held_pages(req) == 3  # (the full group keeps every page)
    # The window pool is the one that runs short here (6 pages): nothing is given, in either group.
    free_full = kv.num_free_pages
    assert not kv.allocate(req, 18)
    assert kv.num_free_pages == free_full and len(table.page_ids) == 3 and len(req.page_ids) == 3
    kv.trim(req, 9)
    assert len(req.page_ids) == len(table.page_ids) == 3
    kv.free(req)
    assert kv.num_free_pages == 20 and kv.window.num_free_pages == 6
    assert all(c == 0 for c in kv.window.pool.ref_cnt)


def test_reset_forgets_both_groups_cached_prefixes_once_no_page_is_held():
    kv = GroupedKVCacheManager(num_pages=20, block_size=4, enable_prefix_caching=True, window=6, num_window_pages=10)
    req = _request("a", list(range(100, 110)))
    assert kv.allocate(req, 10)
    req.num_computed_tokens = 10
    kv.cache_computed_pages(req)
    assert kv.pool.cached and kv.window.pool.cached
    assert not kv.reset_prefix_cache() and kv.pool.cached and kv.window.pool.cached  # (held: nothing forgotten)
    kv.free(req)
    assert kv.find_cached_prefix(_request("b", list(range(100, 109))))
    assert kv.reset_prefix_cache()
    assert not kv.pool.cached and not kv.window.pool.cached
    assert kv.find_cached_prefix(_request("c", list(range(100, 109)))) == []


def test_a_prefix_hit_needs_the_window_groups_pages_the_next_query_reads():
    """A hit of k pages needs the full group's pages 0..k-1 and the window group's for positions k*4 - 5 .. k*4 - 1;
    with the last of those evicted from the window pool, the hit is cut back to where both are cached."""
    kv = GroupedKVCacheManager(num_pages=20, block_size=4, enable_prefix_caching=True, window=6, num_window_pages=12)
    tokens = list(range(100, 130))
    first = _request("a", tokens)
    assert kv.allocate(first, 30)
    first.num_computed_tokens = 30
    kv.cache_computed_pages(first)
    kv.free(first)
    assert len(kv.find_cached_prefix(_request("b", tokens))) == 7  # (29 tokens at most)
    # Evict the window pool's copy of page 6 (free pages are reused from the chain's tail first): a hit of 7 pages
    # can no longer resume, one of 6 still can (the window of position 24 reaches 19: pages 4 and 5).
    pool, hashes = kv.window.pool, first.page_hashes
    while pool.lookup(hashes[6]) is not None:
        pool.allocate(1)
    assert pool.lookup(hashes[4]) is not None and pool.lookup(hashes[5]) is not None
    again = _request("c", tokens)
    hit = kv.find_cached_prefix(again)
    assert len(hit) == 6
    assert kv.allocate(again, 6, hit)
    assert again.num_computed_tokens == 24
    # (window pages 4 and 5 are the hit's; the ones below the window are never read again)
    assert again.window_table.page_ids[:4] == [NULL_PAGE] * 4 and again.window_table.num_released_pages == 4
    assert again.window_table.page_ids[4:6] == [pool.lookup(hashes[4]), pool.lookup(hashes[5])]
    assert len(again.window_table.page_ids) == len(again.page_ids) == 8
    kv.free(again)
    while pool.num_free:  # (every window page taken: no hit at all)
        pool.allocate(1)
    assert kv.find_cached_prefix(_request("d", tokens)) == []
    # (the full group alone still holds the whole prefix: its own lookup, KVCacheManager's)
    assert len(KVCacheManager.find_cached_prefix(kv, _request("e", tokens))) == 7


def test_a_sibling_shares_both_groups_prompt_pages_until_one_is_released():
    kv = GroupedKVCacheManager(num_pages=20, block_size=4, enable_prefix_caching=False, window=6, num_window_pages=12)
    src = _request("a", list(range(16)))
    assert kv.allocate(src, 16)
    src.num_computed_tokens = 16
    dst = _request("b", list(range(16)))
    kv.share_prefix(src, dst, 15)
    assert dst.page_ids == src.page_ids[:3] and dst.window_table.page_ids == src.window_table.page_ids[:3]
    assert dst.num_computed_tokens == 12
    late = _request("c", list(range(16)))
    assert kv.release_out_of_window(src) == 2  # (window pages 0, 1: positions 0..7, below 16 - 6 + 1)
    kv.share_prefix(src, late, 15)
    assert late.page_ids == [] and late.num_computed_tokens == 0  # (it computes its prompt itself)
    for r in (src, dst, late):
        kv.free(r)
    assert kv.num_free_pages == 20 and kv.window.num_free_pages == 12


# ---------------------------------------------------------------------------------------------- engines

@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    """{"gemma3": local window 12 + a global layer, "gpt_oss": alternating window 8 and full layers, "gemma4": local
    window 6 + global layers of another head size, "qwen3": alternating window 8 and full layers (the Llama family's
    attention)} -> (checkpoint, transformers model)."""
    root = tmp_path_factory.mktemp("kv-groups")
    paths = {"gemma3": build_gemma3_checkpoint(root, tokenizer_dir, seed=3),
             # (the published clamp, 7.0: transformers before 5.2x, the GPU machine's reference, ignores the config's)
             "gpt_oss": build_gpt_oss_checkpoint(root, tokenizer_dir, seed=4, swiglu_limit=7.0),
             "gemma4": build_gemma4_checkpoint(root, seed=5),
             "qwen3": build_checkpoint(root, "Qwen3ForCausalLM", None, seed=6, num_hidden_layers=4,
                                       use_sliding_window=True, sliding_window=8, max_window_layers=0,
                                       layer_types=["sliding_attention", "full_attention"] * 2)}
    return {kind: (path, hf_model(path)) for kind, path in paths.items()}


def _held_while_generating(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], list[float], int, int]:
    """(the output tokens, their log-probabilities, the most window-group pages held at any step once the prompt is
    computed, the most full-group pages held at any step) of one greedy request."""
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                                    logprobs=0))
    most_window = most_full = 0
    tokens = logprobs = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
                logprobs = _logprobs([out])[0]
        window = engine.kv.window
        if all(r.num_output_tokens for r in engine.scheduler.running):  # (a prompt chunk holds its own pages)
            most_window = max(most_window, window.num_pages - window.num_free_pages)
        most_full = max(most_full, engine.kv.num_pages - engine.kv.num_free_pages)
    return tokens, logprobs, most_window, most_full


@pytest.mark.parametrize("kind", [*KINDS, "qwen3"])
def test_a_long_generation_holds_a_bounded_number_of_window_pages(kind, models):
    """160 tokens past a 20-token prompt (many windows) in pages of 4: the windowed layers hold at most the window's
    pages, a partial one and one ahead once the prompt is computed, while the global layers hold the whole
    sequence; the tokens those of transformers, and every page of both pools back at the end."""
    path, model = models[kind]
    window = WINDOWS[kind]
    prompt = list(range(40, 60))
    llm = LLM(str(path), kv_cache_memory="1MiB", block_size=BS, max_model_len=256, enable_prefix_caching=False,
              skip_tokenizer_init=True)
    assert isinstance(llm.engine.kv, GroupedKVCacheManager) and llm.engine.kv.group_window == window
    tokens, logprobs, most_window, most_full = _held_while_generating(llm, prompt, 160)
    assert most_window <= -(-(window - 1) // BS) + 2, most_window
    assert most_full == -(-(20 + 160 - 1) // BS), most_full
    assert tokens == hf_greedy(model, prompt, 160)
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(_hf_logprobs(model, prompt, tokens)),
                               rtol=1e-4, atol=1e-3)
    assert_pages_returned(llm)


def test_the_metrics_show_both_pools_and_the_fuller_ones_usage(models):
    """/metrics of a model with a window pool, scraped through the engine's own collector while a request runs:
    the window pool's pages beside the global pool's, and the usage gauge the fuller pool's share (a request needs
    pages of both, so that one admits or preempts)."""
    from atlas.engine.metrics import EngineMetrics

    path, _ = models["gemma3"]
    llm = LLM(str(path), kv_cache_memory="1MiB", block_size=BS, max_model_len=256, enable_prefix_caching=False,
              skip_tokenizer_init=True)
    engine, registry = llm.engine, EngineMetrics(llm.engine, "m", lambda: 0).registry
    kv = engine.kv
    engine.add_request({"prompt_token_ids": list(range(40, 100))}, SamplingParams(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True))
    engine.step()
    value = lambda name: registry.get_sample_value(name, {"model_name": "m"})  # noqa: E731
    window_used = 1 - kv.window.num_free_pages / kv.window.num_pages
    full_used = 1 - kv.num_free_pages / kv.num_pages
    assert value("atlas_kv_cache_window_pages_total") == kv.window.num_pages
    assert value("atlas_kv_cache_window_pages_free") == kv.window.num_free_pages < kv.window.num_pages
    assert value("atlas_kv_cache_pages_free") == kv.num_free_pages < kv.num_pages
    assert value("atlas_kv_cache_usage_ratio") == value("vllm:kv_cache_usage_perc") == max(window_used, full_used) > 0
    while engine.has_unfinished():
        engine.step()
    assert value("atlas_kv_cache_window_pages_free") == kv.window.num_pages
    assert_pages_returned(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_without_groups_the_windowed_layers_keep_every_page(kind, models):
    """--tuning kv_cache_groups=0: one page table for every layer, nothing released, the same tokens."""
    path, _ = models[kind]
    prompt = list(range(40, 60))
    kw = dict(kv_cache_memory="1MiB", block_size=BS, max_model_len=256, enable_prefix_caching=False,
              skip_tokenizer_init=True)
    plain = LLM(str(path), tuning={"kv_cache_groups": "0"}, **kw)
    assert not isinstance(plain.engine.kv, GroupedKVCacheManager)
    grouped = LLM(str(path), **kw)
    want = _tokens(plain.generate({"prompt_token_ids": prompt}, _greedy(60)))
    assert _tokens(grouped.generate({"prompt_token_ids": prompt}, _greedy(60))) == want
    assert_pages_returned(plain)
    assert_pages_returned(grouped)


PROMPTS = [list(range(5, 10)), [(7 * i) % 380 + 1 for i in range(37)], list(range(200, 220)),
           [(11 * i) % 383 + 1 for i in range(50)], list(range(300, 331)), [(13 * i) % 381 + 2 for i in range(44)]]


@pytest.fixture(scope="module")
def expected(models):
    return {kind: [hf_greedy(model, p, 30) for p in PROMPTS] for kind, (_, model) in models.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_chunked_prefill_and_preemption_equal_transformers(kind, models, expected):
    """Six requests at once, a full pool too small for them (preemption), a 20-token budget (prefill chunks that
    start and end across window boundaries, beside decodes), 30 tokens each: transformers' tokens."""
    path, _ = models[kind]
    llm = LLM(str(path), num_gpu_blocks_override=24, block_size=BS, max_num_batched_tokens=20, max_num_seqs=6,
              max_model_len=96, skip_tokenizer_init=True)
    assert isinstance(llm.engine.kv, GroupedKVCacheManager)
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(30)))
    assert got == expected[kind]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss"])
def test_steps_through_the_cuda_graphs_static_inputs_equal_transformers(kind, models, expected):
    """Decode and mixed steps through the CUDA graphs' static buffers (uncaptured on a CPU: --tuning
    static_steps=1), whose attention inputs carry the window group's slots and page tables, padded rows and
    sequences in its scratch pages: transformers' tokens."""
    path, _ = models[kind]
    kw = dict(num_gpu_blocks_override=64, block_size=BS, max_num_batched_tokens=20, max_num_seqs=6, max_model_len=96,
              skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), tuning={"static_steps": "1"}, **kw)
    runner = llm.engine.runner
    assert runner.caches.window_scratch_pages == [llm.engine.kv.window.num_pages]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert _tokens(outs) == expected[kind]
    assert runner.step_graphs[1].steps_run > 0 and runner.mixed_graphs.steps_run > 0
    assert_pages_returned(llm)
    eager = LLM(str(path), **kw).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    torch.testing.assert_close(torch.tensor(_logprobs(outs)), torch.tensor(_logprobs(eager)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_caching_on_equals_off_with_prefixes_longer_than_the_window(kind, models):
    """A prompt again (its prefix spans several windows), one sharing its first 30 tokens, then a sibling pair
    (n = 2): the same tokens with the prefix cache and without, hits served from both groups."""
    path, _ = models[kind]
    prompts = [PROMPTS[3], PROMPTS[3], PROMPTS[3][:30] + [9, 8, 7], PROMPTS[5]]
    runs = {}
    for caching in (True, False):
        llm = LLM(str(path), kv_cache_memory="1MiB", block_size=BS, max_model_len=128, enable_prefix_caching=caching,
                  skip_tokenizer_init=True)
        runs[caching] = [llm.generate({"prompt_token_ids": p}, _greedy(40))[0].outputs[0].token_ids for p in prompts]
        pair = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(n=2, max_tokens=40, temperature=0,
                                                                           ignore_eos=True))[0]
        runs[caching].extend(o.token_ids for o in pair.outputs)
        assert_pages_returned(llm)
        if caching:
            # (the whole repeated prompt but its last page; the 7 full pages of the shared 30 tokens)
            assert llm.engine.kv.stats.hits >= 48 + 28, llm.engine.kv.stats.hits
    assert runs[True] == runs[False]
    assert runs[True][-1] == runs[True][-2]


@pytest.mark.parametrize("kind", KINDS)
def test_ngram_speculation_equals_plain_greedy(kind, models):
    path, _ = models[kind]
    prompts = [[3, 4, 5, 6] * 8, [9, 10, 11] * 7 + [12], PROMPTS[1]]
    kw = dict(kv_cache_memory="1MiB", block_size=BS, max_model_len=128, skip_tokenizer_init=True)
    plain = LLM(str(path), **kw)
    spec = LLM(str(path), speculative="ngram", speculative_policy="always", num_draft_tokens=4, ngram_min=1,
               ngram_max=3, **kw)
    assert isinstance(spec.engine.kv, GroupedKVCacheManager)
    want = _tokens(plain.generate([{"prompt_token_ids": p} for p in prompts], _greedy(64)))
    assert _tokens(spec.generate([{"prompt_token_ids": p} for p in prompts], _greedy(64))) == want
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(spec)


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss"])
def test_a_drafter_with_its_own_cache_follows_the_global_layers_pages(kind, models, expected):
    """The model drafting for itself (--speculative draft_model): the drafter's cache is addressed by the global
    layers' page ids, every one kept, and its forward reads one table for all its layers; greedy tokens those of
    transformers under preemption and chunked prefill, nearly every draft accepted."""
    path, _ = models[kind]
    llm = LLM(str(path), speculative="draft_model", draft_model=str(path), speculative_policy="always",
              num_draft_tokens=3, num_gpu_blocks_override=40, block_size=BS, max_num_batched_tokens=20,
              max_num_seqs=6, max_model_len=96, skip_tokenizer_init=True)
    assert isinstance(llm.engine.kv, GroupedKVCacheManager)
    assert _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(30))) == expected[kind]
    stats = llm.engine.stats
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


def test_a_drafter_block_queued_behind_each_verify_step(models, expected, tmp_path):
    """DFlash's block queued behind each verify step (its ids, positions, full-group slots and lengths on the
    device) on a model with KV cache groups, through the static buffers CUDA graphs replay (eagerly on a CPU): the
    verify step after it gets the window group's page tables and slots too, the same numbers as a step prepared the
    usual way, and greedy tokens equal transformers'."""
    from test_dflash import _through_static_buffers, write_drafter

    from atlas.runtime.request_tables import snapshot_batch
    from atlas.runtime.step_inputs import InputPreparer

    path = models["qwen3"][0]
    drafter = write_drafter(tmp_path / "drafter", hidden=64, layer_ids=[1, 3], mask_token_id=383, block_size=4)
    llm = _through_static_buffers(LLM(str(path), skip_tokenizer_init=True, speculative="dflash",
                                      speculative_policy="always", draft_model=str(drafter), block_size=8,
                                      max_num_seqs=6, max_model_len=160, num_gpu_blocks_override=64), 6)
    assert isinstance(llm.engine.kv, GroupedKVCacheManager) and llm.engine.proposer.drafts_after_verify
    runner = llm.engine.runner
    compared = []

    def both_ways(batch, following, requests):
        preparer = runner.inputs
        usual = preparer.prepare(batch)  # (first: both fill the same reused buffers)
        usual = (usual.meta.windowed.page_tables.clone(), usual.meta.windowed.slot_mapping.clone(),
                 usual.meta.slot_mapping.clone(), usual.positions.clone())
        fast = InputPreparer.prepare_behind(preparer, batch, following, requests)
        if fast is None:
            return None
        width = usual[0].shape[1]
        assert torch.equal(fast.meta.windowed.page_tables[:, :width], usual[0])
        assert torch.equal(fast.meta.windowed.slot_mapping, usual[1])
        assert torch.equal(fast.meta.slot_mapping, usual[2]) and torch.equal(fast.positions, usual[3])
        compared.append(len(batch.seqs))
        return fast

    runner.prepare_inputs(snapshot_batch([], []))  # (makes the preparer)
    runner.inputs.prepare_behind = both_ways
    assert _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(30))) == expected["qwen3"]
    assert compared and runner.steps_behind == len(compared) and max(compared) > 1
    assert_pages_returned(llm)


@pytest.mark.parametrize(("kind", "parallel"), [
    ("gemma3", dict(pipeline_parallel_size=2, tuning={"static_steps": "1"})),
    ("gpt_oss", dict(tensor_parallel_size=2)),
    ("gpt_oss", dict(pipeline_parallel_size=2))])
def test_pipeline_and_tensor_parallel_match_one_device(kind, parallel, models):
    """Gemma 3 on two pipeline stages (the first holds both local layers, the second the global one; decode steps
    on its CUDA graphs' static buffers, uncaptured on a CPU), gpt-oss on two tensor-parallel ranks and on two
    pipeline stages (its loader took the model's dtype from the embedding, which the second stage does not hold), on
    gloo:
    tests/test_parallel.py's comparison with one device (logprobs, greedy tokens with preemption and prefix hits,
    seeded samples, n-gram drafts)."""
    from test_parallel import ENGINE, PARALLEL, check_against_one_device

    path = models[kind][0]
    llm = LLM(str(path), **parallel, **ENGINE, **PARALLEL)
    try:
        assert isinstance(llm.engine.kv, GroupedKVCacheManager)
        check_against_one_device(llm, {kind: path}, kind)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------------------------- memory plan

def test_the_memory_plan_gives_the_global_layers_the_pages_the_window_pool_leaves(models):
    """Gemma 3's tiny shape (two local layers of window 12, one global; float32; pages of 4) in 1 MiB: the window
    pool holds the windows of as many --max-model-len sequences as fit beside their global pages, the global
    layers the rest; that is more tokens of context than one table for every layer holds, by the arithmetic."""
    path, _ = models["gemma3"]
    budget, max_len, seqs, step_tokens = 1 << 20, 128, 8, 32
    kw = dict(kv_cache_memory="1MiB", block_size=BS, max_model_len=max_len, max_num_seqs=seqs,
              max_num_batched_tokens=step_tokens, skip_tokenizer_init=True)
    grouped = LLM(str(path), **kw).engine.plan
    plain = LLM(str(path), tuning={"kv_cache_groups": "0"}, **kw).engine.plan
    layer_page = 2 * 2 * 16 * 4 * BS  # (K and V, two KV heads of 16, float32, a page of 4)
    assert plain.page_bytes == 3 * layer_page and plain.num_pages == budget // (3 * layer_page)
    assert grouped.page_bytes == layer_page and grouped.window_page_bytes == 2 * layer_page
    per_seq = -(-(12 - 1) // BS) + 2  # (window pages a running sequence holds)
    step = 2 * step_tokens // BS  # (the tokens of a step in flight and of the one being scheduled)
    fit = (budget - step * 2 * layer_page) // (max_len // BS * layer_page + per_seq * 2 * layer_page)
    window_pages = min(seqs, fit) * per_seq + step
    assert grouped.window_pages == window_pages
    assert grouped.num_pages == (budget - window_pages * 2 * layer_page) // layer_page
    assert grouped.token_capacity > 2 * plain.token_capacity
    assert grouped.kv_bytes <= budget


def test_split_never_leaves_the_window_pool_without_one_sequence():
    shape = memory.window_pool_shape(window=1024, block_size=16, step_tokens=8192, lookahead=0, steps_in_flight=1)
    assert shape.per_seq_pages == 64 + 2 and shape.step_pages == 2 * 512
    # Gemma-3-12B's shape at 8k context: 8 global layers' pages of 16 tokens (8 KV heads of 256, bf16), 40 local.
    page = 8 * 2 * 8 * 256 * 2 * 16
    window_page = 5 * page
    kv = 80 << 30
    full, window = memory.split_kv_groups(kv, page, window_page, shape, seq_pages=512, max_num_seqs=256)
    seqs = (window - shape.step_pages) // shape.per_seq_pages
    assert full >= seqs * 512 and full * page + window * window_page <= kv
    # Against one table for every layer: more than three times the 8k sequences in the same bytes.
    assert seqs > 3 * (kv // (6 * page * 512))


# ---------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_on_cuda_the_triton_path_and_graphs_equal_transformers(kind, models, no_tf32):
    """On a GPU in float32: the Triton attention kernels and the fused K/V writes through the window group's page
    tables and slots, in captured CUDA graphs (decode and mixed steps; Gemma 4 runs eagerly: its layers pack heads
    differently; gpt-oss in float32 too), a batch with chunked prefill across window boundaries and a long generation: transformers' greedy
    tokens, bounded window pages, prefix caching on equal to off."""
    path, _ = models[kind]
    ref = hf_model(path, device="cuda")
    # (a fixed KV size: a share of the GPU counts the other test workers' memory against it)
    kw = dict(dtype="float32", device="cuda", kv_cache_memory="64MiB", block_size=BS, max_model_len=256,
              max_num_batched_tokens=32, max_num_seqs=8, skip_tokenizer_init=True)
    llm = LLM(str(path), **kw)
    assert isinstance(llm.engine.kv, GroupedKVCacheManager)
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(40)))
    assert got == [hf_greedy(ref, p, 40) for p in PROMPTS]
    if kind == "gemma3":  # (gpt-oss in float32 runs eagerly too: its experts' grouped_mm takes bf16 on sm90+)
        assert llm.engine.runner.step_graphs[1].steps_run > 0
    tokens, _, most_window, _ = _held_while_generating(llm, list(range(40, 60)), 200)
    assert most_window <= -(-(WINDOWS[kind] - 1) // BS) + 2, most_window
    assert tokens == hf_greedy(ref, list(range(40, 60)), 200)
    assert_pages_returned(llm)
    prompts = [PROMPTS[3], PROMPTS[3], PROMPTS[3][:30] + [9, 8, 7]]
    off = LLM(str(path), enable_prefix_caching=False, **kw)
    want = [off.generate({"prompt_token_ids": p}, _greedy(40))[0].outputs[0].token_ids for p in prompts]
    assert [llm.generate({"prompt_token_ids": p}, _greedy(40))[0].outputs[0].token_ids for p in prompts] == want
    assert llm.engine.kv.stats.hits > 0
    assert_pages_returned(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_dflash_block_behind_each_verify_step_equals_transformers(models, tmp_path, no_tf32):
    """On a GPU in float32, captured graphs: DFlash's block replayed behind each verify step of a model with KV
    cache groups, the verify step after it taking the window group's tables and slots: transformers' greedy
    tokens."""
    from test_dflash import write_drafter

    path, _ = models["qwen3"]
    ref = hf_model(path, device="cuda")
    drafter = write_drafter(tmp_path / "drafter", hidden=64, layer_ids=[1, 3], mask_token_id=383, block_size=4)
    llm = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory=CUDA_KV, skip_tokenizer_init=True,
              speculative="dflash", speculative_policy="always", draft_model=str(drafter), block_size=8,
              max_num_seqs=6, max_model_len=160)
    assert isinstance(llm.engine.kv, GroupedKVCacheManager) and llm.engine.proposer.drafts_after_verify
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(30)))
    assert got == [hf_greedy(ref, p, 30) for p in PROMPTS]
    assert llm.engine.runner.steps_behind > 0
    assert_pages_returned(llm)


def test_kv_cache_memory_on_a_gpu_sizes_the_pool_exactly_and_refuses_what_does_not_fit():
    """--kv-cache-memory on CUDA (memory.plan_cuda_kv_bytes; it was ignored there): the pool is that size, a hybrid
    model's recurrent state taken from it first, whatever --gpu-memory-utilization says; a size that does not fit
    beside the weights, activations and other buffers in what was free is refused, naming the flag."""
    from atlas.errors import OutOfMemoryPlanError

    page = 4096
    plan = memory.plan_cuda_kv_bytes(page, 16, 1 << 20, free_at_start=8 << 20, weights=2 << 20,
                                     activation_peak=1 << 20, non_torch=1 << 20, extra={"cuda graphs": 1 << 20})
    assert plan.num_pages == 256 and plan.source == "--kv-cache-memory 1.0 MiB"
    assert plan.breakdown["budget"] == 6 << 20
    hybrid = memory.plan_cuda_kv_bytes(page, 16, 1 << 20, 8 << 20, 0, 0, 0, {"recurrent state": 256 << 10})
    assert hybrid.num_pages == 192 and hybrid.breakdown["recurrent state"] == 256 << 10
    with pytest.raises(OutOfMemoryPlanError, match="--kv-cache-memory 3.0 MiB does not fit"):
        memory.plan_cuda_kv_bytes(page, 16, 3 << 20, 7 << 20, 2 << 20, 1 << 20, 1 << 20, {"cuda graphs": 1 << 20})
    with pytest.raises(OutOfMemoryPlanError, match="recurrent state"):
        memory.plan_cuda_kv_bytes(page, 16, 1 << 20, 8 << 20, 0, 0, 0, {"recurrent state": 2 << 20})
