"""Gemma 2 (Gemma2ForCausalLM) against transformers' Gemma 2 on a tiny random checkpoint (fp32, CPU): attention scores
soft-capped (a cap of 1.5, so it binds on most scores; the released models' is 50), final logits soft-capped, a
window of 12 on every second layer, no q / k norms; logits over chunks across the window, greedy tokens batched,
preempted and from the prefix cache, n-gram speculation, the windowed layers' pages bounded, two tensor-parallel
ranks; the soft-capped kernel in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    _build,
    _gemma_norms,
    assert_pages_returned,
    check_batched_and_cached,
    generated_tokens,
    hf_greedy,
    hf_model,
    random_ids,
)
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams

GEMMA2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], num_hidden_layers=3, query_pre_attn_scalar=24,
              sliding_window=12, attn_logit_softcapping=1.5, final_logit_softcapping=5.0,
              hidden_activation="gelu_pytorch_tanh", pad_token_id=0)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 4, "skip_tokenizer_init": True, **kw})



@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("gemma2"), "gemma2", GEMMA2, None, 0, {}, randomize=_gemma_norms)


@pytest.fixture(scope="module")
def prompts_and_tokens(gemma2):
    prompts = [random_ids(n, 10 + n) for n in (5, 30, 47)]
    model = hf_model(gemma2)
    return prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_layers_and_logits_over_chunks_match_transformers(gemma2):
    llm = _llm(gemma2)
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [12, None, 12]
    assert all(layer.self_attn.attn.softcap == 1.5 and layer.self_attn.q_norm is None for layer in layers)
    ids = random_ids(45, 1)
    want = hf_logits(gemma2, ids)
    assert float(want.abs().max()) <= 5.0
    torch.testing.assert_close(atlas_logits(llm, ids, [45]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [7, 13, 10] + [1] * 15), want, rtol=1e-4, atol=1e-4)


def test_greedy_batched_preempted_cached_speculated_and_bounded(gemma2, prompts_and_tokens):
    from test_kv_groups import _held_while_generating

    prompts, expected = prompts_and_tokens
    tight = _llm(gemma2, num_gpu_blocks_override=28, max_num_batched_tokens=32, max_model_len=80)
    check_batched_and_cached(tight, prompts, expected, GREEDY)
    ngram = _llm(gemma2, speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
                 ngram_max=3)
    assert generated_tokens(ngram, prompts, GREEDY) == expected
    long = _llm(gemma2, kv_cache_memory="1MiB", max_model_len=256, enable_prefix_caching=False)
    prompt = list(range(40, 60))
    tokens, _, most_window, _ = _held_while_generating(long, prompt, 120)
    assert most_window <= -(-11 // 4) + 2, most_window
    assert tokens == hf_greedy(hf_model(gemma2), prompt, 120)
    assert_pages_returned(long)


def test_two_tensor_parallel_ranks_give_one_devices_tokens(gemma2, prompts_and_tokens):
    from test_parallel import PARALLEL

    prompts, expected = prompts_and_tokens
    tp = LLM(str(gemma2), tensor_parallel_size=2, kv_cache_memory="8MiB", skip_tokenizer_init=True, **PARALLEL)
    try:
        assert generated_tokens(tp, prompts, GREEDY) == expected
    finally:
        tp.shutdown()


def test_softcapped_attention_kernel_in_the_interpreter():
    from conftest import run_in_triton_interpreter

    out = run_in_triton_interpreter("softcap_attention_cases.py", "4", "3", "2", timeout=300)
    assert "9 soft-capped attention cases agree" in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
def test_softcapped_attention_and_gemma2_on_cuda(gemma2, prompts_and_tokens):
    """On CUDA: the soft-capped Triton kernel against its reference in bf16 (every kind of step, split-KV, an 8-bit
    cache), then the tiny Gemma 2 in float32 through the kernels and graphs giving transformers' greedy tokens on the
    same GPU."""
    from conftest import CUDA_KV
    from softcap_attention_cases import check_softcap

    assert check_softcap({"step": 12, "split": 12, "fp8": 6}, "cuda", torch.bfloat16) == []
    prompts, _ = prompts_and_tokens
    llm = _llm(gemma2, device="cuda", dtype="float32", kv_cache_memory=CUDA_KV)
    ref = hf_model(gemma2, dtype=torch.float32, device="cuda")
    assert generated_tokens(llm, prompts, GREEDY) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    assert_pages_returned(llm)
