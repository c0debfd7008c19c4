"""FP8 linear layers on CPU: every FP8 checkpoint layout Atlas loads keeps its linear weights in float8 with their
scales, and computes what the same checkpoint dequantized computes; --quantization fp8; TP=2 (gloo) against one
device; the kernels in Triton's interpreter; refusals of what is not implemented.

Tolerances. On CPU an FP8 layer's forward is the reference: it dequantizes (FP8 value x scale in float32, then to
the activation dtype, float32 here) and multiplies with F.linear, so a checkpoint and the checkpoint of its
dequantized weights give the same logprobs to the bit and the same greedy tokens: the tests say `==`. (Per-tensor
scales are stored per output row, which multiplies each weight by the same float32 number.) --quantization fp8
changes the weights (each rounded to 8 bits): its logprobs are compared with the plain model's within 0.25 nats on
this tiny random model (an e4m3 weight carries up to 2^-4 relative error; the sums keep some of it), and exactly with the checkpoint of the same quantized weights, dequantized. Tensor
parallelism sums partial products in another order: logprobs within 1e-4, tokens equal.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_same_tokens_and_logprobs,
    build_checkpoint,
    build_gemma3_checkpoint,
    run_in_triton_interpreter,
    tool_module,
)
from safetensors.torch import load_file, save_file

import atlas.models.loader as loader
from atlas import LLM, SamplingParams
from atlas.config import ModelConfig
from atlas.errors import ConfigError, ModelLoadError, UnsupportedModelError
from atlas.kernels import settings as kernel_settings
from atlas.kernels.fp8_linear import FP8_MAX, dequantize
from atlas.layers.linear import Linear

ENGINE = dict(kv_cache_memory="4MiB", max_model_len=128, block_size=8, skip_tokenizer_init=True)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(20, 50))}]
BLOCK = [16, 16]  # (the tiny model's 64-wide layers hold several blocks; published checkpoints use 128 x 128)


def _is_linear(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


def quantize(w: torch.Tensor, layout: str, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and their float32 scales as each layout stores them: block [rows/bn, cols/bk]; channel [N, 1];
    tensor one number (shape [])."""
    w = w.float()
    if layout == "block":  # (partial blocks at the ends: padded with zeros, which change no block's amax)
        bn, bk = block
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
        tiles = padded.view(-(-n // bn), bn, -(-k // bk), bk)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
        q = (tiles / scale[:, None, :, None]).view(padded.shape)[:n, :k].contiguous()
        return q.to(torch.float8_e4m3fn), scale
    if layout == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        return (w / scale).to(torch.float8_e4m3fn), scale
    scale = w.abs().amax() / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn), scale


def _deq(q: torch.Tensor, scale: torch.Tensor, layout: str, block=BLOCK) -> torch.Tensor:
    if layout == "block":
        return dequantize(q, scale, tuple(block), torch.float32)
    return dequantize(q, scale.reshape(-1).expand(q.shape[0]).contiguous(), None, torch.float32)


def _ct(strategy: str, acts: dict | None) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    if strategy == "block":
        weights["block_structure"] = BLOCK
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
_STATIC = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
# layout name -> (quantization_config, weight layout, scale tensor name, static input scales?)
LAYOUTS = {
    "fp8-block": ({"quant_method": "fp8", "weight_block_size": BLOCK, "activation_scheme": "dynamic"}, "block",
                  "weight_scale_inv", False),
    "fp8-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor", "weight_scale", True),
    "fp8-tensor-dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]},
                           "tensor", "weight_scale", False),
    "fbgemm-channel": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                        "modules_to_not_convert": ["lm_head"]}, "channel", "weight_scale", False),
    "modelopt-tensor": ({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}, "tensor",
                        "weight_scale", True),
    "ct-channel-token": (_ct("channel", _TOKEN), "channel", "weight_scale", False),
    "ct-tensor-static": (_ct("tensor", _STATIC), "tensor", "weight_scale", True),
    "ct-block": (_ct("block", {**_TOKEN, "strategy": "group", "group_size": 16}), "block", "weight_scale", False),
}


