"""LongCat-Flash (LongcatFlashForCausalLM, longcat_flash) against transformers' longcat_flash on a tiny random
checkpoint (fp32, CPU): two MLA sublayers per layer with LongCat's latent scaling, the shortcut MoE with zero
(identity) experts; logits over one prefill, chunks and decode steps (with negative checks for the scaling and the
zero experts), greedy tokens, chunked prefill with preemption and prefix caching on equal to off, n-gram speculation
equal to plain greedy, the MTP module skipped (its drafter: tests/test_longcat_mtp.py), refusals by name (n-gram fields on the plain architecture among them; the n-gram model: tests/test_longcat_ngram.py), and the
random-checkpoint tool's LongCat shapes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import _build, _correction_bias, assert_pages_returned, hf_greedy, hf_model, tool_module
from test_dsa import _ids, _llm, check_chunks_preemption_and_prefix_caching, check_greedy_matches_transformers
from test_models import atlas_logits, hf_logits

from atlas import SamplingParams
from atlas.errors import ModelLoadError, UnsupportedModelError

# 2 decoder layers (transformers' num_hidden_layers counts the 4 attention sublayers); 4 routed + 4 zero experts,
# top-3, so most tokens pick a zero expert; latent ranks unlike hidden_size, so the MLA scaling matters.
LONGCAT = dict(
    architectures=["LongcatFlashForCausalLM"], model_type="longcat_flash", num_hidden_layers=4, num_key_value_heads=4,
    ffn_hidden_size=96, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=4, moe_topk=3, q_lora_rank=32,
    kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, routed_scaling_factor=6.0,
    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def longcat(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("longcat"), "longcat", LONGCAT, None, 0, {}, randomize=_correction_bias)


@pytest.fixture(scope="module")
def llm(longcat):
    return _llm(longcat)


def test_the_model_has_two_latent_caches_a_layer(longcat, llm):
    model = llm.engine.runner.model
    assert len(model.model.layers) == 2
    row = LONGCAT["kv_lora_rank"] + LONGCAT["qk_rope_head_dim"]
    assert [c.shape[-1] for c in llm.engine.runner.kv_caches] == [row] * 4
    attn = model.model.layers[0].self_attn[0]
    assert attn.q_a_layernorm.eps == 1e-6 and model.model.layers[0].input_layernorm[0].eps == 1e-5


def test_logits_over_one_prefill_chunks_and_decode_steps_match_transformers(longcat, llm, monkeypatch):
    """And the two LongCat pieces matter: without the latent scaling, or with zero experts that add nothing, the
    logits miss transformers'."""
    ids = _ids(40, 1)
    expected = hf_logits(longcat, ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [40]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [13, 11, 5] + [1] * 11), expected, rtol=1e-4, atol=1e-4)
    layers = llm.engine.runner.model.model.layers
    with torch.no_grad():
        for layer in layers:
            for attn in layer.self_attn:
                attn.kv_a_layernorm.weight.div_((64 / 24) ** 0.5)
        try:
            assert (atlas_logits(llm, ids, [40]) - expected).abs().max() > 1e-2
        finally:
            for layer in layers:
                for attn in layer.self_attn:
                    attn.kv_a_layernorm.weight.mul_((64 / 24) ** 0.5)
    for layer in layers:
        moe = layer.mlp
        monkeypatch.setattr(moe, "num_routed", moe.num_routed + LONGCAT["zero_expert_num"])
        monkeypatch.setattr(moe.experts, "forward", lambda x, w, i, e=moe.experts: type(e).forward(
            e, x, torch.where(i >= LONGCAT["n_routed_experts"], 0.0, w), i.clamp(max=LONGCAT["n_routed_experts"] - 1)))
    assert (atlas_logits(llm, ids, [40]) - expected).abs().max() > 1e-2
    monkeypatch.undo()
    torch.testing.assert_close(atlas_logits(llm, ids, [40]), expected, rtol=1e-4, atol=1e-4)


