"""LoRA adapters on a CUDA GPU: the slot table and both matmuls captured in the step graphs (and the mixed-step
graphs) give the tokens PEFT gives in float32, and in bfloat16 the tokens of the same engine run eagerly, for a batch
that mixes adapters and the base model; steps of base-model rows alone replay the graph set without the slots. Skipped without a GPU; run on the GPU machine with
`python -m pytest -m cuda tests/test_lora_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_KV
from test_lora import GEN, PROMPTS, lora_setup, reference  # noqa: F401 - (lora_setup: the fixture)

from atlas import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_tf32")]

COMMON = dict(device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256, max_lora_rank=8)
ADAPTERS = ["full", None, "attn", "mlp", "full", "attn", None, "mlp"]


def _run(llm: LLM, together: bool, base: bool = False) -> list[list[int]]:
    """Each prompt's greedy tokens under its ADAPTERS entry (base: all on the base model, for an engine without
    --enable-lora)."""
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(ADAPTERS))]
    loras = [LoRARequest(a) if a and not base else None for a in ADAPTERS]
    if together:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    return [llm.generate(p, params, lora_request=a)[0].outputs[0].token_ids for p, a in zip(prompts, loras, strict=True)]


def test_adapters_in_cuda_graphs_give_peft_tokens_in_float32_and_eager_tokens_in_bfloat16(lora_setup):  # noqa: F811
    base, root, refs = lora_setup
    modules = [f"{name}={root / name}" for name in refs]
    llm = LLM(str(base), dtype="float32", enable_lora=True, lora_modules=modules, **COMMON)
    assert llm.engine.runner.graph_plan.step_graphs  # (the decode steps replay graphs)
    plain = LLM(str(base), dtype="float32", **COMMON)
    want_base = _run(plain, True, base=True)
    del plain
    for together in (False, True):
        got = _run(llm, together)
        for tokens, adapter, i in zip(got, ADAPTERS, range(len(ADAPTERS)), strict=True):
            prompt = PROMPTS[i % len(PROMPTS)]
            want = want_base[i] if adapter is None else reference(refs[adapter], prompt)[0]
            assert tokens == want, (adapter, together)
    del llm
    eager = LLM(str(base), dtype="bfloat16", enforce_eager=True, enable_lora=True, lora_modules=modules, **COMMON)
    want = [_run(eager, together) for together in (False, True)]
    del eager
    graphs = LLM(str(base), dtype="bfloat16", enable_lora=True, lora_modules=modules, **COMMON)
    assert [_run(graphs, together) for together in (False, True)] == want
    # (the base-model requests run alone replayed the graph set without the slots; the others the set with them)
    sets = graphs.engine.runner.graph_plan._sets
    assert sets[False][0][1].steps_run > 0 and sets[True][0][1].steps_run > 0
    # (both sets, the second in the first's pools, within what the memory plan set aside for the graphs)
    captured = sum(g.captured_mib for step_graphs, mixed in sets.values()
                   for g in [*step_graphs.values(), *([mixed] if mixed is not None else [])]) * 2**20
    assert 0 < captured <= graphs.engine.plan.breakdown["cuda graphs"]
    del graphs
    # (--tuning lora_base_graphs=0: one set, captured with the slots, that every step replays)
    one = LLM(str(base), dtype="bfloat16", enable_lora=True, lora_modules=modules, tuning={"lora_base_graphs": False},
              **COMMON)
    assert [_run(one, together) for together in (False, True)] == want
