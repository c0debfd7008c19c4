"""Gemma 4's text model against transformers (fp32, CPU), dense (per-layer embeddings, KV-shared layers, keys as
values, global layers of another head size and KV-head count, proportional RoPE) and MoE: logits in one prefill and
in chunks across the local window, the image-text checkpoint's language model (its placeholder ids embedded as the
pad token), greedy generation under mixed batches / chunked prefill / preemption, prefix caching on = off, n-gram
speculation = plain, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    GEMMA4_CONFIG,
    VOCAB,
    _randomize,
    assert_pages_returned,
    build_gemma4_checkpoint,
    checkpoint_tool,
    gemma4_extras,
    hf_greedy,
    hf_model,
)
from test_models import atlas_logits

from atlas import LLM, SamplingParams
from atlas.config import ModelConfig
from atlas.errors import UnsupportedModelError

KINDS = ["dense", "moe"]
BS = 4


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("gemma4")
    paths = {"dense": build_gemma4_checkpoint(root, seed=1), "moe": build_gemma4_checkpoint(root, seed=2, moe=True)}
    return {kind: (path, hf_model(path)) for kind, path in paths.items()}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_in_one_prefill_and_in_chunks(kind, gemma4):
    path, model = gemma4[kind]
    ids = _ids(33, 1)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float()
    assert float(expected.abs().max()) < 5.0  # (final_logit_softcapping 5)
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=BS, skip_tokenizer_init=True)
    specs = llm.engine.runner.model.kv_cache_specs()
    if kind == "dense":  # (two cache-owning layers: the KV-shared ones read theirs; global: 1 head of 32)
        assert [(s.num_kv_heads, s.head_dim, s.sliding_window) for s in specs] == [(2, 16, 6), (1, 32, None)]
    assert llm.engine.kv.sliding_window is None  # (global layers: pages are kept)
    torch.testing.assert_close(atlas_logits(llm, ids, [33]), expected, rtol=1e-4, atol=1e-4)
    # Chunks and decodes whose queries straddle the 6-token window, over pages of 4.
    torch.testing.assert_close(atlas_logits(llm, ids, [5, 9, 7] + [1] * 12), expected, rtol=1e-4, atol=1e-4)




def test_linear_rope_on_local_layers_and_default_on_global_ones(tmp_path):
    """The RoPE types the other way round (linear x 2 on the local layers, default over the global layers' whole
    32-wide heads)."""
    path = build_gemma4_checkpoint(tmp_path, seed=7, rope_parameters={
        "sliding_attention": {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    ids = _ids(30, 5)
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([ids])).logits[0].float()
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=BS, skip_tokenizer_init=True)
    torch.testing.assert_close(atlas_logits(llm, ids, [11, 19]), expected, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("kind", KINDS)
def test_bf16_logits_round_as_transformers(kind, gemma4):
    """In bfloat16 the norms, embeddings, per-layer inputs and router round where transformers rounds (bit-equal on
    this CPU when written; the bound leaves room for another BLAS's summation order)."""
    path = gemma4[kind][0]
    ids = _ids(30, 2)
    with torch.no_grad():
        expected = hf_model(path, dtype=torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=BS, skip_tokenizer_init=True, dtype="bfloat16")
    got = atlas_logits(llm, ids, [30]).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))

