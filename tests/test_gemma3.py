"""Gemma 3's text model against transformers (fp32, CPU): logits of prefill and of chunked prefill + decode steps
across its local window, both config forms (transformers >= 5's rope_parameters by layer type and layer_types;
the published rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern), and the refusals.
Greedy generation, prefix caching and speculation over windows: test_sliding_window.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_gemma3_checkpoint, hf_model
from test_models import atlas_logits

from atlas import LLM
from atlas.config import ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return build_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))


def _published_form(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint whose config.json says the same in the form of the published Gemma 3 configs."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    del raw["layer_types"]
    raw |= {"sliding_window_pattern": 3, "rope_theta": rope["full_attention"]["rope_theta"],
            "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
            "rope_scaling": {"rope_type": "linear", "factor": rope["full_attention"]["factor"]}}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_transformers_in_both_config_forms(gemma3, tmp_path):
    ids = _ids(45, 1)
    with torch.no_grad():
        expected = hf_model(gemma3)(torch.tensor([ids])).logits[0].float()
    assert float(expected.abs().max()) < 20.0  # (final_logit_softcapping 20)
    for path in (gemma3, _published_form(gemma3, tmp_path / "published")):
        llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, skip_tokenizer_init=True)
        assert llm.engine.kv.sliding_window is None  # (a global layer: pages are kept)
        torch.testing.assert_close(atlas_logits(llm, ids, [45]), expected, rtol=1e-4, atol=1e-4)
        # Chunks and decodes whose queries straddle the 12-token window, over pages of 4.
        torch.testing.assert_close(atlas_logits(llm, ids, [7, 13, 10] + [1] * 15), expected, rtol=1e-4, atol=1e-4)


def test_config_forms_read_alike(gemma3, tmp_path):
    from atlas.models.gemma3 import gemma3_ropes, gemma3_windows

    new = ModelConfig.from_path(gemma3)
    old = ModelConfig.from_path(_published_form(gemma3, tmp_path / "published"))
    assert gemma3_windows(new) == gemma3_windows(old) == [12, 12, None]
    ropes_new, ropes_old = gemma3_ropes(new), gemma3_ropes(old)
    for kind in ropes_new:
        assert (ropes_new[kind].theta, ropes_new[kind].rope_type) == (ropes_old[kind].theta, ropes_old[kind].rope_type)
    assert ropes_old["full_attention"].params["factor"] == 2.0
    assert ropes_old["sliding_attention"].rope_type == "default"  # (the scaling is the global layers')


def _config(**fields) -> ModelConfig:
    raw = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=32, hidden_size=16,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
               **fields)
    return ModelConfig.from_dict(raw, Path("/ckpt"))


@pytest.mark.parametrize("field, value, named", [
    ("attn_logit_softcapping", 50.0, "eager attention and not with SDPA"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_what_the_reference_does_not_settle_is_refused_by_name(field, value, named):
    from atlas.models.gemma3 import Gemma3ForCausalLM

    with pytest.raises(UnsupportedModelError, match=named):
        Gemma3ForCausalLM(_config(**{field: value}), 64)
    Gemma3ForCausalLM(_config(**{field: None}), 64)  # (null, as Gemma 3 ships it: fine)


def _image_text_checkpoint(text_model: Path, root: Path) -> Path:
    """A tiny Gemma3ForConditionalGeneration whose language model is the text checkpoint's (a one-layer SigLIP
    tower and projector beside it)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = json.loads((text_model / "config.json").read_text())
    text.pop("architectures")
    text["final_logit_softcapping"] = None  # (as published; the image-text class of transformers ignores it)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=383,
                       boi_token_index=381, eoi_token_index=382)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    lm = hf_model(text_model)
    missing, unexpected = model.model.language_model.load_state_dict(lm.model.state_dict(), strict=False)
    assert not missing and not unexpected
    model.tie_weights()
    out = root / "gemma3-image-text"
    model.save_pretrained(out)
    return out


def test_the_image_text_checkpoint_serves_its_language_model_on_text(gemma3, tmp_path, caplog):
    """gemma-3-4b and larger are Gemma3ForConditionalGeneration checkpoints: on text prompts, Atlas's logits are
    transformers' (the image placeholder id is an ordinary in-vocabulary token without an image, as there), and
    the vision tower's tensors are skipped with a log line."""
    import logging

    from transformers import Gemma3ForConditionalGeneration

    path = _image_text_checkpoint(gemma3, tmp_path)
    ids = _ids(30, 4)
    ids[9] = 383
    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].float()
    with caplog.at_level(logging.INFO, logger="atlas.models.base"):
        llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, skip_tokenizer_init=True)
    skipped = sum(n.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for n in model.state_dict())
    assert skipped and f"projector's {skipped} tensors are not loaded" in caplog.text
    torch.testing.assert_close(atlas_logits(llm, ids, [30]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [11, 13, 6]), expected, rtol=1e-4, atol=1e-4)
    # A cap in an image-text checkpoint: transformers' two Gemma 3 classes disagree on it, so it is refused.
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["final_logit_softcapping"] = 30.0
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping = 30.0 in the text_config"):
        LLM(str(path), kv_cache_memory="4MiB", block_size=4, skip_tokenizer_init=True)


def test_a_text_config_of_some_sizes_is_read_with_the_class_defaults(tmp_path):
    """The published gemma-3-4b config gives its text_config's sizes that differ from Gemma3TextConfig's defaults
    and nothing else: the rest (heads, head size, vocabulary, the layer pattern, both RoPEs) is transformers'."""
    from atlas.models.gemma3 import gemma3_ropes, gemma3_windows

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "image_token_index": 262144,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    cfg = ModelConfig.from_dict(raw, tmp_path)
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (262208, 8, 4, 256)
    assert gemma3_windows(cfg) == ([1024] * 5 + [None]) * 5 + [1024] * 4
    ropes = gemma3_ropes(cfg)
    assert (ropes["full_attention"].theta, ropes["full_attention"].rope_type) == (1e6, "linear")
    assert ropes["full_attention"].params["factor"] == 8.0
    assert (ropes["sliding_attention"].theta, ropes["sliding_attention"].rope_type) == (1e4, "default")
    raw["text_config"]["model_type"] = "no_such_model"
    with pytest.raises(ModelLoadError, match="text_config .* has no vocab_size, num_attention_heads"):
        ModelConfig.from_dict(raw, tmp_path)


def test_default_layer_pattern_and_window():
    """Without layer_types: every sixth layer global (sliding_window_pattern 6), window 4096 (transformers'
    Gemma3TextConfig defaults)."""
    from atlas.models.gemma3 import gemma3_windows

    raw = _config().raw | {"num_hidden_layers": 12}
    assert gemma3_windows(ModelConfig.from_dict(raw, Path("/ckpt"))) == ([4096] * 5 + [None]) * 2
