"""tools/fp8_perplexity.py measures what it says: the engine's summed prompt log-probabilities over the held-out
windows equal transformers' next-token NLL of the same tokens, and its block-quantized checkpoint is the published
layout (each weight within FP8's rounding of the original, one float32 scale a 128 x 128 tile)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fp8_perplexity as tool  # noqa: E402

from atlas import LLM  # noqa: E402
from atlas.training.evaluate import lm_nll  # noqa: E402


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return tool.held_out_tokens(tool.DEFAULT_MODEL, 600)


def test_the_engine_scores_equal_transformers_nll(tokens):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tool.DEFAULT_MODEL), dtype=torch.float32)
    expected = lm_nll(model, torch.tensor(tokens), 256, 4, "cpu")
    llm = LLM(str(tool.DEFAULT_MODEL), dtype="float32", max_model_len=260, kv_cache_memory="16MiB",
              enable_prefix_caching=False)
    nll, count = tool.score(llm, tokens, 256)
    assert count == expected.tokens == 600
    assert nll == pytest.approx(expected.total, rel=1e-4)
    assert math.exp(nll / count) > 1.0


def test_the_block_checkpoint_is_the_published_layout(tmp_path):
    dst = tool.write_block_checkpoint(tool.DEFAULT_MODEL, tmp_path / "fp8")
    q = load_file(str(dst / "model.safetensors"))
    plain = load_file(str(tool.DEFAULT_MODEL / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    w, s = q[name], q["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    deq = w.float() * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
    ref = plain[name].float()
    assert ((deq - ref).abs() <= ref.abs() * 2 ** -4 + s.max() * 2 ** -9).all()  # (e4m3: half of 3 mantissa bits)
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert q["model.embed_tokens.weight"].dtype == plain["model.embed_tokens.weight"].dtype
