"""Block-scaled FP8 checkpoints (the DeepSeek-V3 / Qwen -FP8 layout) load, dequantized: the same logits and greedy
tokens as the checkpoint of their dequantized weights. Other FP8 layouts stay refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atlas import LLM, SamplingParams
from atlas.errors import ModelLoadError, UnsupportedModelError

ENGINE = dict(kv_cache_memory="4MiB", max_model_len=128)
BLOCK = [32, 32]  # (the tiny model's 64-wide layers then hold several blocks; real checkpoints use 128)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    br, bc = BLOCK
    blocks = w.float().reshape(rows // br, br, cols // bc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return q, scale


@pytest.fixture(scope="module")
def fp8_pair(qwen3_dir, tmp_path_factory):
    """(an FP8 checkpoint of the tiny model, the checkpoint of its dequantized weights)."""
    root = tmp_path_factory.mktemp("fp8")
    fp8, ref = root / "fp8", root / "dequantized"
    shutil.copytree(qwen3_dir, fp8)
    shutil.copytree(qwen3_dir, ref)
    state = load_file(str(qwen3_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in state.items():
        if name.endswith("proj.weight") and w.dim() == 2:
            q, scale = _quantize(w)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            dequantized[name] = (q.float() * scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
                                 ).to(w.dtype)
        else:
            quantized[name] = dequantized[name] = w
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": BLOCK, "activation_scheme": "dynamic",
                                     "fmt": "e4m3"}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, ref


def test_fp8_block_checkpoint_equals_its_dequantized_weights(fp8_pair):
    fp8, ref = fp8_pair
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    prompts = [[5, 6, 7, 8], list(range(20, 70))]
    got = LLM(str(fp8), **ENGINE).generate([{"prompt_token_ids": p} for p in prompts], params)
    want = LLM(str(ref), **ENGINE).generate([{"prompt_token_ids": p} for p in prompts], params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}


def test_the_e4m3_format_under_either_name_loads_and_another_is_refused(fp8_pair, tmp_path):
    """quant_method fp8's fmt: DeepSeek's "e4m3" and MiniMax-M2's "float8_e4m3fn" name the one format; e5m2 is
    refused."""
    fp8, _ = fp8_pair
    prompt = [{"prompt_token_ids": list(range(20, 40))}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(str(fp8), **ENGINE).generate(prompt, params)[0].outputs[0].token_ids
    for fmt in ("float8_e4m3fn", "e5m2"):
        other = tmp_path / fmt
        shutil.copytree(fp8, other)
        config = json.loads((other / "config.json").read_text())
        config["quantization_config"]["fmt"] = fmt
        (other / "config.json").write_text(json.dumps(config))
        if fmt == "e5m2":
            with pytest.raises(UnsupportedModelError, match="fmt e5m2"):
                LLM(str(other), **ENGINE)
        else:
            assert LLM(str(other), **ENGINE).generate(prompt, params)[0].outputs[0].token_ids == want


def test_other_fp8_layouts_and_broken_ones_are_refused(fp8_pair, tmp_path):
    fp8, _ = fp8_pair
    static = tmp_path / "static"
    shutil.copytree(fp8, static)
    config = json.loads((static / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (static / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quantized"):
        LLM(str(static), **ENGINE)
    missing = tmp_path / "missing"
    shutil.copytree(fp8, missing)
    state = load_file(str(missing / "model.safetensors"))
    del state[next(n for n in state if n.endswith("_scale_inv"))]
    save_file(state, str(missing / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="has no weight_scale_inv"):
        LLM(str(missing), **ENGINE)
