"""GLM-5 (GlmMoeDsaForCausalLM, glm_moe_dsa) against transformers' glm_moe_dsa on a tiny random checkpoint (fp32,
CPU) whose contexts exceed index_topk: its layer pattern of indexing ("full") and top-k-sharing ("shared") layers,
its interleaved indexer RoPE, its mlp_layer_types; logits over chunks and a cached prefix, greedy tokens, chunked
prefill with preemption and prefix caching on equal to off, the MTP layer skipped, and the tool's GLM-5 shapes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEEPSEEK_CONFIGS, _build, _correction_bias, assert_pages_returned, hf_greedy, hf_model
from test_dsa import _ids, _llm, check_chunks_preemption_and_prefix_caching, check_greedy_matches_transformers
from test_models import atlas_logits, hf_logits

from atlas import SamplingParams

TOPK = 8
# 4 layers: full, shared, shared, full (the third reuses the first's top-k through two layers); MLPs dense, sparse,
# dense, sparse (mlp_layer_types, not first_k_dense_replace); rms_norm_eps 1e-5 as the published model (the latent
# norms stay at 1e-6); YaRN with mscale_all_dim; 16 indexer heads keep exact top-k ties rare.
GLM5 = dict(
    {k: v for k, v in DEEPSEEK_CONFIGS["v3"].items() if k != "rope_scaling"},
    architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_hidden_layers=4,
    indexer_types=["full", "shared", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    first_k_dense_replace=1, rms_norm_eps=1e-5, index_topk=TOPK, index_n_heads=16, index_head_dim=16,
    num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0})
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("glm5"), "glm5", GLM5, None, 0, {}, randomize=_correction_bias)


@pytest.fixture(scope="module")
def llm(glm5):
    return _llm(glm5)


@pytest.mark.parametrize("fields", [{}, {"index_topk_freq": 3}, {"index_topk_freq": 2, "index_skip_topk_offset": 1},
                                    {"index_topk_freq": 4, "index_skip_topk_offset": 5}, {"index_topk_pattern": "FSSFS"},
                                    {"index_topk_pattern": ["full", "shared", "full", "full", "shared"]}])
def test_layer_pattern_is_derived_as_transformers_does(fields, tmp_path):
    from transformers import GlmMoeDsaConfig

    from atlas.models.deepseek import glm_indexer_types

    want = GlmMoeDsaConfig(num_hidden_layers=5, **fields).indexer_types
    assert list(glm_indexer_types(fields, 5, tmp_path)) == want


def test_the_model_has_its_layer_pattern(glm5, llm):
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.indexer is None for layer in layers] == [False, True, True, False]
    assert [type(layer.mlp).__name__ for layer in layers] == ["LlamaMLP", "SparseMoE", "LlamaMLP", "SparseMoE"]
    # Shared layers cache the plain latent row; full layers the latent row and the indexer key.
    row = GLM5["kv_lora_rank"] + GLM5["qk_rope_head_dim"]
    assert [c.shape[-1] for c in llm.engine.runner.kv_caches] == [row + 16, row, row, row + 16]
    assert layers[0].self_attn.q_a_layernorm.eps == 1e-6 and layers[0].input_layernorm.eps == 1e-5
    # Layer 0 records its selections for layers 1-2; layer 2 drops them: none outlive a step.
    assert [(a.records, a.releases) for a in (layer.self_attn for layer in layers)] == \
        [(True, False), (False, False), (False, True), (False, False)]
    llm.generate([{"prompt_token_ids": _ids(20, 9)}], GREEDY)
    assert layers[1].self_attn.share.selected is None


def test_logits_over_chunks_and_a_cached_prefix_match_transformers(glm5, llm, monkeypatch):
    """40 tokens (5x index_topk): one prefill, then chunks starting mid-page and decode steps. Both the interleaved
    indexer RoPE and the shared layers' reuse matter: a rotate-half indexer, or shared layers that index with their
    neighbour's selection dropped (dense), miss transformers' logits."""
    ids = _ids(40, 1)
    expected = hf_logits(glm5, ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [40]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [13, 11, 5] + [1] * 11), expected, rtol=1e-4, atol=1e-4)
    import atlas.kernels.dsa_attention_ref as ref

    real = ref.dsa_attention_ref

    def dense_when_shared(*args, reuse=None, **kw):
        out = real(*args, reuse=reuse, **kw)
        if reuse is None:
            return out
        dense = [torch.ones_like(s).tril(s.shape[1] - s.shape[0]) for s in reuse]
        return real(*args, reuse=dense, **kw)

    monkeypatch.setattr("atlas.kernels.dsa_attention.dsa_attention_ref", dense_when_shared)
    assert (atlas_logits(llm, ids, [40]) - expected).abs().max() > 1e-2
    monkeypatch.undo()
    for layer in llm.engine.runner.model.model.layers:
        if layer.self_attn.indexer is not None:
            monkeypatch.setattr(layer.self_attn.indexer.rotary, "is_neox_style", True)
    assert (atlas_logits(llm, ids, [40]) - expected).abs().max() > 1e-2


def test_greedy_tokens_match_transformers(glm5, llm):
    check_greedy_matches_transformers(glm5, llm, GREEDY)


def test_chunked_prefill_preemption_and_prefix_caching_do_not_change_outputs(glm5):
    check_chunks_preemption_and_prefix_caching(glm5, GREEDY, 5)


def _edit(src, dst, **fields):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **fields}))
    return dst


def test_mtp_layer_is_skipped_with_a_log_line_unless_it_drafts(glm5, tmp_path, caplog):
    """A checkpoint with its MTP layer: plain serving leaves those tensors out (one log line) and equals
    transformers; --speculative mtp serves it (tests/test_dsa_mtp.py)."""
    import logging

    from safetensors.torch import load_file, save_file

    path = _edit(glm5, tmp_path / "mtp", num_nextn_predict_layers=1)
    tensors = load_file(path / "model.safetensors")
    n = GLM5["num_hidden_layers"]
    mtp = {k.replace("layers.3.", f"layers.{n}."): v.clone() for k, v in tensors.items() if k.startswith("model.layers.3.")}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="atlas.models.deepseek"):
        llm = _llm(path)
    assert f"the {len(mtp)} tensors of its MTP module (layer {n}) are loaded only as the drafter" in caplog.text
    assert llm.generate([{"prompt_token_ids": [5, 17, 42]}], GREEDY)[0].outputs[0].token_ids == \
        hf_greedy(hf_model(glm5), [5, 17, 42], GREEDY.max_tokens)


@pytest.mark.parametrize("field,value,needle", [
    ("indexer_types", ["shared", "full", "full", "full"], "layer 0 is a 'shared'"),
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("indexer_rope_interleave", False, "indexer_rope_interleave=False")])
def test_what_cannot_be_done_exactly_is_refused_by_name(glm5, tmp_path, field, value, needle):
    from atlas.errors import ModelLoadError, UnsupportedModelError

    with pytest.raises((ModelLoadError, UnsupportedModelError), match=needle):
        _llm(_edit(glm5, tmp_path / field, **{field: value}))


def test_random_checkpoint_tool_glm5_shapes(tmp_path):
    """glm-5-tiny: transformers loads every tensor the tool writes and nothing is missing, and Atlas's greedy tokens
    equal transformers', and its config alone serves with --load-format dummy. glm-5-cut (config-only use): the published per-layer shapes."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    tool = Path(__file__).resolve().parent.parent / "tools" / "make_random_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "glm5"
    assert module.main(["--shape", "glm-5-tiny", "--out", str(out), "--std", "0.2", "--device", "cpu"]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    prompt = list(range(3, 30))
    llm = _llm(out)
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(model.eval(), prompt, GREEDY.max_tokens)
    assert "shared" in json.loads((out / "config.json").read_text())["indexer_types"]
    assert_pages_returned(llm)
    dummy = tmp_path / "glm5-dummy"
    assert module.main(["--shape", "glm-5-tiny", "--out", str(dummy), "--config-only"]) == 0
    llm = _llm(dummy, load_format="dummy")
    assert len(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert_pages_returned(llm)
    cut = tmp_path / "glm5-cut"
    assert module.main(["--shape", "glm-5-cut", "--out", str(cut), "--config-only"]) == 0
    cfg = json.loads((cut / "config.json").read_text())
    assert (cfg["index_topk"], cfg["index_n_heads"], cfg["index_head_dim"], cfg["hidden_size"], cfg["kv_lora_rank"],
            cfg["q_lora_rank"], cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == \
        (2048, 32, 128, 6144, 512, 2048, 64, 192, 256)
