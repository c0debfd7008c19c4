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
from atlas.errors import UnsupportedModelError


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
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_what_the_kernels_do_not_compute_is_refused_by_name(field, value, named):
    from atlas.models.gemma3 import Gemma3ForCausalLM

    with pytest.raises(UnsupportedModelError, match=named):
        Gemma3ForCausalLM(_config(**{field: value}), 64)
    Gemma3ForCausalLM(_config(**{field: None}), 64)  # (null, as Gemma 3 ships it: fine)


def test_the_image_text_checkpoint_is_refused_naming_the_vision_tower():
    from atlas.models.registry import model_class

    cfg = _config()
    cfg.architecture = "Gemma3ForConditionalGeneration"
    with pytest.raises(UnsupportedModelError, match="vision tower"):
        model_class(cfg)


def test_default_layer_pattern_and_window():
    """Without layer_types: every sixth layer global (sliding_window_pattern 6), window 4096 (transformers'
    Gemma3TextConfig defaults)."""
    from atlas.models.gemma3 import gemma3_windows

    raw = _config().raw | {"num_hidden_layers": 12}
    assert gemma3_windows(ModelConfig.from_dict(raw, Path("/ckpt"))) == ([4096] * 5 + [None]) * 2