def test_yarn_and_attention_bias_match_transformers(tmp_path):
    """YaRN (its mscale_all_dim in the softmax scale, its mscale on the rope) and the MLA projections' biases."""
    spec = dict(LONGCAT, attention_bias=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0})
    path = _build(tmp_path, "yarn", spec, None, 3, {}, randomize=_correction_bias)
    ids = _ids(40, 4)
    expected = hf_logits(path, ids)
    torch.testing.assert_close(atlas_logits(_llm(path), ids, [7, 30, 1, 1, 1]), expected, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_match_transformers(longcat, llm):
    check_greedy_matches_transformers(longcat, llm, GREEDY)


def test_chunked_prefill_preemption_and_prefix_caching_do_not_change_outputs(longcat):
    check_chunks_preemption_and_prefix_caching(longcat, GREEDY, 5)


def check_ngram_speculation_equals_plain_greedy(path, llm, eos: int | None = None) -> None:
    """A 120-token prompt (with `eos` at position 50 when given), 20 tokens: n-gram drafts verified equal plain
    decoding. (Shared with test_longcat_ngram.py.)"""
    prompt = torch.randperm(383, generator=torch.Generator().manual_seed(7))[:120].add(1).tolist()
    if eos is not None:
        prompt[50] = eos
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    spec = _llm(path, speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1, ngram_max=3)
    assert spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == plain
    assert spec.engine.stats.spec_num_verify_steps > 0
    assert_pages_returned(spec)


def test_ngram_speculation_equals_plain_greedy(longcat, llm):
    check_ngram_speculation_equals_plain_greedy(longcat, llm)


def _edit(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **fields}))
    return dst


def test_mtp_module_is_skipped_with_a_log_line_and_an_incomplete_one_refused_as_a_drafter(longcat, tmp_path, caplog):
    """Plain serving leaves model.mtp.* out (one log line) and equals transformers; as a drafter (the module's
    tests: tests/test_longcat_mtp.py), a module with tensors missing is refused naming them."""
    import logging

    from safetensors.torch import load_file, save_file

    path = _edit(longcat, tmp_path / "mtp")
    tensors = load_file(path / "model.safetensors")
    mtp = {"model.mtp.layers.0.eh_proj.weight": torch.zeros(64, 128), "model.mtp.norm.weight": torch.ones(64)}
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="atlas.models.longcat"):
        llm = _llm(path)
    assert "the 2 tensors of its MTP module (model.mtp.*) are loaded only as the drafter" in caplog.text
    assert llm.generate([{"prompt_token_ids": [5, 17, 42]}], GREEDY)[0].outputs[0].token_ids == \
        hf_greedy(hf_model(longcat), [5, 17, 42], GREEDY.max_tokens)
    with pytest.raises(ModelLoadError, match="missing weight"):
        _llm(path, speculative="mtp")


@pytest.mark.parametrize("fields,needle", [
    ({"ngram_vocab_size_ratio": 78}, "n-gram input embedding is served as LongcatFlashNgramForCausalLM"),
    ({"zero_expert_type": "const"}, "zero_expert_type='const'"),
    ({"mla_scale_kv_lora": False}, "mla_scale_kv_lora=False"),
    ({"router_bias": True}, "router_bias=True"),
    ({"head_dim": 16}, "head_dim 16")])
def test_what_is_not_implemented_is_refused_by_name(longcat, tmp_path, fields, needle):
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=needle):
        _llm(_edit(longcat, tmp_path / "edited", **fields))


