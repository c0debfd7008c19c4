"""Llama 4 (Llama4ForCausalLM, and Llama4ForConditionalGeneration served on text) against transformers' Llama 4 on
tiny random checkpoints (fp32, CPU): chunked attention on the RoPE layers (a chunk of 12 positions, so prompts cross
several), weightless q / k norms, NoPE layers with tuned query temperature (floor_scale 4, so it changes the
queries), dense and MoE layers interleaved, the routed experts' inputs scaled by their sigmoid scores, a shared
expert; logits over chunks, greedy tokens batched, preempted and from the prefix cache, n-gram speculation, the
chunked layers' pages released below their chunk, two tensor-parallel ranks, the image-text layout, and what is
refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import (
    _build,
    assert_pages_returned,
    check_batched_and_cached,
    generated_tokens,
    hf_greedy,
    hf_model,
    random_ids,
)
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams
from atlas.errors import AtlasError

# 4 layers: RoPE + chunked, dense / MoE alternating (interleave_moe_layer_step 2: layers 1 and 3), the fourth NoPE;
# top-1 of 4 experts (Llama 4's), llama3 RoPE scaling as Scout's config has it.
LLAMA4 = dict(
    model_type="llama4_text", architectures=["Llama4ForCausalLM"], num_hidden_layers=4, intermediate_size=32,
    intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
    attention_chunk_size=12, floor_scale=4, attn_scale=0.5, pad_token_id=0, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw})



@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("llama4"), "llama4", LLAMA4, None, 0, {})


@pytest.fixture(scope="module")
def prompts_and_tokens(llama4):
    prompts = [random_ids(n, 10 + n) for n in (5, 30, 47)]
    model = hf_model(llama4)
    return prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_the_layers_and_logits_over_chunks_match_transformers(llama4):
    llm = _llm(llama4)
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.attn.chunk_size for layer in layers] == [12, 12, 12, None]
    assert [type(layer.mlp).__name__ for layer in layers] == ["LlamaMLP", "Llama4MoE", "LlamaMLP", "Llama4MoE"]
    ids = random_ids(60, 1)
    want = hf_logits(llama4, ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [60]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [13, 21, 9] + [1] * 17), want, rtol=1e-4, atol=1e-4)


def test_greedy_batched_preempted_from_the_prefix_cache_and_with_ngram_drafts(llama4, prompts_and_tokens):
    prompts, expected = prompts_and_tokens
    tight = _llm(llama4, num_gpu_blocks_override=14, max_num_batched_tokens=32, max_model_len=80)
    check_batched_and_cached(tight, prompts, expected, GREEDY)
    ngram = _llm(llama4, speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
                 ngram_max=3)
    assert generated_tokens(ngram, prompts, GREEDY) == expected
    assert ngram.engine.stats.spec_num_draft_tokens > 0


def test_a_long_generation_holds_a_chunks_pages_in_the_chunked_layers(llama4):
    """150 tokens past a 20-token prompt in pages of 4 (chunks of 12): the chunked layers keep their KV in a pool of
    their own (KV cache groups beside the NoPE layer) and hold at most a chunk's pages, a partial one and one ahead;
    the NoPE layer holds the whole sequence; the tokens are transformers'."""
    from test_kv_groups import _held_while_generating

    from atlas.engine.kv_groups import GroupedKVCacheManager

    llm = _llm(llama4, kv_cache_memory="1MiB", block_size=4, max_model_len=256, enable_prefix_caching=False)
    assert isinstance(llm.engine.kv, GroupedKVCacheManager) and llm.engine.kv.group_window == 12
    prompt = list(range(40, 60))
    tokens, _, most_window, most_full = _held_while_generating(llm, prompt, 150)
    assert most_window <= -(-11 // 4) + 2, most_window
    assert most_full == -(-(20 + 150 - 1) // 4), most_full
    assert tokens == hf_greedy(hf_model(llama4), prompt, 150)
    assert_pages_returned(llm)


def test_two_tensor_parallel_ranks_give_one_devices_tokens(llama4, prompts_and_tokens):
    from test_parallel import PARALLEL

    prompts, expected = prompts_and_tokens
    tp = LLM(str(llama4), tensor_parallel_size=2, kv_cache_memory="8MiB", skip_tokenizer_init=True, **PARALLEL)
    try:
        assert generated_tokens(tp, prompts, GREEDY) == expected
    finally:
        tp.shutdown()


def test_the_image_text_checkpoint_serves_its_language_model(llama4, tmp_path, prompts_and_tokens):
    """Llama4ForConditionalGeneration's layout (the language model under language_model., a vision tower and a
    projector beside it) loads the same language model."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "image-text"
    shutil.copytree(llama4, path)
    text = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {k: v for k, v in text.items() if k != "architectures"},
        "vision_config": {"model_type": "llama4_vision_model"}, "tie_word_embeddings": False}))
    state = load_file(str(path / "model.safetensors"))
    state = {("language_model." + k): v for k, v in state.items()}
    state["vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4)
    state["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)
    save_file(state, str(path / "model.safetensors"))
    prompts, expected = prompts_and_tokens
    llm = _llm(path)
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY)] == \
        [expected[1]]


def test_fp8_and_lora_are_refused_naming_the_family(llama4):
    with pytest.raises(AtlasError, match="Llama4ForCausalLM"):
        _llm(llama4, quantization="fp8")
    with pytest.raises(AtlasError, match="(?i)lora|adapter"):
        _llm(llama4, enable_lora=True)


def test_chunked_attention_kernel_in_the_interpreter():
    """The Triton kernel's chunk mask (prefill chunks, verify rows and decodes; split-KV decodes; an 8-bit cache)
    against the reference, in Triton's CPU interpreter."""
    from conftest import run_in_triton_interpreter

    out = run_in_triton_interpreter("chunked_attention_cases.py", "4", "3", "2", timeout=300)
    assert "9 chunked-attention cases agree" in out  # (each also over its pages below the chunk released)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
def test_chunked_attention_and_llama4_on_cuda(llama4, prompts_and_tokens):
    """On CUDA: the chunk-masked Triton kernel against its reference in bf16 (every kind of step, split-KV, an 8-bit
    cache), then the tiny Llama 4 in float32 through the Triton kernels and CUDA graphs giving transformers' greedy
    tokens on the same GPU."""
    from chunked_attention_cases import check_chunks
    from conftest import CUDA_KV

    assert check_chunks({"step": 12, "split": 12, "fp8": 6}, "cuda", torch.bfloat16) == []
    prompts, _ = prompts_and_tokens
    llm = _llm(llama4, device="cuda", dtype="float32", kv_cache_memory=CUDA_KV)
    ref = hf_model(llama4, dtype=torch.float32, device="cuda")
    assert generated_tokens(llm, prompts, GREEDY) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    assert_pages_returned(llm)
