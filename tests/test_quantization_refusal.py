"""Quantized checkpoints: block-scaled FP8 loads (dequantized) in every family; every other method is refused, with
the method named, before a weight is read.

An FP8 block-scaled checkpoint (the Qwen -FP8 / DeepSeek-V3 layout) used to load into the Llama family with its
scales "ignored" and its FP8 values cast, and to generate wrong tokens. Here every family loads it as exactly its
dequantized weights, and every family, the DFlash drafter, `atlas.LLM` and the `atlas` command refuse the other
quantized checkpoints written from the tiny random models: by their config.json, and by their tensors where the
config says nothing.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ARCHS
from safetensors.torch import load_file, save_file
from test_dflash import write_drafter

import atlas.models.loader as loader
from atlas import LLM
from atlas.config import ModelConfig
from atlas.errors import UnsupportedModelError
from atlas.models.quantization import refuse_quantized

FAMILIES = [*ARCHS, "deepseek-v2-lite", "deepseek-v3"]
BLOCK = [16, 16]  # (the tiny shapes are smaller than Qwen's 128 x 128 blocks)
FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": BLOCK, "activation_scheme": "dynamic", "fmt": "e4m3"}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}


def _source(family: str, checkpoints, deepseek_checkpoints) -> Path:
    return deepseek_checkpoints[family.removeprefix("deepseek-")] if family.startswith("deepseek") else checkpoints[family]


def _is_linear(name: str, tensor: torch.Tensor) -> bool:
    """The weights a -FP8 checkpoint quantizes: every projection (embedding, LM head, norms and routers stay)."""
    return tensor.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


def fp8_block_quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and their float32 inverse scale per block (partial blocks at the edges), as
    DeepSeek-V3 and Qwen -FP8 store them: w ~= fp8 * scale_inv, block by block."""
    rows, cols = w.shape
    br, bc = block
    scale_inv = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    finfo = torch.finfo(torch.float8_e4m3fn)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            s = tile.abs().max().clamp(min=1e-12) / finfo.max
            scale_inv[i, j] = s
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / s).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
    return q, scale_inv


