"""The same comparisons on a CUDA GPU: the Triton attention kernel, bf16 models against transformers,
CUDA-graph decode against eager, batching / prefix caching / speculation invariance, and the memory
plan. Skipped without a GPU; run on the GPU machine with `python -m pytest -m cuda tests/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, assert_pages_returned, hf_model
from paged_attention_cases import check

from atlas import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_paged_attention_matches_reference(dtype):
    assert check("cuda", dtype, range(60)) == []


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 384, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_and_greedy_tokens_against_transformers(arch, checkpoints):
    path = checkpoints[arch]
    llm = LLM(str(path), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=256)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    prompts = _prompts(6, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 32
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1: -1].float()
        # Teacher-forced on Atlas's tokens: each one is the fp32 reference's argmax, up to bf16 noise.
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)
        gap = logits.max(-1).values - chosen
        assert float(gap.max()) < 0.05 * float(logits.std()), gap
    assert_pages_returned(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_on_cuda_equals_transformers_generate(arch, checkpoints):
    path = checkpoints[arch]
    llm = LLM(str(path), dtype="float32", device="cuda", gpu_memory_utilization=0.3, max_model_len=256)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    prompt = _prompts(1, seed=2)[0]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids == expected


def test_graphs_batching_preemption_prefix_caching_and_speculation_never_change_fp32_greedy(qwen3_dir):
    prompts = _prompts(12, seed=3) + [[5, 6, 7, 8] * 6, [9, 10, 11] * 9]
    common = dict(dtype="float32", device="cuda", max_model_len=160)
    reference = LLM(str(qwen3_dir), enforce_eager=True, enable_prefix_caching=False, gpu_memory_utilization=0.3,
                    **common)
    expected = [reference.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts]
    variants = [
        dict(gpu_memory_utilization=0.3),  # CUDA graphs, batched
        dict(num_gpu_blocks_override=30, block_size=8, max_num_batched_tokens=48, max_num_seqs=6),
        dict(gpu_memory_utilization=0.3, speculative="ngram", num_draft_tokens=4, ngram_min=1),
    ]
    for kwargs in variants:
        llm = LLM(str(qwen3_dir), **common, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs
        again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
        assert again.outputs[0].token_ids == expected[0]
        assert_pages_returned(llm)
    assert llm.engine.stats.spec_num_accepted_tokens > 0


def test_memory_plan_holds_under_load(qwen3_dir):
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(str(qwen3_dir), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.25, max_model_len=512,
              max_num_seqs=64)
    plan = llm.engine.plan
    assert plan.device == "cuda" and plan.num_pages > 0
    torch.cuda.reset_peak_memory_stats()
    prompts = _prompts(100, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=64, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    assert torch.cuda.max_memory_reserved() <= 0.25 * total * 1.02
    assert_pages_returned(llm)
