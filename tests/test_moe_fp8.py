"""FP8 checkpoints of the MoE families (the block-scaled layout DeepSeek-V3 and the Qwen / GLM -FP8 models ship) keep
the attention projections and the dense and shared-expert MLPs in FP8, and dequantize the routed experts and, in
DeepSeek, kv_b_proj (attention absorbs it: its weight is read whole) and the MTP module as they load: on the CPU,
whose FP8 layers compute with their dequantized weights, the same logits as the checkpoint of the dequantized weights
(DeepSeek with and without MTP speculation; Qwen3-MoE, Mixtral and GLM-4.5)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import assert_pages_returned
from safetensors.torch import load_file, save_file
from test_moe_families import build_moe_checkpoint

from atlas import LLM, SamplingParams
from atlas.bench.common import release
from atlas.kernels.fp8_linear import dequantize, quantize_weight
from atlas.layers.linear import Linear

BLOCK = [8, 8]  # (the tiny models' widths are multiples of 8; the published checkpoints use 128)
ENGINE = dict(kv_cache_memory="8MiB", block_size=8, skip_tokenizer_init=True, max_model_len=256)
FP8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its scale per BLOCK tile (weight_scale_inv), the dequantized weight in w's dtype)."""
    rows, cols = w.shape
    br, bc = BLOCK
    blocks = w.float().reshape(rows // br, br, cols // bc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(FP8)
    back = (q.float() * scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)).to(w.dtype)
    return q, scale, back


def _is_linear(name: str, w: torch.Tensor) -> bool:
    """A linear layer's weight as quantizers quantize them: 2-D, not an embedding, LM head, norm or router."""
    return w.dim() == 2 and name.endswith(".weight") and not any(
        part in name for part in ("embed", "lm_head", "norm", ".gate.weight", "shared_head.head"))


def _fp8_pair(src, root):
    """(the FP8 checkpoint of every linear layer of `src`, MTP module and experts included; the checkpoint of its
    dequantized weights)."""
    fp8, ref = root / "fp8", root / "dequantized"
    shutil.copytree(src, fp8)
    shutil.copytree(src, ref)
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if _is_linear(name, w):
            q, scale, back = _quantize(w)
            quantized[name], quantized[name + "_scale_inv"], dequantized[name] = q, scale, back
        else:
            quantized[name] = dequantized[name] = w
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": BLOCK,
                                     "activation_scheme": "dynamic", "fmt": "e4m3"}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, ref


@pytest.fixture(scope="module")
def fp8_pairs(deepseek_checkpoints, tmp_path_factory):
    return {name: _fp8_pair(deepseek_checkpoints[name], tmp_path_factory.mktemp(f"fp8-{name}"))
            for name in ("v3", "v2-lite")}


def _generate(path, prompts, **kw):
    llm = LLM(str(path), **{**ENGINE, **kw})
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_pages_returned(llm)
    return llm, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                 for o in outs]


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60))]


