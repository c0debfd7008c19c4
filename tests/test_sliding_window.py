"""Sliding-window attention: the reference kernel against dense masked attention, the Triton kernel over page
tables whose out-of-window pages were released (Triton's interpreter), the page manager's release and its
prefix cache, and whole engines (a tiny all-windowed Mistral, whose pages are released, and a tiny Gemma 3, whose
global layers keep them while its local layers' own pool releases theirs) against transformers: mixed batches, chunked prefill across window boundaries,
preemption, prefix caching on and off, n-gram speculation, and the bounded pages of a long generation."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_pages_returned,
    build_checkpoint,
    build_gemma3_checkpoint,
    hf_greedy,
    hf_model,
    run_in_triton_interpreter,
)

from atlas import LLM, SamplingParams
from atlas.engine.kv_cache import NULL_PAGE, KVCacheManager
from atlas.engine.request import Request
from atlas.kernels.paged_attention_ref import paged_attention_ref

WINDOW = 16  # the Mistral's (Gemma's local layers: 12)
BS = 4


# ---------------------------------------------------------------------------------------------- kernels

def _dense_window_attention(q, kv, qsl, seq_lens, tables, scale, window):
    """Attention of each query row over its request's keys k with q_pos - window < k <= q_pos, written out."""
    page = kv.shape[2]
    group = q.shape[1] // kv.shape[3]
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        slots = tables[b, pos // page].long() * page + pos % page
        k = kv[0].reshape(-1, *kv.shape[3:])[slots].repeat_interleave(group, dim=1)  # [K, Hq, D]
        v = kv[1].reshape(-1, *kv.shape[3:])[slots].repeat_interleave(group, dim=1)
        rows = range(qsl[b], qsl[b + 1])
        for i, t in enumerate(rows):
            q_pos = seq_len - len(rows) + i
            seen = (pos <= q_pos) & (pos > q_pos - window)
            scores = torch.einsum("hd,khd->hk", q[t], k) * scale
            scores = scores.masked_fill(~seen[None, :], float("-inf"))
            out[t] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("window", [1, 5, 16, 200])
def test_reference_window_equals_dense_masked_attention(window):
    """Decodes, verify-sized rows and prefill chunks over cached prefixes, GQA, one batch; window 1 (each row
    sees itself only) to one longer than every sequence."""
    g = torch.Generator().manual_seed(window)
    page, kv_heads, group, dim = 4, 2, 3, 8
    q_lens, seq_lens = [1, 1, 4, 37, 50], [30, 3, 22, 60, 50]
    tables = torch.zeros(len(seq_lens), 16, dtype=torch.int32)
    perm = torch.randperm(80, generator=g)
    used = 0
    for b, n in enumerate(seq_lens):
        pages = -(-n // page)
        tables[b, :pages] = perm[used: used + pages].int()
        used += pages
    kv = torch.randn(2, 80, page, kv_heads, dim, generator=g)
    q = torch.randn(sum(q_lens), kv_heads * group, dim, generator=g)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    got = paged_attention_ref(q, kv, qsl, seq_lens, tables, dim ** -0.5, True, window)
    expected = _dense_window_attention(q, kv, qsl, seq_lens, tables, dim ** -0.5, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_triton_kernel_never_reads_released_pages_in_the_interpreter():
    """Pages wholly below the window swapped for NaN pages: the Triton kernel (unsplit steps, split-KV decodes, an
    8-bit cache) and the reference still give the reference's output over the intact pages."""
    pytest.importorskip("triton")
    out = run_in_triton_interpreter("sliding_window_cases.py", "3", "2", "1", timeout=300)
    assert "6 released-page cases agree" in out


# ---------------------------------------------------------------------------------------------- page manager

def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, rid, 0, None, tokens, SamplingParams(), [])


def test_pages_out_of_the_window_go_back_and_stay_cached_prefixes():
    kv = KVCacheManager(num_pages=12, block_size=4, enable_prefix_caching=True, sliding_window=6)
    req = _request("a", list(range(100, 130)))  # 30 tokens
    assert kv.allocate(req, 30)
    assert kv.num_free_pages == 12 - 8
    req.num_computed_tokens = 29  # its next query row is position 29: it sees keys 24..29
    assert kv.release_out_of_window(req) == 6  # pages 0..5 hold positions 0..23
    assert req.page_ids[:6] == [NULL_PAGE] * 6 and req.num_released_pages == 6
    assert kv.held_pages(req) == 2 and kv.num_free_pages == 12 - 2
    assert kv.release_out_of_window(req) == 0
    kv.trim(req, 0)  # (a trim never reaches into the released pages)
    assert req.num_released_pages == 6 and len(req.page_ids) == 6
    kv.free(req)
    assert kv.num_free_pages == 12 and all(c == 0 for c in kv.pool.ref_cnt)
    # Registered before their release: a later request with the same tokens finds the whole prefix...
    again = _request("b", list(range(100, 130)))
    hit = kv.find_cached_prefix(again)
    assert len(hit) == 7  # (29 tokens at most: 7 full pages)
    # ... and only the part of it still cached once a page of the chain is reused.
    kv.pool.allocate(kv.num_free_pages)
    assert kv.find_cached_prefix(_request("c", list(range(100, 130)))) == []


def test_without_a_window_nothing_is_released():
    kv = KVCacheManager(num_pages=8, block_size=4, enable_prefix_caching=False, sliding_window=None)
    req = _request("a", list(range(20)))
    assert kv.allocate(req, 20)
    req.num_computed_tokens = 20
    assert kv.release_out_of_window(req) == 0 and kv.held_pages(req) == 5


def test_window_rules_of_the_llama_family():
    """Mistral: every layer; Qwen2 / Qwen3: with use_sliding_window only, from max_window_layers on (or by
    layer_types); Llama: never (transformers' Llama reads no sliding_window)."""
    from pathlib import Path

    from atlas.config import ModelConfig
    from atlas.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    def windows(cls, arch, **fields):
        raw = dict(architectures=[arch], vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
                   intermediate_size=8, **fields)
        return cls.variant(ModelConfig.from_dict(raw, Path("/x"))).sliding_windows

    assert windows(MistralForCausalLM, "MistralForCausalLM", sliding_window=8) == [8] * 4
    assert windows(MistralForCausalLM, "MistralForCausalLM", sliding_window=None) == [None] * 4
    assert windows(Qwen2ForCausalLM, "Qwen2ForCausalLM", sliding_window=8) == [None] * 4
    assert windows(Qwen2ForCausalLM, "Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True,
                   max_window_layers=2) == [None, None, 8, 8]
    assert windows(Qwen3ForCausalLM, "Qwen3ForCausalLM", sliding_window=8, use_sliding_window=True,
                   layer_types=["sliding_attention", "full_attention"] * 2) == [8, None, 8, None]
    assert windows(LlamaForCausalLM, "LlamaForCausalLM", sliding_window=8,
                   layer_types=["sliding_attention"] * 4) == [None] * 4


# ---------------------------------------------------------------------------------------------- engines

@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tokenizer_dir):
    """{"mistral": an all-windowed Mistral (window 16, pages released), "gemma3": local window 12 + a global layer
    (pages kept)} -> (checkpoint, transformers model)."""
    root = tmp_path_factory.mktemp("windowed")
    paths = {"mistral": build_checkpoint(root, "MistralForCausalLM", tokenizer_dir, seed=3, sliding_window=WINDOW),
             "gemma3": build_gemma3_checkpoint(root, tokenizer_dir, seed=3)}
    return {kind: (path, hf_model(path)) for kind, path in paths.items()}


KINDS = ["mistral", "gemma3"]
PROMPTS = [list(range(5, 10)), [(7 * i) % 380 + 1 for i in range(37)], list(range(200, 220)),
           [(11 * i) % 383 + 1 for i in range(50)], list(range(300, 331)), [(13 * i) % 381 + 2 for i in range(44)],
           [17, 4] * 9, list(range(60, 102))]
MAX_TOKENS = 40  # (prompt + output up to 90 positions: several windows)


@pytest.fixture(scope="module")
def expected(windowed):
    return {kind: [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS] for kind, (_, model) in windowed.items()}


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_chunked_prefill_preemption_equal_transformers(kind, windowed, expected):
    """Eight requests at once in a pool too small for them (24 pages of 4: preemption, also with pages released),
    a 24-token budget (prefill chunks that start and end across window boundaries, beside decodes)."""
    llm = LLM(str(windowed[kind][0]), num_gpu_blocks_override=24, block_size=BS, max_num_batched_tokens=24,
              max_num_seqs=8, max_model_len=96)
    assert llm.engine.kv.sliding_window == (WINDOW if kind == "mistral" else None)
    assert _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy())) == expected[kind]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_caching_on_equals_off(kind, windowed, expected):
    """The same prompts again and prompts sharing a prefix with them, with the prefix cache and without: the
    same tokens (and the cache serves hits, released pages included)."""
    prompts = [PROMPTS[3], PROMPTS[3], PROMPTS[3][:30] + [9, 8, 7], PROMPTS[1]]
    runs = {}
    for caching in (True, False):
        llm = LLM(str(windowed[kind][0]), kv_cache_memory="1MiB", block_size=BS, max_model_len=128,
                  enable_prefix_caching=caching)
        runs[caching] = [llm.generate({"prompt_token_ids": p}, _greedy())[0].outputs[0].token_ids for p in prompts]
        assert_pages_returned(llm)
        if caching:
            assert llm.engine.kv.stats.hits == 48 + 28  # (the whole first prompt but its last page, 7 pages of the third)
    assert runs[True] == runs[False]
    assert runs[True][0] == expected[kind][3] and runs[True][3] == expected[kind][1]