def write_pair(src: Path, root: Path, layout_name: str, keep_plain: tuple[str, ...] = (),
               block: list[int] = BLOCK) -> tuple[Path, Path]:
    """(an FP8 checkpoint of src in the layout, the checkpoint of its dequantized weights). keep_plain: weights
    left unquantized (as a quantizer's ignore list leaves them); block: a block layout's block."""
    config, layout, scale_name, static = LAYOUTS[layout_name]
    if layout == "block":
        config = {**config, "weight_block_size": block}
    fp8, ref = root / "fp8", root / "dequantized"
    shutil.copytree(src, fp8)
    shutil.copytree(src, ref)
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if _is_linear(name, w) and not name.startswith(keep_plain):
            q, scale = quantize(w, layout, block)
            base = name.removesuffix(".weight")
            quantized[name], quantized[f"{base}.{scale_name}"] = q, scale
            if static:
                quantized[f"{base}.input_scale"] = torch.tensor(0.02 + 0.01 * (len(quantized) % 3))
            dequantized[name] = _deq(q, scale, layout, block).to(w.dtype)
        else:
            quantized[name] = dequantized[name] = w
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    raw = json.loads((fp8 / "config.json").read_text())
    raw["quantization_config"] = config
    (fp8 / "config.json").write_text(json.dumps(raw))
    return fp8, ref


def _outputs(llm: LLM) -> list[tuple[list[int], list[dict]]]:
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in llm.generate(PROMPTS, PARAMS)]


def _fp8_layers(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.fp8 is not None]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_fp8_layout_keeps_fp8_weights_and_equals_its_dequantized_checkpoint(layout, qwen3_dir, tmp_path):
    fp8, ref = write_pair(qwen3_dir, tmp_path, layout)
    llm = LLM(str(fp8), **ENGINE)
    layers = _fp8_layers(llm)
    assert len(layers) == 8  # q|k|v, o, gate|up, down of both layers
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float32 for m in layers)
    assert all((m._parameters.get("input_scale") is not None) == LAYOUTS[layout][3] for m in layers)
    assert _outputs(llm) == _outputs(LLM(str(ref), **ENGINE))


