"""Atlas's model math against Hugging Face transformers, for every supported architecture (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, assert_pages_returned, hf_greedy, hf_model

from atlas import LLM, SamplingParams
from atlas.engine.request import Request
from atlas.runtime.request_tables import snapshot_batch


def atlas_logits(llm: LLM, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position of token_ids, computed chunk by chunk through the paged cache."""
    engine = llm.engine
    runner = engine.runner
    req = Request("probe", "probe", 0, None, token_ids, SamplingParams(), [])
    assert engine.kv.allocate(req, len(token_ids))
    slots = engine.scheduler.state_slots  # (a model with recurrent state: the probe's slot)
    if slots is not None:
        req.state_slot = slots.allocate()
    rows = []
    try:
        for n in chunks:
            inputs = runner.prepare_inputs(snapshot_batch([req], [n]))
            with torch.inference_mode():
                hidden, _ = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
                rows.append(runner.model.compute_logits(hidden))
            req.num_computed_tokens += n
    finally:
        engine.kv.free(req)
        if slots is not None:
            slots.release(req.state_slot)
    assert req.num_computed_tokens == len(token_ids)
    return torch.cat(rows)


def hf_logits(path, token_ids: list[int]) -> torch.Tensor:
    model = hf_model(path)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def llms(checkpoints):
    return {arch: LLM(str(path), kv_cache_memory="8MiB", block_size=8) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch, checkpoints, llms):
    ids = torch.randint(0, 384, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(checkpoints[arch], ids)
    got = atlas_logits(llms[arch], ids, [70])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_logits_match_transformers(arch, checkpoints, llms):
    """Chunks that start mid-page, then single-token decode steps, all attending over cached pages."""
    ids = torch.randint(0, 384, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_logits(checkpoints[arch], ids)
    got = atlas_logits(llms[arch], ids, [13, 21, 19] + [1] * 17)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_generate(arch, checkpoints, llms):
    llm = llms[arch]
    prompts = [[5, 17, 42, 99, 3], list(range(100, 137)), [7] * 12]
    model = hf_model(checkpoints[arch])
    expected = [hf_greedy(model, p, 40) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_pages_returned(llm)


def test_an_unsupported_gated_activation_is_refused_with_the_supported_names():
    from atlas.errors import UnsupportedModelError
    from atlas.kernels.fused_ops import act_and_mul_ref
    from atlas.models.llama import LlamaMLP

    g = torch.Generator().manual_seed(0)
    mlp = LlamaMLP(16, 32, "gelu_pytorch_tanh", bias=False)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(3, 16, generator=g)
    with torch.no_grad():
        expected = mlp.down_proj.weight @ act_and_mul_ref(x @ mlp.gate_up_proj.weight.T, "gelu_pytorch_tanh").T
        assert torch.allclose(mlp(x), expected.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedModelError, match=r"hidden_act 'relu2' is not supported; supported: .*silu"):
        LlamaMLP(16, 32, "relu2", bias=False)