def _rewrite(src: Path, dst: Path, tensors, config: dict | None) -> Path:
    """A copy of checkpoint src with its tensors rewritten by tensors(name, tensor) -> {name: tensor} and
    quantization_config set to `config` (None: none)."""
    shutil.copytree(src, dst)
    weights = {}
    for name, t in load_file(str(dst / "model.safetensors")).items():
        weights |= tensors(name, t)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw.pop("quantization_config", None)
    if config is not None:
        raw["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def fp8_checkpoint(src: Path, dst: Path, config: dict | None = FP8_CONFIG, scales: bool = True) -> Path:
    def quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not _is_linear(name, t):
            return {name: t}
        q, scale_inv = fp8_block_quantize(t, BLOCK)
        assert torch.allclose(_dequantize(q, scale_inv), t.float(), rtol=0.07, atol=1e-6)  # (a real FP8 checkpoint)
        return {name: q, f"{name}_scale_inv": scale_inv} if scales else {name: q}
    return _rewrite(src, dst, quantize, config)


def _dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    s = scale_inv.repeat_interleave(BLOCK[0], 0)[:q.shape[0]].repeat_interleave(BLOCK[1], 1)[:, :q.shape[1]]
    return q.float() * s


def awq_checkpoint(src: Path, dst: Path) -> Path:
    """AutoAWQ's layout (GEMM version): each projection as qweight [in, out / 8] (int32, eight 4-bit values
    each), qzeros [in / group, out / 8] and fp16 scales [in / group, out]; no `.weight`."""
    def pack(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not _is_linear(name, t):
            return {name: t}
        out, inp = t.shape
        base = name.removesuffix(".weight")
        groups = max(1, inp // AWQ_CONFIG["group_size"])
        return {f"{base}.qweight": torch.randint(-2**31, 2**31 - 1, (inp, max(1, out // 8)), dtype=torch.int32),
                f"{base}.qzeros": torch.randint(-2**31, 2**31 - 1, (groups, max(1, out // 8)), dtype=torch.int32),
                f"{base}.scales": torch.rand(groups, out).to(torch.float16)}
    return _rewrite(src, dst, pack, AWQ_CONFIG)


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The safetensors files Atlas opens (its loader's own safe_open, wrapped to record the path)."""
    files: list[str] = []
    real = loader.safe_open

    def recording(path, *args, **kwargs):
        files.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", recording)
    return files


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw})


# --------------------------------------------------------------------------- block-scaled FP8: loaded, dequantized
STATIC_FP8_CONFIG = {**FP8_CONFIG, "activation_scheme": "static"}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_block_checkpoint_loads_as_its_dequantized_weights(family, checkpoints, deepseek_checkpoints,
                                                                   tmp_path):
    """Every family (DeepSeek's experts included): the same greedy tokens and logprobs as the checkpoint of the
    dequantized weights, exactly (the same values reach the same float32 model)."""
    from atlas import SamplingParams

    source = _source(family, checkpoints, deepseek_checkpoints)
    fp8 = fp8_checkpoint(source, tmp_path / "fp8")
    pairs = {}

    def dequantized(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not _is_linear(name, t):
            return {name: t}
        q, scale_inv = fp8_block_quantize(t, BLOCK)
        pairs[name] = True
        return {name: _dequantize(q, scale_inv).to(t.dtype)}

    reference = _rewrite(source, tmp_path / "dequantized", dequantized, None)
    assert pairs  # (the family's projections were quantized)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(20, 44))}]
    got, want = _llm(fp8).generate(prompts, params), _llm(reference).generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in e.items()} for e in g.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in e.items()} for e in w.outputs[0].logprobs]


# --------------------------------------------------------------------------- by config.json, before any weight
@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_checkpoint_with_static_activation_scales_is_refused_before_any_weight_is_read(
        family, checkpoints, deepseek_checkpoints, tmp_path, opened):
    path = fp8_checkpoint(_source(family, checkpoints, deepseek_checkpoints), tmp_path / "fp8", STATIC_FP8_CONFIG)
    with pytest.raises(UnsupportedModelError) as info:
        _llm(path)
    message = str(info.value)
    assert r"quantized (fp8, block [16, 16]" in message and "quantization_config" in message
    assert "float32, float16 or bfloat16" in message and "bf16 checkpoint" in message
    assert opened == []  # refused from config.json alone


def test_dummy_weights_of_a_quantized_config_are_refused_too(qwen3_dir, tmp_path, opened):
    """--load-format dummy measures the speed of a shape: of a bf16 model, not of the quantized one it names."""
    path = fp8_checkpoint(qwen3_dir, tmp_path / "fp8", STATIC_FP8_CONFIG)
    with pytest.raises(UnsupportedModelError, match=r"quantized \(fp8, block \[16, 16\]"):
        _llm(path, load_format="dummy")
    assert opened == []


@pytest.mark.parametrize("family", FAMILIES)
def test_an_awq_checkpoint_is_refused_naming_awq_not_missing_weights(family, checkpoints, deepseek_checkpoints,
                                                                      tmp_path, opened):
    path = awq_checkpoint(_source(family, checkpoints, deepseek_checkpoints), tmp_path / "awq")
    with pytest.raises(UnsupportedModelError, match=r"quantized \(awq, 4-bit, group size 128: AWQ") as info:
        _llm(path)
    assert "missing weight" not in str(info.value)
    assert opened == []


def test_a_gguf_folder_or_file_is_refused_naming_gguf(tmp_path, qwen3_dir):
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "Qwen3-8B-Q4_K_M.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    with pytest.raises(UnsupportedModelError, match=r"holds GGUF weights \(Qwen3-8B-Q4_K_M.gguf\)"):
        _llm(gguf)
    with pytest.raises(UnsupportedModelError, match="holds GGUF weights"):
        _llm(gguf / "Qwen3-8B-Q4_K_M.gguf")
    # With the model's config.json and tokenizer beside it, but no safetensors.
    for f in qwen3_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, gguf / f.name)
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        _llm(gguf)


# --------------------------------------------------------------------------- by tensor, when config.json is silent
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_tensors_without_a_quantization_config_are_refused_naming_the_scales(family, checkpoints,
                                                                                 deepseek_checkpoints, tmp_path):
    path = fp8_checkpoint(_source(family, checkpoints, deepseek_checkpoints), tmp_path / "fp8", config=None)
    with pytest.raises(UnsupportedModelError, match=r"quantization scales \(model\.layers\.\d+\.\S+_proj\S*"
                                                    r"\.weight_scale_inv.*FP8 block-quantized"):
        _llm(path)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_a_weight_of_a_quantized_dtype_is_refused_not_cast(dtype, qwen3_dir, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    path = _rewrite(qwen3_dir, tmp_path / "m",
                    lambda n, t: {n: t.clamp(-100, 100).to(dtype) if n == name else t}, None)
    kind = str(dtype).removeprefix("torch.")
    with pytest.raises(UnsupportedModelError, match=rf"stores weight {name} as {kind}.*no quantization_config"):
        _llm(path)
    # The same through lazy safetensors slices (what tensor-parallel ranks read).
    cfg = ModelConfig.from_path(path)
    with loader.constructing(torch.device("cpu"), torch.float32):
        model = loader.model_class(cfg)(cfg, 64)
    with pytest.raises(UnsupportedModelError, match=rf"stores weight {name} as {kind}"):
        model.load_weights(loader.iterate_weights(loader.safetensors_files(path), lazy=True))


def test_a_quantized_tensor_outside_a_declared_method_is_refused_naming_the_method(qwen3_dir, tmp_path):
    """A declared FP8 checkpoint whose embedding (kept in floating point) is stored in float8 too: refused, and the
    message names the declared method instead of saying config.json has none."""
    fp8 = fp8_checkpoint(qwen3_dir, tmp_path / "fp8")
    name = "model.embed_tokens.weight"
    path = _rewrite(fp8, tmp_path / "embed", lambda n, t: {n: t.to(torch.float8_e4m3fn) if n == name else t},
                    FP8_CONFIG)
    with pytest.raises(UnsupportedModelError, match=rf"stores weight {name} as float8_e4m3fn, for a parameter that "
                                                    r"Atlas keeps in floating point under its declared quantization "
                                                    r"\(fp8\)") as info:
        _llm(path)
    assert "no quantization_config" not in str(info.value)


# --------------------------------------------------------------------------- the DFlash drafter
def _drafter(root: Path) -> Path:
    return write_drafter(root, hidden=64, layer_ids=[0, 1], mask_token_id=383, heads=4, kv_heads=2, head_dim=16,
                         dflash_extra={"block_size": 5})


@pytest.mark.parametrize("with_config", [True, False])
def test_an_fp8_dflash_drafter_is_refused_before_its_weights_are_read(with_config, qwen3_dir, tmp_path, opened):
    drafter = fp8_checkpoint(_drafter(tmp_path / "bf16"), tmp_path / "fp8", config=FP8_CONFIG if with_config else None)
    match = (r"DFlash drafter \S+ is quantized \(fp8, block \[16, 16\]" if with_config
             else r"quantization scales \(layers\.0\.\S+\.weight_scale_inv")
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(str(qwen3_dir), speculative="dflash", draft_model=str(drafter), kv_cache_memory="8MiB",
            skip_tokenizer_init=True)
    assert str(qwen3_dir / "model.safetensors") in opened  # (the target loads first)
    assert (str(drafter / "model.safetensors") in opened) == (not with_config)  # (with a config: never opened)


# --------------------------------------------------------------------------- every method, by name
@pytest.mark.parametrize("method", [
    "fp8", "awq", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "compressed-tensors", "modelopt",
    "modelopt_fp4", "fbgemm_fp8", "mxfp4", "gguf", "hqq", "eetq", "quark", "torchao", "my-new-quant"])
def test_every_quant_method_is_refused_by_name(method, tmp_path):
    with pytest.raises(UnsupportedModelError, match=rf"is quantized \({method}[,:].*Atlas does not implement"):
        refuse_quantized({"quantization_config": {"quant_method": method}}, tmp_path, "checkpoint")


@pytest.mark.parametrize("raw, side_file, match", [
    ({"compression_config": {"format": "int-quantized"}}, None,
     r"compressed-tensors, format int-quantized.*compression_config in"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                              "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                                        "strategy": "channel"}}}}}, None,
     r"weights float 8-bit, channel"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}},
     None, r"bitsandbytes, 4-bit, nf4"),
    ({}, ("quantize_config.json", {"bits": 4, "group_size": 128, "desc_act": False}), r"gptq, 4-bit, group size 128"),
    ({}, ("quant_config.json", {"w_bit": 4, "q_group_size": 128, "zero_point": True}), r"awq, 4-bit, group size 128"),
    ({}, ("hf_quant_config.json", {"quantization": {"quant_algo": "NVFP4"}}), r"modelopt, quant algo NVFP4"),
])
def test_other_quantization_configs_are_refused_with_their_detail(raw, side_file, match, tmp_path):
    if side_file is not None:
        (tmp_path / side_file[0]).write_text(json.dumps(side_file[1]))
    with pytest.raises(UnsupportedModelError, match=match):
        refuse_quantized(raw, tmp_path, "checkpoint")
    refuse_quantized({"quantization_config": None}, tmp_path / "elsewhere")  # (null says nothing)


# --------------------------------------------------------------------------- the command line
def test_atlas_generate_exits_non_zero_with_the_refusal(qwen3_dir, tmp_path):
    path = fp8_checkpoint(qwen3_dir, tmp_path / "fp8", STATIC_FP8_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "atlas.cli", "--log-level", "warning", "generate", "--model",
                           str(path), "--prompt", "def wrap(text):", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "is quantized (fp8, block [16, 16]" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