def test_modelopt_fp8_from_its_own_config_file_and_a_layer_left_plain(qwen3_dir, tmp_path):
    """ModelOpt's hf_quant_config.json beside a config.json without quantization_config; one projection the
    quantizer left in floating point loads as a plain layer."""
    plain = "model.layers.1.mlp.down_proj"
    fp8, ref = write_pair(qwen3_dir, tmp_path, "modelopt-tensor", keep_plain=(plain,))
    raw = json.loads((fp8 / "config.json").read_text())
    del raw["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(raw))
    (fp8 / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    llm = LLM(str(fp8), **ENGINE)
    assert len(_fp8_layers(llm)) == 7
    down = llm.engine.runner.model.get_submodule(plain)
    assert down.fp8 is None and down.weight.dtype == torch.float32 and "input_scale" not in down._parameters
    assert _outputs(llm) == _outputs(LLM(str(ref), **ENGINE))


def test_quantization_fp8_quantizes_a_plain_checkpoint_at_load(qwen3_dir, tmp_path):
    llm = LLM(str(qwen3_dir), quantization="fp8", **ENGINE)
    layers = _fp8_layers(llm)
    assert len(layers) == 8 and all(m.fp8.weights == "channel" and m.scale.dim() == 1 for m in layers)
    got = _outputs(llm)
    # Exactly the checkpoint of those quantized weights, dequantized ...
    ref = tmp_path / "dequantized"
    shutil.copytree(qwen3_dir, ref)
    state = load_file(str(ref / "model.safetensors"))
    for name, w in state.items():
        if _is_linear(name, w):
            q, scale = quantize(w, "channel")
            state[name] = _deq(q, scale, "channel")
    save_file(state, str(ref / "model.safetensors"))
    assert got == _outputs(LLM(str(ref), **ENGINE))
    # ... and close to the unquantized model: the same first tokens, the logprob of each of its tokens within
    # 0.25 nats as long as the two sequences agree (this random model has near-ties; 8-bit weights break some).
    plain = _outputs(LLM(str(qwen3_dir), **ENGINE))
    for (gt, gl), (wt, wl) in zip(got, plain, strict=True):
        assert gt[:4] == wt[:4]
        agree = next((i for i, (a, b) in enumerate(zip(gt, wt, strict=True)) if a != b), len(wt))
        assert all(abs(gl[i][wt[i]] - wl[i][wt[i]]) < 0.25 for i in range(agree))
    with pytest.raises(ConfigError, match="--quantization must be one of fp8"):
        LLM(str(qwen3_dir), quantization="awq", **ENGINE)


def test_dummy_weights_of_an_fp8_config_are_fp8(qwen3_dir, tmp_path):
    fp8, _ = write_pair(qwen3_dir, tmp_path, "fp8-block")
    llm = LLM(str(fp8), load_format="dummy", **ENGINE)
    layers = _fp8_layers(llm)
    assert len(layers) == 8
    for m in layers:
        w = dequantize(m.weight, m.scale, m.fp8.block, torch.float32)
        assert 0 < float(w.abs().max()) <= 1e-3 * 1.001
    assert len(llm.generate(PROMPTS, PARAMS)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("layout,block,parallel", [("fp8-block", BLOCK, "tp"), ("fp8-block", [32, 32], "tp"),
                                                   ("fp8-tensor-static", BLOCK, "tp"), ("fp8-block", BLOCK, "pp")])
def test_parallel_fp8_equals_one_device(layout, block, parallel, qwen3_dir, tmp_path):
    """Each rank holds its rows (q|k|v, gate|up) or columns (o, down) of the FP8 weights and the scales that go
    with them (block scales along the same dim; per-row scales with the rows, whole for a row-parallel layer);
    tokens as on one device, logprobs within 1e-4. Blocks of 32: each rank's 16 key rows cut one, so q|k|v loads
    dequantized on both ranks (the whole pieces, then this rank's rows) while one device keeps it FP8. "pp": two
    pipeline stages, each loading its own layers' FP8 weights and scales."""
    fp8, _ = write_pair(qwen3_dir, tmp_path, layout, block=block)
    engine = dict(ENGINE, num_gpu_blocks_override=32, num_cpu_threads=1)
    engine.pop("kv_cache_memory")
    want = _outputs(LLM(str(fp8), **engine))
    size = {"tensor_parallel_size": 2} if parallel == "tp" else {"pipeline_parallel_size": 2}
    llm = LLM(str(fp8), distributed_timeout=5.0, **size, **engine)
    try:
        if parallel == "pp":  # (the driver holds the first stage: its layer is FP8)
            assert len(_fp8_layers(llm)) == 4
        got = _outputs(llm)
    finally:
        llm.shutdown()
    assert_same_tokens_and_logprobs(got, want)


def test_a_tensor_parallel_split_that_cuts_a_scale_block_loads_dequantized_naming_the_sizes(caplog):
    """Blocks of 32 rows: at TP=2 rank 1's 16 key rows (and its 48 of down's 96 input columns) would cut one. Each
    such layer is a plain one of the model dtype, its FP8 pieces dequantized whole with their own scales (a scale
    before its weight or after it) and then narrowed to this rank: the rank's rows / columns of the dequantized
    checkpoint, exactly; a warning names the sizes."""
    from atlas.layers.linear import Fp8Scheme, QKVParallelLinear, RowParallelLinear, quantizing
    from atlas.layers.parallel import ModelParallel, building_with
    from atlas.models.quantization import dequantize_block_fp8

    scheme = Fp8Scheme("block", (32, 32), scale_name="weight_scale_inv")
    view = ModelParallel(tp_rank=1, tp_size=2)
    with building_with(view), quantizing(scheme):
        qkv = QKVParallelLinear(64, 16, 4, 2)
        down = RowParallelLinear(96, 64)
    with caplog.at_level(logging.WARNING, logger="atlas"):
        qkv.prepare_fp8("qkv")
        down.prepare_fp8("down")
    assert "qkv: rows 16..31 of piece 'k' its 32" in caplog.text and "32x32 scale blocks" in caplog.text
    assert "down: columns 48..95 of its 96" in caplog.text
    assert qkv.fp8 is None and down.fp8 is None and qkv.weight.dtype == down.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    want = {}
    for shard, rows in (("q", 64), ("k", 32), ("v", 32)):
        q, scale = quantize(torch.randn(rows, 64, generator=g), "block", [32, 32])
        want[shard] = dequantize_block_fp8(q, scale, (32, 32), torch.float32)
        if shard == "k":  # (the scales first)
            qkv.weight_scale_inv.weight_loader(qkv.weight_scale_inv, scale, shard)
            qkv.weight.weight_loader(qkv.weight, q, shard)
        else:
            qkv.weight.weight_loader(qkv.weight, q, shard)
            qkv.weight_scale_inv.weight_loader(qkv.weight_scale_inv, scale, shard)
    assert qkv.missing_fp8_scales() == []
    assert torch.equal(qkv.weight.data, torch.cat([want["q"][32:], want["k"][16:], want["v"][16:]]))
    q, scale = quantize(torch.randn(64, 96, generator=g), "block", [32, 32])
    down.weight.weight_loader(down.weight, q)
    assert down.missing_fp8_scales() == [None]  # (a weight still waiting for its scales: load_named_weights refuses)
    down.weight_scale_inv.weight_loader(down.weight_scale_inv, scale)
    assert torch.equal(down.weight.data, dequantize_block_fp8(q, scale, (32, 32), torch.float32)[:, 48:])
    # Scales of another shape than the whole piece's blocks: a malformed checkpoint, named.
    down.weight.weight_loader(down.weight, q)
    with pytest.raises(ModelLoadError, match=r"down\.weight_scale_inv has shape \(2, 2\), but down\.weight \(64, "
                                             r"96\) in blocks of 32x32 needs \(2, 3\)"):
        down.weight_scale_inv.weight_loader(down.weight_scale_inv, scale[:, :2])


def test_a_fused_piece_that_cuts_a_scale_block_loads_that_layer_dequantized(tmp_path, tokenizer_dir):
    """gate|up of intermediate size 40 in blocks of 16: up's rows start at 40, inside a block (GLM-4.5-Air's dense
    layer, 10944 = 85.5 blocks of 128, is the published case). That layer loads dequantized, the others stay FP8;
    the outputs equal the dequantized checkpoint's, and --load-format dummy builds the same layers."""
    src = build_checkpoint(tmp_path / "src", "Qwen3ForCausalLM", tokenizer_dir, seed=3, intermediate_size=40)
    fp8, ref = write_pair(src, tmp_path, "fp8-block")
    llm = LLM(str(fp8), **ENGINE)
    model = llm.engine.runner.model
    gate_up = [m for n, m in model.named_modules() if n.endswith("gate_up_proj")]
    assert len(gate_up) == 2 and all(m.fp8 is None and m.weight.dtype == torch.float32 for m in gate_up)
    assert len(_fp8_layers(llm)) == 6  # q|k|v, o, down of both layers
    assert _outputs(llm) == _outputs(LLM(str(ref), **ENGINE))
    dummy = LLM(str(fp8), load_format="dummy", **ENGINE)
    assert len(_fp8_layers(dummy)) == 6
    assert len(dummy.generate(PROMPTS, PARAMS)[0].outputs[0].token_ids) == 8


def test_what_is_not_implemented_is_refused_naming_it(qwen3_dir, deepseek_checkpoints, tmp_path):
    fp8, _ = write_pair(qwen3_dir, tmp_path / "a", "fp8-block")
    # block scales with static activation scales (vLLM refuses them too)
    static = tmp_path / "static"
    shutil.copytree(fp8, static)
    raw = json.loads((static / "config.json").read_text())
    raw["quantization_config"]["activation_scheme"] = "static"
    (static / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=r"quantized \(fp8, block \[16, 16\]"):
        LLM(str(static), **ENGINE)
    # compressed-tensors with integer weights, or FP8 weights in groups
    for name, weights in (("int", {"num_bits": 8, "type": "int", "strategy": "channel"}),
                          ("group", {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32})):
        other = tmp_path / name
        shutil.copytree(fp8, other)
        raw = json.loads((other / "config.json").read_text())
        raw["quantization_config"] = {**_ct("channel", None)}
        raw["quantization_config"]["config_groups"]["group_0"]["weights"] = weights
        (other / "config.json").write_text(json.dumps(raw))
        with pytest.raises(UnsupportedModelError, match=r"quantized \(compressed-tensors"):
            LLM(str(other), **ENGINE)
    # a weight without its scales
    missing = tmp_path / "missing"
    shutil.copytree(fp8, missing)
    state = load_file(str(missing / "model.safetensors"))
    del state["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    save_file(state, str(missing / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has no weight_scale_inv"):
        LLM(str(missing), **ENGINE)
    # --quantization fp8 where the model keeps no FP8 linear layers yet
    gemma3 = build_gemma3_checkpoint(tmp_path / "gemma3")
    with pytest.raises(UnsupportedModelError, match=r"--quantization fp8: .* not in Gemma3ForCausalLM yet"):
        LLM(str(gemma3), quantization="fp8", **ENGINE)


def test_deepseek_loads_a_per_channel_fp8_checkpoint(deepseek_checkpoints, tmp_path):
    """DeepSeek keeps its attention and dense linear layers in FP8 in every layout and dequantizes its routed experts
    and kv_b_proj (tests/test_deepseek_fp8.py for the block layout): on the CPU exactly the dequantized model."""
    fp8, ref = write_pair(deepseek_checkpoints["v2-lite"], tmp_path, "fbgemm-channel")
    assert _outputs(LLM(str(fp8), **ENGINE)) == _outputs(LLM(str(ref), **ENGINE))


@pytest.mark.parametrize("part", ["0/2", "1/2"])
def test_fp8_kernels_in_the_interpreter_match_their_references(part):
    """kernels/fp8_linear_triton.py in Triton's CPU interpreter (float32): tolerances in fp8_linear_cases.py; the
    cases in two halves, which the suite's two processes run side by side (the whole took 80 s in one)."""
    assert run_in_triton_interpreter("fp8_linear_cases.py", part).strip().endswith("0 failure(s)")


def test_the_row_tiles_kernels_compile_for_sm90():
    """The row-tiles GEMVs compiled to PTX for the H200 on this CPU (triton_compile.py), in the forms the
    interpreter cases run but do not type: FP8 at 1 row with the gate|up epilogue, as routed experts' gate|up
    (PAIRS), at 4 rows with a partial K tile and per-channel scales; MXFP4 experts' gate|up with biases and
    gpt-oss's clamped SwiGLU, and their down with the routing weights' sum, a partial K tile, in each of their decode forms."""
    from triton_compile import compile_for_sm90

    from atlas.kernels import fp8_linear_triton as kt
    from atlas.kernels import moe_triton

    ptrs = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
            "rw_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"}
    base = dict(GROUP_N=128, GROUP_K=128, ROWS=1, BLOCK_N=4, RUNS=128, RUN=kt.ROW_TILES_RUN, NUM_STAGES=1,
                EVEN_K=True, CHANNEL=False, HAS_BIAS=False, ACT=0, LIBDEVICE=True, PDL=0, PAIRS=False, TOPK=1,
                PREFETCH=False)
    for consts in (base, dict(base, PAIRS=True, TOPK=8),
                   dict(base, ROWS=4, ACT=-1, EVEN_K=False, CHANNEL=True, HAS_BIAS=True, GROUP_N=1),
                   dict(base, ROWS=4, ACT=-1, EVEN_K=False, PREFETCH=True, PDL=2)):
        assert ".entry" in compile_for_sm90(kt._fp8_gemv_row_tiles_kernel, ptrs, consts, num_stages=1), consts
    mx = dict(ptrs, x_ptr="*i32", h_ptr="*i32", w_ptr="*u8", s_ptr="*u8")
    for decode in range(5):  # (each decode form: moe_triton.DECODES and the E4M3 form's interpreted one)
        consts = dict(TOPK=4, BLOCK_N=4, RUNS=64, NUM_STAGES=1, EVEN_K=False, ACT=3, LIBDEVICE=True, PDL=0,
                      HAS_BIAS=True, DECODE=decode)
        assert ".entry" in compile_for_sm90(moe_triton._mxfp4_gate_up_row_tiles_kernel, mx, consts, num_stages=1)
        consts = dict(TOPK=4, RUNS=64, NUM_STAGES=1, EVEN_K=False, PDL=0, HAS_BIAS=True, DECODE=decode)
        assert ".entry" in compile_for_sm90(moe_triton._mxfp4_down_row_tiles_kernel, mx, consts, num_stages=1)


def test_the_quantizers_reciprocal_form_gives_the_divisions_fp8_values():
    """The fp8_quant_fma knob's division (x times the scale's reciprocal with two FMA corrections) against the IEEE
    division, on a sample of tools/quant_division_check.py's pairs (every 61st scale: ~2 x 10^7 pairs of bf16 and fp16
    activations): the same FP8 values and quotients. The bare product x * RN(1 / s) differs on that sample, so the
    check can tell. (The whole walk, all ~2 x 10^9 pairs: 0 differing, the tool's docstring.)"""
    checker = tool_module("quant_division_check")
    for dtype in (torch.bfloat16, torch.float16):
        result = checker.check(dtype, stride=61)
        assert result["pairs"] > 10 ** 7 and result["fp8_differ"] == 0 and result["quotient_differ"] == 0, result
    assert checker.check(torch.bfloat16, stride=61, corrected=False)["fp8_differ"] > 0


@pytest.mark.parametrize("family", ["qwen3", "deepseek-v3"])
def test_fused_activation_quantization_reaches_every_layer_and_changes_no_logprob(family, tokenizer_dir, tmp_path,
                                                                                   monkeypatch):
    """The fp8_fused_quant knob's path through a model, on the CPU with the references of the CUDA kernels (the norm
    and the gated activation writing QuantizedRows by PyTorch ops, the block product in float32): where a layer takes
    its rows quantized (here: every block-FP8 layer from 2 rows, as cuBLASLt's path would), the RMSNorms before
    q|k|v (DeepSeek-V3: MLA's q_a | kv_a) and the dense MLPs' gate|up, and the activation before down, hand them over
    quantized, and the greedy tokens and logprobs equal, bit for bit, those of the same layers quantizing their own
    activations (the W8A8 reference)."""
    from conftest import build_deepseek_checkpoint

    from atlas.kernels import fp8_linear as f
    from atlas.layers import linear

    if family == "qwen3":
        src = build_checkpoint(tmp_path, "Qwen3ForCausalLM", tokenizer_dir, hidden_size=512, intermediate_size=1024,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    else:  # (a dense first layer of MLP 1024, then MoE layers whose shared expert is too narrow to take them)
        src = build_deepseek_checkpoint(tmp_path, "v3", tokenizer_dir, hidden_size=512, intermediate_size=1024,
                                        q_lora_rank=128, kv_lora_rank=128, num_nextn_predict_layers=0)
    path = write_pair(src, tmp_path / "pair", "fp8-block", block=[128, 128])[0]
    real = linear.fp8_linear

    def w8a8_from_two_rows(x, weight, scale, block, bias=None, input_scale=None, scale_ub=None, act=None,
                           quantize_act=False):
        # (the CPU's FP8 matmul is the dequantizing reference: from 2 rows, W8A8 as on the GPU, for both runs)
        if isinstance(x, f.QuantizedRows) or x.shape[0] < 2:
            return real(x, weight, scale, block, bias, input_scale, scale_ub, act, quantize_act)
        y = f.w8a8_ref(x, weight, scale, block, bias)
        return f._activate(y, act, quantize_act) if act is not None else y

    handed = []
    made = f.quantized_rows_ref
    monkeypatch.setattr(linear, "fp8_linear", w8a8_from_two_rows)
    monkeypatch.setattr(linear, "takes_quantized_rows", lambda m, weight, scale, block, dtype, device: (
        kernel_settings.tuning.fp8_fused_quant and m >= 2 and tuple(block) == (128, 128)))
    monkeypatch.setattr(f, "quantized_rows_ref", lambda x, group=128: handed.append(x.shape) or made(x, group))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (9, 21)]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    common = dict(dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory="64MiB", max_model_len=128)
    want = _outputs_of(LLM(str(path), tuning={"fp8_fused_quant": False}, **common), prompts, params)
    assert not handed
    llm = LLM(str(path), **common)  # (the knob's default: on)
    consumers = [m for layer in llm.engine.runner.model.modules() for m in (getattr(layer, "attn_input", None),
                                                                            getattr(layer, "mlp_input", None)) if m]
    assert len(consumers) == {"qwen3": 4, "deepseek-v3": 4}[family]  # (2 x 2 layers; 3 attention inputs + 1 MLP)
    took = set()

    def recording(layer):
        real = layer.forward

        def forward(x, *args, **kwargs):
            if isinstance(x, f.QuantizedRows):
                took.add(layer)
            return real(x, *args, **kwargs)
        return forward

    for m in consumers:
        m.forward = recording(m)
    got = _outputs_of(llm, prompts, params)
    assert got == want
    assert took == set(consumers)  # (every norm-fed layer took its rows quantized)
    # (per multi-row step: each layer's q|k|v (MLA: q_a | kv_a) input from its norm; each dense MLP's gate|up input
    #  from its norm and down's from the activation)
    assert len(handed) >= 3 * 2 and {shape[1] for shape in handed} == {512, 1024}


def _outputs_of(llm: LLM, prompts, params) -> list:
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]


def test_the_fused_quantization_kernels_compile_for_sm90():
    """The kernels that write QuantizedRows (the fp8_fused_quant knob), compiled to PTX for the H200 on this CPU in
    the forms the model runs (Qwen3-8B's hidden 4096 with the residual add, its gate|up 12288), with PDL, and the
    standalone quantizer with the fp8_quant_fma knob's division: the interpreter runs their values
    (fp8_linear_cases.py) but does not type them."""
    from triton_compile import compile_for_sm90

    from atlas.kernels import fp8_linear_triton as kt
    from atlas.kernels import fused_ops_triton as fo
    from atlas.kernels.pdl import TRIGGER_FIRST

    ptrs = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
            "res_out_ptr": "*bf16", "eps": "fp32", "inv_n": "fp32"}
    block_m, _, warps = fo.rms_norm_block(4096)
    consts = dict(N=4096, BLOCK_M=block_m, BLOCK_N=4096, HAS_RESIDUAL=True, GROUP=128, FP8_MAX=448.0, FMA=False,
                  PDL=TRIGGER_FIRST)
    assert ".entry" in compile_for_sm90(fo._rms_norm_quant_kernel, ptrs, consts, num_warps=warps)
    block, warps = fo.act_block(12288)
    consts = dict(ACT=0, BLOCK=block, GROUP=128, LIBDEVICE=True, FP8_MAX=448.0, FMA=True, PDL=TRIGGER_FIRST)
    assert ".entry" in compile_for_sm90(fo._act_and_mul_quant_kernel, ptrs, consts, num_warps=warps)
    consts = dict(GROUP=128, GROUPS=32, FP8_MAX=448.0, FMA=True)  # (the standalone quantizer, fp8_quant_fma's form)
    assert ".entry" in compile_for_sm90(kt._quantize_groups_kernel, ptrs, consts, num_warps=4, num_stages=1)


def test_lazy_slices_load_like_tensors(qwen3_dir, tmp_path):
    """What a tensor-parallel rank reads (lazy safetensors slices) fills an FP8 model as whole tensors do."""
    fp8, _ = write_pair(qwen3_dir, tmp_path, "fp8-tensor-static")
    cfg = ModelConfig.from_path(fp8)
    models = []
    for lazy in (False, True):
        model = loader.build_model(cfg, torch.device("cpu"), torch.float32, 64) if not lazy else None
        if lazy:
            from atlas.layers.linear import quantizing
            from atlas.models.quantization import fp8_scheme

            with loader.constructing(torch.device("cpu"), torch.float32), quantizing(fp8_scheme(cfg.raw)):
                model = loader.model_class(cfg)(cfg, 64)
            loader.prepare_fp8(model)
            model.load_weights(loader.iterate_weights(loader.safetensors_files(fp8), lazy=True))
        models.append(dict(model.named_parameters()))
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k].float(), models[1][k].float()) for k in models[0])