def _image_text_checkpoint(root: Path) -> Path:
    """A tiny Gemma4ForConditionalGeneration (text model as GEMMA4_CONFIG, one-layer vision and audio towers)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {k: v for k, v in GEMMA4_CONFIG.items() if k != "architectures"}
    text |= dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=512, eos_token_id=0, bos_token_id=None)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8)
    audio = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=16, conv_kernel_size=3)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, image_token_id=380,
                       video_token_id=381, audio_token_id=382, boi_token_id=378, eoi_token_id=379)
    torch.manual_seed(5)
    model = Gemma4ForConditionalGeneration(cfg)
    _randomize(model, 5)
    gemma4_extras(model, 5)
    model.tie_weights()
    out = root / "gemma4-image-text"
    model.save_pretrained(out)
    return out


def test_the_image_text_checkpoint_serves_its_language_model_on_text(tmp_path, caplog):
    import logging

    from transformers import Gemma4ForConditionalGeneration

    path = _image_text_checkpoint(tmp_path)
    ids = _ids(20, 3)
    ids[4], ids[11], ids[12] = 380, 381, 382  # (media placeholders without media: the pad token, as transformers)
    model = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].float()
    with caplog.at_level(logging.INFO, logger="atlas.models.base"):
        llm = LLM(str(path), kv_cache_memory="4MiB", block_size=BS, skip_tokenizer_init=True)
    skipped = sum(n.startswith(("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
                                "model.embed_audio.")) for n in model.state_dict())
    assert f"the vision / audio towers' {skipped} tensors are not loaded" in caplog.text
    torch.testing.assert_close(atlas_logits(llm, ids, [20]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [6, 7, 7]), expected, rtol=1e-4, atol=1e-4)


PROMPTS = [list(range(5, 10)), [(7 * i) % 380 + 1 for i in range(27)], list(range(200, 214)),
           [(11 * i) % 383 + 1 for i in range(30)], [17, 4] * 7, list(range(60, 82))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(gemma4):
    return {kind: [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS] for kind, (_, model) in gemma4.items()}


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_chunked_prefill_preemption_equal_transformers(kind, gemma4, expected):
    """Six requests at once in a pool too small for them (preemption), a 16-token budget (prefill chunks across
    window boundaries beside decodes)."""
    llm = LLM(str(gemma4[kind][0]), num_gpu_blocks_override=16, block_size=BS, max_num_batched_tokens=16,
              max_num_seqs=6, max_model_len=64, skip_tokenizer_init=True)
    assert _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy())) == expected[kind]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_caching_on_equals_off(kind, gemma4, expected):
    prompts = [PROMPTS[3], PROMPTS[3], PROMPTS[3][:21] + [9, 8, 7], PROMPTS[1]]
    runs = {}
    for caching in (True, False):
        llm = LLM(str(gemma4[kind][0]), kv_cache_memory="1MiB", block_size=BS, max_model_len=96,
                  enable_prefix_caching=caching, skip_tokenizer_init=True)
        runs[caching] = [llm.generate({"prompt_token_ids": p}, _greedy())[0].outputs[0].token_ids for p in prompts]
        assert_pages_returned(llm)
        if caching:
            assert llm.engine.kv.stats.hits == 28 + 20  # (the first prompt but its last page; 5 pages of the third)
    assert runs[True] == runs[False]
    assert runs[True][0] == expected[kind][3] and runs[True][3] == expected[kind][1]


@pytest.mark.parametrize("kind", KINDS)
def test_ngram_speculation_equals_plain_greedy(kind, gemma4):
    # (prompts whose greedy continuations repeat bigrams of their context: drafts are accepted)
    prompts = [list(range(100, 120)) * 2, [200, 201] * 8, [3, 4, 5, 6] * 6]
    kw = dict(kv_cache_memory="1MiB", block_size=BS, max_model_len=128, skip_tokenizer_init=True)
    plain = LLM(str(gemma4[kind][0]), **kw)
    spec = LLM(str(gemma4[kind][0]), speculative="ngram", speculative_policy="always", num_draft_tokens=4,
               ngram_min=1, ngram_max=3, **kw)
    want = _tokens(plain.generate([{"prompt_token_ids": p} for p in prompts], _greedy(48)))
    assert _tokens(spec.generate([{"prompt_token_ids": p} for p in prompts], _greedy(48))) == want
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(spec)


# ---------------------------------------------------------------------------------------------- config reading

def _config(**fields) -> ModelConfig:
    raw = dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=32, hidden_size=16,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
               hidden_size_per_layer_input=4, global_head_dim=16) | fields
    return ModelConfig.from_dict(raw, Path("/ckpt"))


def test_config_forms_read_alike(gemma4):
    """The per_layer_config that transformers writes and the global_head_dim / num_global_key_value_heads it is
    derived from give one layout; defaults: every 6th layer global (and the last), window 512."""
    from atlas.models.gemma4 import gemma4_layout

    written = ModelConfig.from_path(gemma4["dense"][0])
    raw = json.loads((gemma4["dense"][0] / "config.json").read_text())
    assert raw["per_layer_config"]  # (transformers 5 writes the derived form)
    raw.pop("per_layer_config")
    raw |= {"global_head_dim": 32, "num_global_key_value_heads": 1}
    assert gemma4_layout(written) == gemma4_layout(ModelConfig.from_dict(raw, Path("/ckpt")))
    layout = gemma4_layout(_config(num_hidden_layers=8))
    assert layout.windows == [512] * 5 + [None, 512, None]
    assert layout.head_dims == [8] * 5 + [16, 8, 16] and layout.kv_heads == [1] * 8


@pytest.mark.parametrize("fields, named", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1.0}}}, "yarn"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1.0},
                          "full_attention": {"rope_type": "linear", "rope_theta": 1.0, "factor": 2.0,
                                             "partial_rotary_factor": 0.5}}}, "partial_rotary_factor"),
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"vocab_size_per_layer_input": 16}, "vocab_size_per_layer_input"),
    ({"per_layer_config": {"1": {"sliding_window": 4}}}, "sliding_window"),
])
def test_what_is_not_computed_exactly_is_refused_by_name(fields, named):
    from atlas.models.gemma4 import Gemma4ForCausalLM

    with pytest.raises(UnsupportedModelError, match=named):
        Gemma4ForCausalLM(_config(**fields), 64)
    Gemma4ForCausalLM(_config(use_bidirectional_attention="vision"), 64)  # (text stays causal: served)


# ---------------------------------------------------------------------------------------------- the shapes tool



def test_tool_shapes_build_as_transformers_builds_them(tmp_path):
    """The tool's Gemma 4 shapes hold the parameters transformers' Gemma4ForCausalLM holds for the same config
    (both built on the meta device: 5.08 B for the Gemma4TextConfig defaults, 2.62 B of them the token and per-layer
    embeddings), and the tiny one, written config-only, generates with --load-format dummy."""
    from transformers import Gemma4ForCausalLM as HFGemma4
    from transformers import Gemma4TextConfig

    from atlas.bench.roofline import ModelShape
    from atlas.models.gemma4 import Gemma4ForCausalLM

    tool = checkpoint_tool()
    for name in ("gemma-4-text-defaults", "gemma-4-tiny"):
        raw = tool.CONFIG_ONLY[name]
        with torch.device("meta"):
            ours = Gemma4ForCausalLM(ModelConfig.from_dict(json.loads(json.dumps(raw)), tmp_path), 8)
            theirs = HFGemma4(Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
        count = sum(p.numel() for p in ours.parameters())  # (transformers keeps layer_scalar as a buffer)
        assert count == sum(p.numel() for p in theirs.parameters()) + sum(
            b.numel() for n, b in theirs.named_buffers() if n.endswith("layer_scalar")), name
        if name == "gemma-4-text-defaults":
            embeddings = ours.model.embed_tokens.weight.numel() + ours.model.embed_tokens_per_layer.weight.numel()
            assert (count, embeddings) == (5_077_177_886, 2_617_245_696)
            # (the roofline reads one row of the per-layer table a token, as of the embedding: not in base_params)
            shape = ModelShape.from_config(json.loads(json.dumps(raw)))
            assert shape.base_params == count - embeddings and shape.embedding_params == 262144 * 2304
    out = tmp_path / "gemma-4-tiny"
    assert tool.main(["--shape", "gemma-4-tiny", "--out", str(out), "--config-only"]) == 0
    llm = LLM(str(out), load_format="dummy", skip_tokenizer_init=True, kv_cache_memory="1MiB", block_size=BS)
    assert [len(t) for t in _tokens(llm.generate([{"prompt_token_ids": [3, 4, 5]}], _greedy(6)))] == [6]
    assert_pages_returned(llm)


def test_pipeline_parallelism_is_refused_by_name():
    from atlas.layers.parallel import ModelParallel, building_with
    from atlas.models.gemma4 import Gemma4ForCausalLM

    with building_with(ModelParallel(pp_size=2)), pytest.raises(UnsupportedModelError, match="pipeline parallelism"):
        Gemma4ForCausalLM(_config(), 64)


@pytest.mark.parametrize("kind, expert_parallel", [("dense", False), ("moe", False), ("moe", True)])
def test_tensor_parallel_matches_transformers(kind, expert_parallel, gemma4, expected):
    """Two ranks on gloo: the local layers' two KV heads split, the global layers' one replicated (and read by the
    KV-shared layers of each rank), every expert's intermediate dimension split (or, with --enable-expert-parallel,
    two whole experts a rank); greedy tokens under preemption equal transformers', prompt logprobs as on one
    device."""
    from test_parallel import PARALLEL

    from atlas.layers.moe import FusedExperts

    kw = dict(num_gpu_blocks_override=16, block_size=BS, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64,
              skip_tokenizer_init=True, num_cpu_threads=1)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    want = LLM(str(gemma4[kind][0]), **kw).generate([{"prompt_token_ids": PROMPTS[3]}], scored)[0].prompt_logprobs
    llm = LLM(str(gemma4[kind][0]), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **kw, **PARALLEL)
    try:
        attn = [layer.self_attn for layer in llm.engine.runner.model.model.layers]  # (rank 0's)
        assert [(a.num_heads, a.num_kv_heads) for a in attn][:2] == [(2, 1), (2, 1)]
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
        assert all(m.expert_parallel == expert_parallel for m in experts) and len(experts) == (kind == "moe") * 3
        assert _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy())) == expected[kind]
        assert llm.engine.scheduler.num_preemptions > 0
        got = llm.generate([{"prompt_token_ids": PROMPTS[3]}], scored)[0].prompt_logprobs
        for g, w in zip(got[1:], want[1:], strict=True):
            assert [(t, g[t].rank) for t in sorted(g)] == [(t, w[t].rank) for t in sorted(w)]
            assert all(g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4) for t in w)
        assert_pages_returned(llm)
    finally:
        llm.shutdown()


def test_kv_shared_layers_unused_projections_are_ignored(gemma4, tmp_path):
    """A checkpoint that still holds k_proj / v_proj / k_norm of its KV-shared layers (transformers ignores them
    on load): they are skipped, the logits unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = gemma4["dense"][0]
    dst = tmp_path / "with-shared-kv"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for i, d, kv in ((2, 16, 2), (3, 32, 1)):
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.randn(kv * d, 64)
        tensors[f"model.layers.{i}.self_attn.k_norm.weight"] = torch.randn(d)
    tensors["model.layers.2.self_attn.v_proj.weight"] = torch.randn(2 * 16, 64)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ids = _ids(20, 4)
    want = atlas_logits(LLM(str(src), kv_cache_memory="4MiB", block_size=BS, skip_tokenizer_init=True), ids, [20])
    got = atlas_logits(LLM(str(dst), kv_cache_memory="4MiB", block_size=BS, skip_tokenizer_init=True), ids, [20])
    assert torch.equal(got, want)
