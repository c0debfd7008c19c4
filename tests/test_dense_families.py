"""Dense families beside the Llama ones (Phi-3 / Phi-4, Granite 3, OLMo 2 and 3, GLM-4 (both forms), EXAONE 4, SmolLM3, Seed-OSS,
ERNIE 4.5, Apertus, Arcee, HunYuan, Helium), beyond tests/test_models.py's logits and greedy tokens against transformers: two tensor-parallel ranks
(gloo) give one device's tokens (Phi's fused q|k|v and Phi's and GLM's gate|up split before they are sharded;
Granite's residual multiplier folded into each rank's shard; OLMo's whole-projection q / k norms summing their squares
over the ranks), prefix caching changes nothing, and the families whose FP8 checkpoints and LoRA adapters the
existing paths do not read exactly refuse them by name."""

from __future__ import annotations

import pytest
from conftest import assert_pages_returned

from atlas import LLM, SamplingParams
from atlas.errors import AtlasError

ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
PROMPTS = [[5, 9, 13, 2, 7, 11] * 5, [40, 41, 3, 99, 17], list(range(20, 61))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


# (the families whose FP8 checkpoints and LoRA adapters are refused; the others' layers are Llama's)
REFUSING = ["Phi3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Glm4ForCausalLM",
            "GlmForCausalLM", "Exaone4ForCausalLM", "ApertusForCausalLM", "ArceeForCausalLM"]
FAMILIES = [*REFUSING, "SmolLM3ForCausalLM", "SeedOssForCausalLM", "Ernie4_5ForCausalLM", "HunYuanDenseV1ForCausalLM",
            "HeliumForCausalLM"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_tensor_parallel_and_prefix_caching_keep_the_tokens(checkpoints, arch):
    from test_parallel import PARALLEL

    path = str(checkpoints[arch])
    plain = LLM(path, **ENGINE)
    want = _tokens(plain)
    assert _tokens(plain) == want  # (the second pass reads the prefix cache)
    assert plain.engine.kv.enable_prefix_caching
    assert_pages_returned(plain)
    del plain
    tp = LLM(path, tensor_parallel_size=2, **ENGINE, **PARALLEL)
    try:
        assert _tokens(tp) == want
    finally:
        tp.shutdown()


@pytest.mark.parametrize("arch", REFUSING)
def test_fp8_and_lora_are_refused_naming_the_family(checkpoints, arch):
    path = str(checkpoints[arch])
    with pytest.raises(AtlasError, match=arch):
        LLM(path, quantization="fp8", **ENGINE)
    with pytest.raises(AtlasError, match="(?i)lora|adapter"):
        LLM(path, enable_lora=True, **ENGINE)


@pytest.mark.parametrize("pattern", ["LG", 2])
def test_exaone4_layers_from_its_sliding_window_pattern(checkpoints, tmp_path, pattern):
    """A config.json without layer_types windows the layers its sliding_window_pattern marks, as transformers'
    Exaone4Config derives them (the checkpoint's layer_types: sliding then full)."""
    import json
    import shutil

    from conftest import hf_greedy, hf_model

    path = tmp_path / "exaone4"
    shutil.copytree(checkpoints["Exaone4ForCausalLM"], path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["layer_types"]
    cfg["sliding_window_pattern"] = pattern
    (path / "config.json").write_text(json.dumps(cfg))
    want = [hf_greedy(hf_model(checkpoints["Exaone4ForCausalLM"]), p, GREEDY.max_tokens) for p in PROMPTS]
    assert _tokens(LLM(str(path), skip_tokenizer_init=True, **ENGINE)) == want
    cfg["sliding_window_pattern"] = "GL"  # (the other way round: other tokens)
    (path / "config.json").write_text(json.dumps(cfg))
    assert _tokens(LLM(str(path), skip_tokenizer_init=True, **ENGINE)) != want


@pytest.mark.parametrize("fields, refused", [
    ({"use_cla": True, "cla_share_factor": 2}, "use_cla"),
    ({"use_qk_norm": False}, "use_qk_norm"),
    ({"attention_head_dim": 32}, "attention_head_dim=32"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "dynamic"),
])
def test_hunyuan_configs_read_two_ways_or_not_implemented_are_refused(checkpoints, tmp_path, fields, refused):
    """HunYuan: cross-layer attention, use_qk_norm false (transformers keeps the norms, vLLM drops them), an
    attention_head_dim other than the head dim, and dynamic NTK RoPE without an alpha are refused by name; LoRA too."""
    import json
    import shutil

    path = tmp_path / "hunyuan"
    shutil.copytree(checkpoints["HunYuanDenseV1ForCausalLM"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))
    with pytest.raises(AtlasError, match=refused):
        LLM(str(path), **ENGINE)
    with pytest.raises(AtlasError, match="(?i)lora|adapter"):
        LLM(str(checkpoints["HunYuanDenseV1ForCausalLM"]), enable_lora=True, **ENGINE)
