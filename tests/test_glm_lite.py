"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM, glm4_moe_lite) against transformers' glm4_moe_lite on a tiny random checkpoint
(fp32, CPU): DeepSeek-V3's MLA and routing with GLM's mlp_layer_types and rms_norm_eps 1e-5 (the latent norms at
1e-6, as the reference builds them); logits over chunks, greedy tokens batched, preempted and from the prefix cache,
its MTP layer drafting losslessly, and what is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import (
    DEEPSEEK_CONFIGS,
    _add_mtp_module,
    _build,
    _correction_bias,
    assert_pages_returned,
    check_batched_and_cached,
    generated_tokens,
    hf_greedy,
    hf_model,
    random_ids,
)
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams
from atlas.errors import UnsupportedModelError

# 3 layers: dense, sparse, dense (mlp_layer_types, where V3's first_k_dense_replace would make the third sparse);
# V3's YaRN with mscale; one shared expert and routed_scaling_factor from GLM's defaults (left out of the config).
LITE = dict(
    {k: v for k, v in DEEPSEEK_CONFIGS["v3"].items() if k not in ("n_shared_experts", "routed_scaling_factor")},
    architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", mlp_layer_types=["dense", "sparse", "dense"],
    rms_norm_eps=1e-5)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw})



@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    path = _build(tmp_path_factory.mktemp("glm-lite"), "glm-lite", LITE, None, 0, {}, randomize=_correction_bias)
    _add_mtp_module(path, 0)  # (num_nextn_predict_layers 1, as GLM-4.7-Flash ships; transformers ignores it)
    return path


def test_layers_logits_and_greedy_tokens_match_transformers(lite):
    llm = _llm(lite)
    layers = llm.engine.runner.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["LlamaMLP", "SparseMoE", "LlamaMLP"]
    assert layers[1].mlp.shared_experts is not None and layers[0].self_attn.kv_a_layernorm.eps == 1e-6
    assert llm.engine.runner.model.settings.router.routed_scaling_factor == 1.8
    ids = random_ids(60, 1)
    want = hf_logits(lite, ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [60]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [13, 21, 9] + [1] * 17), want, rtol=1e-4, atol=1e-4)
    prompts = [random_ids(n, 10 + n) for n in (5, 30, 47)]
    model = hf_model(lite)
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    tight = _llm(lite, num_gpu_blocks_override=14, max_num_batched_tokens=32, max_model_len=80)
    check_batched_and_cached(tight, prompts, expected, GREEDY)
    mtp = _llm(lite, speculative="mtp", speculative_policy="always", num_draft_tokens=2)
    assert generated_tokens(mtp, prompts, GREEDY) == expected
    assert mtp.engine.stats.spec_num_draft_tokens > 0
    assert_pages_returned(mtp)


def _variant(src, dst, change: dict, drop: tuple[str, ...] = ()):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **change}.items() if k not in drop}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_without_mlp_layer_types_the_first_layer_is_dense_and_an_ambiguous_config_is_refused(lite, tmp_path):
    spec = {k: v for k, v in LITE.items() if k != "mlp_layer_types"}
    plain = _build(tmp_path, "plain", spec, None, 1, {}, randomize=_correction_bias)
    layers = _llm(plain).engine.runner.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["LlamaMLP", "SparseMoE", "SparseMoE"]
    ids = random_ids(20, 3)
    torch.testing.assert_close(atlas_logits(_llm(plain), ids, [20]), hf_logits(plain, ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(UnsupportedModelError, match="first_k_dense_replace=2 without mlp_layer_types"):
        _llm(_variant(lite, tmp_path / "two", {"first_k_dense_replace": 2}, drop=("mlp_layer_types",)))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5"):
        _llm(_variant(lite, tmp_path / "partial", {"partial_rotary_factor": 0.5}))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
def test_on_cuda_the_mla_kernels_and_graphs_give_transformers_tokens(lite):
    from conftest import CUDA_KV

    prompts = [random_ids(n, 10 + n) for n in (5, 30, 47)]
    llm = _llm(lite, device="cuda", dtype="float32", kv_cache_memory=CUDA_KV)
    ref = hf_model(lite, dtype=torch.float32, device="cuda")
    assert generated_tokens(llm, prompts, GREEDY) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    assert_pages_returned(llm)
