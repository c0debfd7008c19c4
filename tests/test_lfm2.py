"""LFM2 and LFM2-MoE (gated short-convolution layers beside attention layers) against transformers on tiny random checkpoints
(fp32, CPU): logits over chunks (the convolution's state carried between them), greedy tokens batched, preempted,
from the prefix cache (state snapshots inside a step) and under n-gram speculation (the state backed up and replayed),
every page and state slot returned; two tensor-parallel ranks and two pipeline stages against one device; the
released configs' full_attn_idxs; the convolution's Triton kernels without their silu in the interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import _build, check_batched_and_cached, generated_tokens, hf_greedy, hf_model, random_ids
from test_hybrid_models import assert_slots_returned
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams

CONFIGS = {
    # LFM2's layout: convolution layers and attention layers, the MLP width auto-adjusted (2/3, rounded up to 32)
    "lfm2": dict(model_type="lfm2", architectures=["Lfm2ForCausalLM"], num_hidden_layers=4,
                 layer_types=["conv", "full_attention", "conv", "conv"], intermediate_size=144, block_multiple_of=32,
                 block_ffn_dim_multiplier=1.5, conv_L_cache=3, norm_eps=1e-5, tie_word_embeddings=True),
    # ... with the convolution's biases, the width as given, an untied head
    "lfm2_bias": dict(model_type="lfm2", architectures=["Lfm2ForCausalLM"], num_hidden_layers=3,
                      layer_types=["conv", "conv", "full_attention"], intermediate_size=96, conv_bias=True,
                      block_auto_adjust_ff_dim=False, conv_L_cache=4, tie_word_embeddings=False),
}
# LFM2-MoE: a dense first layer, then sparse blocks (sigmoid routing with the expert bias, renormalized, scaled)
CONFIGS["lfm2_moe"] = dict(model_type="lfm2_moe", architectures=["Lfm2MoeForCausalLM"], num_hidden_layers=4,
                           layer_types=["conv", "full_attention", "conv", "conv"], intermediate_size=96,
                           moe_intermediate_size=32, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                           routed_scaling_factor=2.0, tie_word_embeddings=True)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 4, "skip_tokenizer_init": True, **kw})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfm2")
    return {name: _build(root, name, spec, None, 0, {}, randomize=_expert_bias) for name, spec in CONFIGS.items()}


def _expert_bias(model: torch.nn.Module, seed: int) -> None:
    """Non-zero expert_bias buffers (LFM2-MoE's): they must choose the experts and not weight them."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))


@pytest.fixture(scope="module")
def expected(checkpoints):
    prompts = [random_ids(n, 30 + n) for n in (5, 30, 47)]
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
    assert_slots_returned(tight)
    ngram = _llm(checkpoints[name], speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
                 ngram_max=3)
    assert generated_tokens(ngram, prompts, GREEDY) == tokens
    assert_slots_returned(ngram)


@pytest.mark.parametrize("name, layout", [("lfm2_bias", "tensor_parallel_size"), ("lfm2_bias", "pipeline_parallel_size"),
                                          ("lfm2_moe", "tensor_parallel_size")])
def test_two_ranks_give_one_devices_tokens(name, layout, checkpoints, expected):
    from test_parallel import PARALLEL

    prompts, tokens = expected[name]
    llm = LLM(str(checkpoints[name]), **{layout: 2}, kv_cache_memory="8MiB", skip_tokenizer_init=True,
              max_num_batched_tokens=16, speculative="ngram", speculative_policy="always", num_draft_tokens=3,
              ngram_min=1, ngram_max=3, **PARALLEL)
    try:
        assert generated_tokens(llm, prompts, GREEDY) == tokens
    finally:
        llm.shutdown()


def test_the_released_configs_full_attn_idxs_is_read(tmp_path, checkpoints, expected):
    import json
    import shutil

    path = tmp_path / "idxs"
    shutil.copytree(checkpoints["lfm2"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["full_attn_idxs"] = [i for i, t in enumerate(cfg.pop("layer_types")) if t == "full_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    prompts, tokens = expected["lfm2"]
    assert generated_tokens(_llm(path), prompts, GREEDY) == tokens


def test_the_convolution_without_its_silu_in_the_interpreter():
    """The eager and uniform convolution kernels with SILU off (and a bias) against the reference, through Triton's
    interpreter (tests/mamba2_cases.py's short-convolution cases)."""
    from conftest import run_in_triton_interpreter

    assert "short convolution cases match" in run_in_triton_interpreter("mamba2_cases.py", "2", "--short-conv")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_on_cuda_the_graphs_give_transformers_tokens(name, checkpoints, expected):
    from conftest import CUDA_KV, assert_pages_returned

    prompts, _ = expected[name]
    ref = hf_model(checkpoints[name], dtype=torch.float32, device="cuda")
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    for kw in ({}, dict(speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
                        ngram_max=3)):
        llm = _llm(checkpoints[name], device="cuda", dtype="float32", kv_cache_memory=CUDA_KV, **kw)
        assert generated_tokens(llm, prompts, GREEDY) == want
        assert_pages_returned(llm)