def _assert_fp8_experts(experts, llm) -> None:
    """The routed experts hold FP8 weights [E, N, K] and float32 scales [E, N / 8, K / 8] (the checkpoint's 8x8
    blocks): a byte a weight, half the bf16 experts' bytes (with 1/16 of that for the scales)."""
    assert experts
    for m in experts:
        assert m.fp8 is not None and m.w13.dtype == m.w2.dtype == FP8
        for w, s in ((m.w13, m.w13_weight_scale_inv), (m.w2, m.w2_weight_scale_inv)):
            e, n, k = w.shape
            assert s.dtype == torch.float32 and tuple(s.shape) == (e, n // 8, k // 8)
        size = sum(p.numel() * p.element_size() for p in m.parameters())
        weights = m.w13.numel() + m.w2.numel()
        assert size == weights + weights // 64 * 4  # (bf16: 2 * weights)


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_fp8_deepseek_equals_its_dequantized_weights(fp8_pairs, name):
    fp8, ref = fp8_pairs[name]
    llm, got = _generate(fp8, PROMPTS)
    _, want = _generate(ref, PROMPTS)
    assert got == want
    # What stays FP8 and what was dequantized.
    model = llm.engine.runner.model
    attn = model.model.layers[0].self_attn
    kept = [attn.fused_qkv_a_proj, attn.q_b_proj] if name == "v3" else [attn.q_proj, attn.kv_a_proj_with_mqa]
    kept += [attn.o_proj, model.model.layers[0].mlp.gate_up_proj, model.model.layers[1].mlp.shared_experts.down_proj]
    assert all(layer.weight.dtype == FP8 and layer.fp8 is not None for layer in kept)
    assert attn.kv_b_proj.weight.dtype != FP8 and attn.kv_b_proj.fp8 is None
    _assert_fp8_experts([model.model.layers[1].mlp.experts], llm)


def test_fp8_deepseek_mtp_speculation_equals_plain(fp8_pairs):
    fp8, ref = fp8_pairs["v3"]
    _, plain = _generate(fp8, PROMPTS)
    llm, spec = _generate(fp8, PROMPTS, speculative="mtp", speculative_policy="always", num_draft_tokens=2)
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert llm.engine.stats.spec_num_verify_steps > 0
    # the module itself holds the dequantized weights: its drafts are those of the dequantized checkpoint's
    _, ref_spec = _generate(ref, PROMPTS, speculative="mtp", speculative_policy="always", num_draft_tokens=2)
    assert [t for t, _ in spec] == [t for t, _ in ref_spec]
    ref_llm = LLM(str(ref), **ENGINE, speculative="mtp", speculative_policy="always", num_draft_tokens=2)
    for mine, theirs in zip(llm.engine.proposer.module.parameters(), ref_llm.engine.proposer.module.parameters(),
                            strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_fp8_sparse_moe_equals_its_dequantized_weights(family, tmp_path):
    fp8, ref = _fp8_pair(build_moe_checkpoint(tmp_path, family), tmp_path / "pair")
    llm, got = _generate(fp8, PROMPTS)
    _, want = _generate(ref, PROMPTS)
    assert got == want
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight.dtype == FP8 for m in layers)  # (attention, dense MLPs, shared experts)
    _assert_fp8_experts([m for name, m in model.named_modules() if name.endswith(".experts")], llm)


def test_online_fp8_quantization_leaves_the_absorbed_projection(deepseek_checkpoints, tmp_path):
    """--quantization fp8 on a plain DeepSeek checkpoint: its linear layers to FP8 with a scale per row, except
    kv_b_proj (read whole by the absorbed attention; the routed experts are no linear layers): the same logits as the
    checkpoint whose projections are those rows quantized and dequantized, kv_b_proj left as it is."""
    src = deepseek_checkpoints["v3"]
    ref = tmp_path / "rows-dequantized"
    shutil.copytree(src, ref)
    state = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        linear = name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and ".kv_b_proj." not in name and (
            ".mlp.experts." not in name) and layer is not None and int(layer) < 3
        if linear:
            q, scale = quantize_weight(w)
            w = dequantize(q, scale, None, torch.float32)
        state[name] = w.float() if w.is_floating_point() else w
    save_file(state, str(ref / "model.safetensors"))
    llm, got = _generate(src, PROMPTS, quantization="fp8")
    _, want = _generate(ref, PROMPTS)
    assert got == want
    model = llm.engine.runner.model
    linears = [m for n, m in model.named_modules() if isinstance(m, Linear)]
    assert all((m.fp8 is None) == m.keeps_model_dtype for m in linears)
    assert sum(m.keeps_model_dtype for m in linears) == model.config.num_hidden_layers == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_deepseek_on_cuda_graphs_equal_eager_and_follow_the_dequantized_model(fp8_pairs):
    """bf16 on CUDA: the FP8 layers' kernels replayed in CUDA graphs give the eager run's tokens (one request at a
    time: GEMV steps; together: W8A16 steps; a 70-token prompt: the W8A8 prefill), the FP8 weights stay FP8 on the
    GPU, and the first tokens are the dequantized checkpoint's (later ones may part at near-ties)."""
    fp8, ref = fp8_pairs["v3"]
    # (0.15 of the GPU an engine, each given back before the next: the CUDA tests run in three workers)
    cuda = dict(device="cuda", gpu_memory_utilization=0.15, max_model_len=256, skip_tokenizer_init=True,
                dtype="bfloat16")
    prompts = [[5, 6, 7], list(range(30, 100))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def greedy(llm, together):
        if together:
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        return [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]

    eager = LLM(str(fp8), enforce_eager=True, **cuda)
    want = [greedy(eager, t) for t in (False, True)]
    del eager
    release()
    llm = LLM(str(fp8), **cuda)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.fused_qkv_a_proj.weight.dtype == FP8 and attn.fused_qkv_a_proj.weight.is_cuda
    assert [greedy(llm, t) for t in (False, True)] == want
    del llm, attn
    release()
    dequantized = greedy(LLM(str(ref), **cuda), True)
    assert [g[:4] for g in want[1]] == [w[:4] for w in dequantized]
