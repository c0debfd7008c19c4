"""Cohere's Command models against transformers on tiny random checkpoints (fp32, CPU): CohereForCausalLM with
per-head q / k LayerNorms (Command R+'s use_qk_norm) and Cohere2ForCausalLM (Command A, R7B: sliding layers with
RoPE beside global NoPE layers); the parallel block, Cohere's LayerNorm, interleaved RoPE and the logit scale; logits
over chunks, greedy tokens batched, preempted and from the prefix cache, n-gram speculation, two tensor-parallel
ranks (the per-head norm weights split with their heads)."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    _build,
    check_batched_and_cached,
    generated_tokens,
    hf_greedy,
    hf_model,
    random_ids,
)
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams

CONFIGS = {
    "cohere": dict(model_type="cohere", architectures=["CohereForCausalLM"], use_qk_norm=True, logit_scale=0.25,
                   pad_token_id=0, tie_word_embeddings=True),
    # 4 layers: three sliding (window 12, RoPE) and a global one (no RoPE)
    "cohere2": dict(model_type="cohere2", architectures=["Cohere2ForCausalLM"], num_hidden_layers=4,
                    sliding_window=12, logit_scale=0.25, pad_token_id=0, tie_word_embeddings=True),
}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 4, "skip_tokenizer_init": True, **kw})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cohere")
    return {name: _build(root, name, spec, None, 0, {}) for name, spec in CONFIGS.items()}


@pytest.fixture(scope="module")
def expected(checkpoints):
    prompts = [random_ids(n, 10 + n) for n in (5, 30, 47)]
    out = {}
    for name, path in checkpoints.items():
        model = hf_model(path)
        out[name] = (prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts])
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_over_chunks_match_transformers(name, checkpoints):
    llm = _llm(checkpoints[name])
    ids = random_ids(45, 1)
    want = hf_logits(checkpoints[name], ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [45]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [7, 13, 10] + [1] * 15), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_batched_preempted_cached_and_speculated(name, checkpoints, expected):
    prompts, tokens = expected[name]
    tight = _llm(checkpoints[name], num_gpu_blocks_override=28, max_num_batched_tokens=32, max_model_len=80)
    check_batched_and_cached(tight, prompts, tokens, GREEDY)
    ngram = _llm(checkpoints[name], speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
                 ngram_max=3)
    assert generated_tokens(ngram, prompts, GREEDY) == tokens


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_tensor_parallel_ranks_give_one_devices_tokens(name, checkpoints, expected):
    from test_parallel import PARALLEL

    prompts, tokens = expected[name]
    tp = LLM(str(checkpoints[name]), tensor_parallel_size=2, kv_cache_memory="8MiB", skip_tokenizer_init=True,
             **PARALLEL)
    try:
        assert generated_tokens(tp, prompts, GREEDY) == tokens
    finally:
        tp.shutdown()


def test_fp8_and_lora_are_refused_naming_the_family(checkpoints):
    from atlas.errors import AtlasError

    with pytest.raises(AtlasError, match="Cohere2ForCausalLM"):
        _llm(checkpoints["cohere2"], quantization="fp8")
    with pytest.raises(AtlasError, match="(?i)lora|adapter"):
        _llm(checkpoints["cohere2"], enable_lora=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_on_cuda_the_kernels_and_graphs_give_transformers_tokens(name, checkpoints, expected):
    from conftest import CUDA_KV, assert_pages_returned

    prompts, _ = expected[name]
    llm = _llm(checkpoints[name], device="cuda", dtype="float32", kv_cache_memory=CUDA_KV)
    ref = hf_model(checkpoints[name], dtype=torch.float32, device="cuda")
    assert generated_tokens(llm, prompts, GREEDY) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    assert_pages_returned(llm)
