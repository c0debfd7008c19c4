"""FP8 linear layers on a CUDA GPU: each kernel against its reference at decode and prefill shapes of an 8B model
(tolerances in fp8_linear_cases.py), and tiny FP8 models whose greedy tokens under CUDA graphs equal their eager
run. Skipped without a GPU; run on the GPU machine with `python -m pytest -m cuda tests/test_fp8_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_KV
from fp8_linear_cases import check_all
from test_fp8_linear import write_pair

from atlas import LLM, SamplingParams
from atlas.layers.linear import Linear

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_tf32")]

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# A fixed KV cache (not a share of the GPU): the CUDA tests' pytest workers start engines beside each other's.
COMMON = dict(device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256, skip_tokenizer_init=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    # decode rows alone and together (GEMV, W8A16), and prompts over 64 tokens (the W8A8 prefill paths)
    return [torch.randint(1, 384, (n,), generator=g).tolist() for n in (3, 17, 90, 150)]


def test_fp8_kernels_match_their_references_on_model_shapes():
    assert check_all("cuda", torch.bfloat16, large=True) == []


def test_fp8_kernels_in_float32_and_odd_shapes():
    assert check_all("cuda", torch.float32, large=False) == []
    assert check_all("cuda", torch.bfloat16, large=False) == []


def _greedy(llm: LLM, prompts: list[list[int]], together: bool) -> list[list[int]]:
    if together:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    return [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("layout, quantization, fp8_gemv", [
    ("fp8-block", None, ""), ("fbgemm-channel", None, ""), ("fp8-tensor-static", None, ""), (None, "fp8", ""),
    ("fp8-block", None, "1:rt-n4k2048w4s1;4:rt-n4k2048w4s1"), ("fbgemm-channel", None, "1:rt-n2k1024w4s3")])
def test_fp8_model_greedy_under_cuda_graphs_equals_eager(layout, quantization, fp8_gemv, qwen3_dir, tmp_path):
    """The same kernels replayed in CUDA graphs as run eagerly: the same tokens, one request at a time (batch-1
    GEMV steps) and all together (W8A16 steps); the FP8 weights stay FP8 on the GPU. fp8_gemv: the GEMV in row
    tiles (at one row with its gate|up epilogue; at 4, the step of all the prompts) instead of the table's."""
    path = write_pair(qwen3_dir, tmp_path, layout)[0] if layout else qwen3_dir
    prompts = _prompts()
    tuning = {"tuning": {"fp8_gemv": fp8_gemv}} if fp8_gemv else {}
    eager = LLM(str(path), dtype="bfloat16", enforce_eager=True, quantization=quantization, **tuning, **COMMON)
    want = [_greedy(eager, prompts, together) for together in (False, True)]
    del eager
    llm = LLM(str(path), dtype="bfloat16", quantization=quantization, **tuning, **COMMON)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn and m.weight.is_cuda for m in layers)
    assert [_greedy(llm, prompts, together) for together in (False, True)] == want


def test_fp8_gemv_prefetch_keeps_the_tokens_bit_for_bit(qwen3_dir, tmp_path):
    """The fp8_gemv_prefetch knob (the FP8 row tiles load their first weights before the PDL wait; bf16 layers keep
    their order) sums the same products in the same order: one request at a time (every decode step through the row
    tiles), under CUDA graphs with PDL, the greedy tokens equal the knob off's; and the row tiles did prefetch."""
    from atlas.kernels import fp8_linear_triton

    path = write_pair(qwen3_dir, tmp_path, "fp8-block")[0]
    prompts = _prompts()
    rt = {"fp8_gemv": "1:rt-n4k2048w4s1"}
    want = _greedy(LLM(str(path), dtype="bfloat16", tuning={**rt, "fp8_gemv_prefetch": False}, **COMMON), prompts, False)
    assert not fp8_linear_triton.fp8_prefetch()
    llm = LLM(str(path), dtype="bfloat16", tuning={**rt, "fp8_gemv_prefetch": True}, **COMMON)
    assert fp8_linear_triton.fp8_prefetch()  # (the knob reached the kernels' settings)
    assert _greedy(llm, prompts, False) == want


def test_fp8_model_on_cuda_follows_its_dequantized_model(qwen3_dir, tmp_path):
    """bf16 on CUDA: the FP8 checkpoint and its dequantized checkpoint (bf16 weights through cuBLAS) start with the
    same greedy tokens (later ones may part at near-ties: the FP8 paths sum in another order, and prefill over 64
    tokens quantizes the activations to FP8)."""
    fp8, ref = write_pair(qwen3_dir, tmp_path, "fp8-block")
    prompts = _prompts()
    got = _greedy(LLM(str(fp8), dtype="bfloat16", **COMMON), prompts, True)
    want = _greedy(LLM(str(ref), dtype="bfloat16", **COMMON), prompts, True)
    assert [g[:4] for g in got] == [w[:4] for w in want]


@pytest.mark.parametrize("family", ["qwen3", "deepseek-v3"])
def test_fused_activation_quantization_keeps_the_tokens_bit_for_bit(family, tokenizer_dir, tmp_path):
    """The fp8_fused_quant knob: a 128 x 128 block-scaled Qwen3 whose layers take cuBLASLt's block path (hidden
    512, MLP 1024: four and eight scale groups), and a DeepSeek-V3 whose MLA takes its q_a | kv_a rows from the
    norm (q_lora and kv_lora 128; a dense first layer, then MoE layers), give the same greedy tokens with the norms
    and the gated activation writing the FP8 rows themselves as without, eager and under CUDA graphs (the rows are
    the same bits, so every logit is), and the fused kernels did run."""
    from conftest import build_checkpoint, build_deepseek_checkpoint

    from atlas.kernels import fused_ops_triton

    if family == "qwen3":
        src = build_checkpoint(tmp_path, "Qwen3ForCausalLM", tokenizer_dir, hidden_size=512, intermediate_size=1024,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    else:
        src = build_deepseek_checkpoint(tmp_path, "v3", tokenizer_dir, hidden_size=512, intermediate_size=1024,
                                        q_lora_rank=128, kv_lora_rank=128, num_nextn_predict_layers=0)
    path = write_pair(src, tmp_path / "pair", "fp8-block", block=[128, 128])[0]
    prompts = _prompts()
    unfused = {"fp8_fused_quant": False}
    want = [_greedy(LLM(str(path), dtype="bfloat16", enforce_eager=True, tuning=unfused, **COMMON), prompts, together)
            for together in (False, True)]
    calls = []
    kernel_runs = fused_ops_triton._rms_norm_quant_kernel.run

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel_runs(*args, **kwargs)

    fused_ops_triton._rms_norm_quant_kernel.run = counted
    try:
        for eager in (True, False):
            llm = LLM(str(path), dtype="bfloat16", enforce_eager=eager, **COMMON)  # (the knob's default: on)
            assert [_greedy(llm, prompts, together) for together in (False, True)] == want, f"eager {eager}"
            del llm
    finally:
        fused_ops_triton._rms_norm_quant_kernel.run = kernel_runs
    assert calls
