"""The DeepSeek family on a CUDA GPU: the Triton MLA kernel against its reference, bf16 and fp32 models
against transformers, CUDA-graph decode and verify steps against eager ones, and MTP drafting
lossless. Skipped without a GPU; run on the GPU machine with
`python -m pytest -m cuda tests/test_deepseek_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import DEEPSEEK_CONFIGS, assert_pages_returned, hf_greedy, hf_model
from mla_attention_cases import random_case, run_case
from paged_attention_cases import check

from atlas import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
NAMES = list(DEEPSEEK_CONFIGS)


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_attention_matches_reference(dtype):
    assert check("cuda", dtype, range(40), random_case, run_case) == []


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 384, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), device="cuda", gpu_memory_utilization=0.3, max_model_len=256, skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_fp32_on_cuda_equals_transformers_generate(name, deepseek_checkpoints):
    """CUDA graphs for decode (the default), the Triton MLA kernel, grouped experts."""
    path = deepseek_checkpoints[name]
    llm = _llm(path, dtype="float32")
    assert llm.engine.runner.step_graphs, "decode steps should replay CUDA graphs"
    prompts = _prompts(4, seed=2)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 32) for p in prompts]
    assert_pages_returned(llm)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_tokens_are_the_references_argmax(name, deepseek_checkpoints):
    path = deepseek_checkpoints[name]
    llm = _llm(path, dtype="bfloat16")
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    prompts = _prompts(6, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1: -1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)
        gap = logits.max(-1).values - chosen
        assert float(gap.max()) < 0.05 * float(logits.std()), gap
    assert_pages_returned(llm)


def test_graphs_and_eager_agree_with_prefix_caching_and_mtp(deepseek_checkpoints):
    path = deepseek_checkpoints["v3"]
    prompts = _prompts(10, seed=3)
    eager = _llm(path, dtype="float32", enforce_eager=True, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    for kw in ({}, {"speculative": "mtp", "num_draft_tokens": 2}, {"speculative": "ngram", "num_draft_tokens": 3}):
        llm = _llm(path, dtype="float32", **kw)
        for _ in range(2):  # the second round hits the prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == expected, kw
        assert llm.engine.kv.stats.hits > 0
        assert_pages_returned(llm)