def test_unknown_expert_tensors_are_refused(longcat, tmp_path):
    """Zero experts' gate|up rows (what transformers before 5.25 saves for them; later versions save none) are known
    and skipped; a down projection for one is not known and is refused by name."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(longcat / "model.safetensors")
    rows = {f"model.layers.0.mlp.experts.4.{kind}_proj.weight": torch.zeros(32, 64) for kind in ("gate", "up")}
    known = _edit(longcat, tmp_path / "known")
    save_file({**tensors, **rows}, known / "model.safetensors", metadata={"format": "pt"})
    assert len(_llm(known).generate([[3, 4, 5]], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    extra = _edit(longcat, tmp_path / "extra")
    down = {"model.layers.0.mlp.experts.4.down_proj.weight": torch.zeros(64, 32)}
    save_file({**tensors, **rows, **down}, extra / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="experts.4.down_proj"):
        _llm(extra)


def test_random_checkpoint_tool_longcat_shapes(tmp_path):
    """longcat-flash-tiny: the published layout (weights for the routed experts only); Atlas's greedy tokens equal
    transformers' (which before 5.25 needs gate|up rows for the zero experts too: then a copy gets zeros there), and
    its config alone serves with --load-format dummy. longcat-flash-cut (config-only use): the published per-layer
    shapes."""

    from safetensors.torch import load_file, save_file

    module = tool_module("make_random_checkpoint")
    out = tmp_path / "longcat"
    assert module.main(["--shape", "longcat-flash-tiny", "--out", str(out), "--std", "0.2", "--device", "cpu"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    padded = tmp_path / "padded"
    shutil.copytree(out, padded)
    tensors = load_file(out / "model.safetensors")
    e, z, h, i = cfg["n_routed_experts"], cfg["zero_expert_num"], cfg["hidden_size"], cfg["expert_ffn_hidden_size"]
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        names = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).state_dict()
    if f"model.layers.0.mlp.experts.{e}.gate_proj.weight" in names:  # (transformers before 5.25)
        for layer in range(cfg["num_layers"]):
            for x in range(e, e + z):
                for kind in ("gate", "up"):
                    tensors[f"model.layers.{layer}.mlp.experts.{x}.{kind}_proj.weight"] = torch.zeros(i, h)
    save_file(tensors, padded / "model.safetensors", metadata={"format": "pt"})
    prompt = list(range(3, 30))
    llm = _llm(out)
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(hf_model(padded), prompt,
                                                                              GREEDY.max_tokens)
    assert_pages_returned(llm)
    dummy = tmp_path / "longcat-dummy"
    assert module.main(["--shape", "longcat-flash-tiny", "--out", str(dummy), "--config-only"]) == 0
    llm = _llm(dummy, load_format="dummy")
    assert len(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert_pages_returned(llm)
    cut = tmp_path / "longcat-cut"
    assert module.main(["--shape", "longcat-flash-cut", "--out", str(cut), "--config-only"]) == 0
    cfg = json.loads((cut / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"],
            cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["ffn_hidden_size"],
            cfg["expert_ffn_hidden_size"], cfg["moe_topk"], cfg["routed_scaling_factor"]) == \
        (6144, 64, 1536, 512, 128, 64, 128, 12288, 2048, 12, 6.0)
    assert cfg["n_routed_experts"] == 2 * cfg["zero_expert_num"]
    # Back to the published 28 layers and 512 + 256 experts, as the engine builds it: the published 560 B parameters.
    from atlas.bench.roofline import ModelShape

    shape = ModelShape.from_config(dict(cfg, num_layers=28, n_routed_experts=512, zero_expert_num=256))
    assert shape.non_embedding_params + 2 * shape.embedding_params == pytest.approx(560e9, rel=0.01)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parallel_matches_one_device(longcat, tp, pp):
    """Two ranks on gloo (tests/test_parallel.py's comparison: logprobs, greedy tokens with preemption and prefix
    hits, seeded samples and n-gram drafts as on one device): tensor parallelism shards both MLA sublayers' heads,
    the dense MLPs and the routed experts (the zero experts' identity added once, after the reduction); two pipeline
    stages of one decoder layer each, its two latent caches with it."""
    from test_parallel import ENGINE, PARALLEL, check_against_one_device

    from atlas import LLM

    llm = LLM(str(longcat), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE, **PARALLEL)
    try:
        check_against_one_device(llm, {"longcat": longcat}, "longcat")
    finally:
        llm.shutdown()
