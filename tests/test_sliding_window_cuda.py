"""Sliding windows on a CUDA GPU: the Triton kernel's window masking over released pages against the reference
(unsplit, split-KV, an 8-bit cache), and tiny windowed models (an all-windowed Mistral whose pages are released,
Gemma 3) equal to transformers with CUDA graphs on. Skipped without a GPU; run on the GPU machine with
`python -m pytest -m cuda tests/test_sliding_window_cuda.py`."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import (
    CUDA_KV,
    assert_pages_returned,
    build_checkpoint,
    build_gemma3_checkpoint,
    hf_greedy,
    hf_model,
)
from sliding_window_cases import check_released

from atlas import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_tf32")]

WINDOW, BS = 16, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_window_over_released_pages_matches_reference(dtype):
    """On the GPU an 8-bit NaN page stays NaN: the fp8 cases check that no released page is read, too."""
    assert check_released({"step": 40, "split": 40, "fp8": 20}, "cuda", dtype) == []


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("windowed-cuda")
    return {"mistral": build_checkpoint(root, "MistralForCausalLM", tokenizer_dir, seed=5, sliding_window=WINDOW),
            "gemma3": build_gemma3_checkpoint(root, tokenizer_dir, seed=5)}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 384, (n,), generator=g).tolist() for n in (3, 17, 40, 70, 9, 33)]


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_fp32_greedy_with_cuda_graphs_equals_transformers(kind, windowed):
    """A batch whose prompts and 64 generated tokens cross the window several times; decode steps replay CUDA
    graphs (page tables with released pages included); a 32-token budget chunks the prefills."""
    path = windowed[kind]
    llm = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256,
              block_size=BS, max_num_batched_tokens=32)
    assert len(llm.engine.runner.step_graphs) > 0  # (CUDA graphs on)
    assert llm.engine.kv.sliding_window == (WINDOW if kind == "mistral" else None)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    prompts = _prompts()
    expected = [hf_greedy(ref, p, 64) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_pages_returned(llm)


def test_long_generation_on_cuda_holds_bounded_pages_and_equals_transformers(windowed):
    path = windowed["mistral"]
    llm = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=512,
              block_size=BS, enable_prefix_caching=False)
    engine = llm.engine
    prompt = list(range(40, 60))
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    most, tokens = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        most = max(most, engine.kv.num_pages - engine.kv.num_free_pages)
    assert most <= WINDOW // BS + 2, most
    assert tokens == hf_greedy(hf_model(path, dtype=torch.float32, device="cuda"), prompt, 400)
    assert_pages_returned(llm)


def test_ngram_speculation_equals_plain_greedy_on_cuda(windowed):
    path = str(windowed["mistral"])
    prompts = [[3, 4, 5, 6] * 10, [9, 10, 11] * 9 + [12], _prompts()[3]]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    plain = LLM(path, dtype="float32", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256, block_size=BS)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    del plain
    gc.collect()
    torch.cuda.empty_cache()
    spec = LLM(path, dtype="float32", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256, block_size=BS,
               speculative="ngram", speculative_policy="always", num_draft_tokens=4, ngram_min=1, ngram_max=3)
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(spec)


def test_gemma3_bf16_greedy_tokens_against_transformers(windowed):
    """bf16 on the GPU, teacher-forced against the fp32 reference: each token is its argmax up to bf16 noise."""
    path = windowed["gemma3"]
    llm = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256,
              block_size=BS)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    for prompt, out in zip(_prompts(), llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                                                     SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)),
                           strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1: -1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)
        gap = logits.max(-1).values - chosen
        assert float(gap.max()) < 0.05 * float(logits.std()), gap
    assert_pages_returned(llm)