@pytest.mark.parametrize("kind", KINDS)
def test_ngram_speculation_equals_plain_greedy(kind, windowed):
    prompts = [[3, 4, 5, 6] * 8, [9, 10, 11] * 7 + [12], PROMPTS[1]]
    plain = LLM(str(windowed[kind][0]), kv_cache_memory="1MiB", block_size=BS, max_model_len=128)
    spec = LLM(str(windowed[kind][0]), kv_cache_memory="1MiB", block_size=BS, max_model_len=128, speculative="ngram",
               speculative_policy="always", num_draft_tokens=4, ngram_min=1, ngram_max=3)
    assert spec.engine.kv.sliding_window == (WINDOW if kind == "mistral" else None)
    want = _tokens(plain.generate([{"prompt_token_ids": p} for p in prompts], _greedy(48)))
    assert _tokens(spec.generate([{"prompt_token_ids": p} for p in prompts], _greedy(48))) == want
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(spec)


def _held_pages_while_generating(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], int]:
    """(the output tokens, the most pages the pool had out at any step) of one greedy request."""
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt}, _greedy(n))
    most, tokens = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        most = max(most, engine.kv.num_pages - engine.kv.num_free_pages)
    return tokens, most


def test_a_long_generation_holds_a_bounded_number_of_pages(windowed):
    """300 tokens past a 20-token prompt (20 windows of 16) in pages of 4: at most the window's pages, a partial
    one and one ahead (5 are held), instead of the 80 of the whole sequence; the tokens those of transformers."""
    path, model = windowed["mistral"]
    prompt = list(range(40, 60))
    llm = LLM(str(path), kv_cache_memory="1MiB", block_size=BS, max_model_len=512, enable_prefix_caching=False)
    tokens, most = _held_pages_while_generating(llm, prompt, 300)
    assert most <= WINDOW // BS + 2, most
    assert tokens == hf_greedy(model, prompt, 300)
    assert_pages_returned(llm)


def test_a_model_with_global_layers_keeps_every_page(windowed):
    """Gemma 3's global layer reads the whole context: its pool keeps every page (the local layers' own pool releases
    theirs: tests/test_kv_groups.py)."""
    llm = LLM(str(windowed["gemma3"][0]), kv_cache_memory="1MiB", block_size=BS, max_model_len=128,
              enable_prefix_caching=False)
    _, most = _held_pages_while_generating(llm, list(range(40, 60)), 40)
    assert most >= (20 + 40 - 1) // BS
    assert_pages_returned(llm)
