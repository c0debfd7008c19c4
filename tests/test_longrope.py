"""LongRoPE (Phi-3.5 / Phi-4-mini's 128k RoPE): per-frequency short and long factors and an attention factor, against
transformers. transformers picks the long factors per forward call when the longest position passes
original_max_position_embeddings; Atlas picks them once from the context it serves (--max-model-len), as vLLM does,
so that a sequence crossing the original length keeps one rotation in its cache. Within either choice the logits and
greedy tokens are transformers'."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import build_checkpoint, hf_greedy, hf_model, random_ids
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams
from atlas.errors import AtlasError

ORIGINAL = 64
# rotary dims 8 of head_dim 16 (partial_rotary_factor 0.5, as Phi-4-mini rotates part of each head): 4 factors each
SHORT = [1.0, 1.3, 1.9, 2.6]
LONG = [1.5, 3.0, 6.5, 11.0]


@pytest.fixture(scope="module")
def phi_longrope(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("longrope")
    return build_checkpoint(root, "Phi3ForCausalLM", tokenizer_dir, seed=3, sliding_window=None,
                            max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
                            partial_rotary_factor=0.5,
                            rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})



def _with_rope(src, dst, **changes):
    """A copy of the checkpoint with rope_parameters' keys changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **changes}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_within_the_original_length_the_short_factors_give_transformers_logits_and_tokens(phi_longrope):
    llm = LLM(str(phi_longrope), kv_cache_memory="4MiB", block_size=8, max_model_len=ORIGINAL)
    ids = random_ids(40, 1)
    torch.testing.assert_close(atlas_logits(llm, ids, [17, 9] + [1] * 14), hf_logits(phi_longrope, ids),
                               rtol=1e-4, atol=1e-4)
    prompt = random_ids(30, 2)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(phi_longrope), prompt, 30)


def test_a_context_past_the_original_length_uses_the_long_factors_throughout(phi_longrope, tmp_path):
    llm = LLM(str(phi_longrope), kv_cache_memory="4MiB", block_size=8, max_model_len=256)
    # a prompt past the original length: transformers' every call uses the long factors too
    ids = random_ids(90, 3)
    torch.testing.assert_close(atlas_logits(llm, ids, [50, 33] + [1] * 7), hf_logits(phi_longrope, ids),
                               rtol=1e-4, atol=1e-4)
    prompt = random_ids(70, 4)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(phi_longrope), prompt, 20)
    # a short prompt in this engine is rotated by the long factors as well: transformers' short path with the long
    # factors written in its place is its reference, and the checkpoint's own short factors differ
    short = random_ids(24, 5)
    long_everywhere = _with_rope(phi_longrope, tmp_path / "long", short_factor=LONG)
    got = atlas_logits(llm, short, [24])
    torch.testing.assert_close(got, hf_logits(long_everywhere, short), rtol=1e-4, atol=1e-4)
    assert (got - hf_logits(phi_longrope, short)).abs().max() > 1e-2


def test_the_attention_factor_is_the_configs_where_given(phi_longrope, tmp_path):
    scaled = _with_rope(phi_longrope, tmp_path / "scaled", attention_factor=1.3)
    llm = LLM(str(scaled), kv_cache_memory="4MiB", block_size=8, max_model_len=ORIGINAL)
    ids = random_ids(32, 6)
    got = atlas_logits(llm, ids, [32])
    torch.testing.assert_close(got, hf_logits(scaled, ids), rtol=1e-4, atol=1e-4)
    assert (got - hf_logits(phi_longrope, ids)).abs().max() > 1e-2


def test_malformed_factors_and_the_mscale_keys_are_refused_by_name(phi_longrope, tmp_path):
    # (without a tokenizer: transformers' tokenizer loader validates the config first, with its own message)
    bad = _with_rope(phi_longrope, tmp_path / "bad", short_factor=SHORT[:3])
    with pytest.raises(AtlasError, match="short_factor must be a list of 4 positive numbers"):
        LLM(str(bad), kv_cache_memory="4MiB", max_model_len=ORIGINAL, skip_tokenizer_init=True)
    mscale = _with_rope(phi_longrope, tmp_path / "mscale", long_mscale=1.2)
    with pytest.raises(AtlasError, match="long_mscale is not supported"):
        LLM(str(mscale), kv_cache_memory="4MiB", max_model_len=ORIGINAL, skip_tokenizer_init=True)
