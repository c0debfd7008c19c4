"""Fixtures: tiny random Hugging Face checkpoints of each supported family, with a real tokenizer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# One torch thread per test process (and per process a test starts): the suite runs in as many
# processes as there are cores, and more threads than cores made small CPU ops hundreds of times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _default_kernel_settings():
    """The kernels' settings are process-wide (kernels/settings.py; each engine sets them from its config at
    start-up): every test starts from the defaults, whatever engine an earlier test of this process built."""
    from atlas.config import TuningConfig
    from atlas.kernels import settings

    if settings.tuning != TuningConfig() or not settings.split_kv:
        settings.set_kernel_settings(TuningConfig(), True)
    yield


def pytest_collection_modifyitems(config, items):
    """The longest tests first (the Triton-interpreter kernel cases, 5-60 s of CPU each, then those marked slow):
    pytest-xdist hands tests out in this order, so the two workers do not end the run with one of them alone on a
    long case. (The sort is stable: the rest keep their order.)"""
    items.sort(key=lambda item: 0 if "interpreter" in item.name else 1 if item.get_closest_marker("slow") else 2)


VOCAB = 384
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# One small config per architecture, each exercising that family's switches.
ARCH_CONFIGS = {
    "LlamaForCausalLM": dict(
        model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
        attention_bias=False, tie_word_embeddings=False),
    "MistralForCausalLM": dict(model_type="mistral", sliding_window=24, tie_word_embeddings=False),
    "Qwen2ForCausalLM": dict(model_type="qwen2", tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(
        model_type="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 128},
        attention_bias=True, tie_word_embeddings=False),
    # Phi-3 / Phi-4: q|k|v and gate|up fused in the checkpoint; a window on every layer
    "Phi3ForCausalLM": dict(model_type="phi3", sliding_window=24, pad_token_id=0, tie_word_embeddings=False),
    # Granite 3: the embedding, attention, residual and logit multipliers (Granite 3.x's values)
    "GraniteForCausalLM": dict(model_type="granite", embedding_multiplier=12.0, attention_multiplier=0.0078125,
                               residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True),
    # OLMo 2: norms after each branch, q / k norms over the whole projections
    "Olmo2ForCausalLM": dict(model_type="olmo2", pad_token_id=0, tie_word_embeddings=False),
    # GLM-4 dense: four norms a block, q / k / v biases, RoPE on interleaved pairs of half of each head
    "Glm4ForCausalLM": dict(model_type="glm4", pad_token_id=0, attention_bias=True, tie_word_embeddings=False),
    # the first GLM-4: GLM-4-0414's attention and fused gate|up in Llama's two-norm block
    "GlmForCausalLM": dict(model_type="glm", pad_token_id=0, attention_bias=True, tie_word_embeddings=False),
    # OLMo 3: OLMo 2's blocks, a window on the sliding layers, RoPE set per layer type
    "Olmo3ForCausalLM": dict(model_type="olmo3", pad_token_id=0, tie_word_embeddings=False, sliding_window=24,
                             layer_types=["sliding_attention", "full_attention"],
                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
    # SmolLM3: the second layer without RoPE
    "SmolLM3ForCausalLM": dict(model_type="smollm3", no_rope_layers=[1, 0], pad_token_id=0, tie_word_embeddings=True),
    # Seed-OSS: q / k / v biases and an o bias of its own
    "SeedOssForCausalLM": dict(model_type="seed_oss", attention_bias=True, attention_out_bias=True, pad_token_id=0,
                               tie_word_embeddings=False),
    # ERNIE 4.5 (dense): biases everywhere, RoPE on interleaved pairs
    "Ernie4_5ForCausalLM": dict(model_type="ernie4_5", use_bias=True, pad_token_id=0, tie_word_embeddings=True),
    # EXAONE 4 (hybrid): post-branch norms, per-head q / k norms, a window on the sliding layers, no RoPE on the others
    "Exaone4ForCausalLM": dict(model_type="exaone4", sliding_window=24, pad_token_id=0, tie_word_embeddings=False,
                               layer_types=["sliding_attention", "full_attention"]),
    # Apertus: per-head q / k norms, the non-gated xIELU MLP, Llama 3's RoPE scaling past 64 positions
    "ApertusForCausalLM": dict(model_type="apertus", pad_token_id=0, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}),
    # Arcee AFM: the non-gated squared-ReLU MLP with biases, YaRN past 64 positions
    "ArceeForCausalLM": dict(model_type="arcee", pad_token_id=0, tie_word_embeddings=False, mlp_bias=True,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 64}),
    # Helium: q / k / v biases, none on o, RoPE on interleaved pairs
    "HeliumForCausalLM": dict(model_type="helium", pad_token_id=0, attention_bias=True, tie_word_embeddings=False),
    # HunYuan dense: q / k norms after RoPE, NTK-alpha RoPE (the base stretched by alpha)
    "HunYuanDenseV1ForCausalLM": dict(model_type="hunyuan_v1_dense", pad_token_id=0, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0,
                                                       "rope_theta": 10000.0}),
}
ARCHS = list(ARCH_CONFIGS)

# The DeepSeek family (MLA + MoE), one config per routing / attention variant. Every one has heads ==
# kv heads (MLA), a dense first layer then MoE layers, and YaRN where the real checkpoints have it.
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
            v_head_dim=16, moe_intermediate_size=32, first_k_dense_replace=1, num_hidden_layers=3)
DEEPSEEK_CONFIGS = {
    # V3: q_lora, sigmoid scores + correction bias, grouped top-k (noaux_tc), YaRN with mscale, one MTP module.
    "v3": dict(_MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=32,
               n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
               routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}),
    # V2-Lite shaped: no q_lora, softmax greedy routing, two shared experts, YaRN (mscale 0.707 both).
    "v2-lite": dict(_MLA, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
                    n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2, topk_method="greedy",
                    routed_scaling_factor=1.0, norm_topk_prob=False,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # V2 shaped: q_lora, group_limited_greedy routing, scaled weights, plain RoPE.
    "v2": dict(_MLA, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=32,
               n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
               topk_method="group_limited_greedy", routed_scaling_factor=2.0, norm_topk_prob=False),
}


# A tiny Gemma 3 text model: two sliding layers of window 12, then a global one, each kind with its own RoPE (the
# global one linearly scaled), an attention scale off head_dim, and final-logit soft-capping.
GEMMA3_CONFIG = dict(
    model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], num_hidden_layers=3, query_pre_attn_scalar=24,
    sliding_window=12, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                     "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    final_logit_softcapping=20.0, hidden_activation="gelu_pytorch_tanh")


# A tiny Gemma 4 text model: local window 6 and global layers of their own head size (32 against 16), with one KV
# head where the local ones have two and keys doubling as values (attention_k_eq_v), proportional RoPE on the global
# layers, per-layer embeddings of 8, the last two layers reading the first two's K/V with double-wide MLPs, and
# final-logit soft-capping; an untied LM head (tied, the scaled embedding makes a tiny random model repeat its last
# token). GEMMA4_MOE: the MoE variant (dense MLP + 4 experts, top 2), no per-layer embeddings.
GEMMA4_CONFIG = dict(
    model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], num_hidden_layers=4, sliding_window=6,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], global_head_dim=32,
    num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
    num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=5.0, pad_token_id=0,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 10000.0}})
GEMMA4_MOE_CONFIG = dict(
    GEMMA4_CONFIG, num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    attention_k_eq_v=False, num_global_key_value_heads=None, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
    use_double_wide_mlp=False, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def gemma4_extras(model: torch.nn.Module, seed: int) -> None:
    """Gemma 4's buffers and scales away from 1: each layer's layer_scalar, the router's scale and per-expert
    scale (so that a model that skipped them would differ)."""
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))


def build_gemma4_checkpoint(root: Path, tokenizer_dir: Path | None = None, seed: int = 0, moe: bool = False,
                            **overrides) -> Path:
    """A tiny random Gemma4ForCausalLM checkpoint (GEMMA4_CONFIG or GEMMA4_MOE_CONFIG with `overrides`)."""
    spec = GEMMA4_MOE_CONFIG if moe else GEMMA4_CONFIG
    return _build(root, f"gemma4-{'moe-' if moe else ''}{seed}", spec, tokenizer_dir, seed, overrides,
                  randomize=gemma4_extras)


def _gemma_norms(model: torch.nn.Module, seed: int) -> None:
    """Gemma's norms scale by (1 + weight): weights around 0, not 1."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def build_gemma3_checkpoint(root: Path, tokenizer_dir: Path | None = None, seed: int = 0, **overrides) -> Path:
    """A tiny random Gemma3ForCausalLM checkpoint (GEMMA3_CONFIG with `overrides`)."""
    return _build(root, f"gemma3-{seed}", GEMMA3_CONFIG, tokenizer_dir, seed, overrides, randomize=_gemma_norms)


def _corpus() -> str:
    import textwrap

    return Path(textwrap.__file__).read_text() * 2


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained on a stdlib module, with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_corpus()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = CHATML
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Large random weights (and non-trivial norms and biases), so that logits are far from ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_checkpoint(root: Path, arch: str, tokenizer_dir: Path | None, seed: int = 0, **overrides) -> Path:
    return _build(root, f"{arch}-{seed}", {**ARCH_CONFIGS[arch], "architectures": [arch]}, tokenizer_dir, seed,
                  overrides)


def _build(root: Path, name: str, spec: dict, tokenizer_dir: Path | None, seed: int, overrides: dict,
           randomize=None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    model_type = spec.pop("model_type")
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0)
    fields.update(spec)
    fields.update(overrides)
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    if randomize is not None:
        randomize(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    out = root / name
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(root, arch, tokenizer_dir) for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen3_dir(checkpoints) -> Path:
    return checkpoints["Qwen3ForCausalLM"]


def _correction_bias(model: torch.nn.Module, seed: int) -> None:
    """Non-zero e_score_correction_bias (a buffer, so _randomize leaves it at zero): routing must use it
    to choose experts and not to weight them."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))


def mtp_reference_layer(ckpt: Path):
    """transformers' decoder layer at index num_hidden_layers (the MTP module's block) plus the MTP
    tensors of the checkpoint: (layer, {enorm, hnorm, eh_proj, shared_head.norm, shared_head.head})."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt)
    n = cfg.num_hidden_layers
    prefix = f"model.layers.{n}."
    tensors = {k[len(prefix):]: v.float() for k, v in load_file(str(ckpt / "model.safetensors")).items()
               if k.startswith(prefix)}
    layer = mtp_decoder_layer(cfg, n).float().eval()
    state = {}
    e_count = cfg.n_routed_experts
    for k, v in tensors.items():
        if ".experts." not in k and not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")):
            state[k] = v
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"]])
         for e in range(e_count)])
    state["mlp.experts.down_proj"] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"] for e in range(e_count)])
    layer.load_state_dict(state, strict=True)
    return layer, {k: v for k, v in tensors.items() if k.startswith(("enorm", "hnorm", "eh_proj", "shared_head"))}


def mtp_decoder_layer(cfg, n: int):
    """transformers' decoder layer of the family at index n (the MTP block is one more of them, with a sparse MLP
    and, in V3.2 and GLM-5, a DSA indexer of its own): V3's, V3.2's or GLM-5's."""
    import copy

    if cfg.model_type == "deepseek_v32":
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer as Layer
    elif cfg.model_type == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer as Layer
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer as Layer
    cfg = copy.deepcopy(cfg)
    # (the per-layer lists of the newer configs stop at the main model's layers)
    for key, kind in (("mlp_layer_types", "sparse"), ("indexer_types", "full")):
        if isinstance(getattr(cfg, key, None), list) and len(getattr(cfg, key)) <= n:
            setattr(cfg, key, getattr(cfg, key) + [kind] * (n + 1 - len(getattr(cfg, key))))
    return Layer(cfg, layer_idx=n)


def _add_mtp_module(ckpt: Path, seed: int) -> None:
    """Append one MTP module (layer index num_hidden_layers) to the checkpoint as DeepSeek-V3 ships it:
    enorm, hnorm, eh_proj, shared_head.{norm, head}, a copy of the embedding, and a decoder block with
    per-expert names. transformers ignores these tensors."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from atlas.training.mtp_model import mtp_checkpoint_tensors

    cfg = AutoConfig.from_pretrained(ckpt)
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    torch.manual_seed(seed + 2)
    layer = mtp_decoder_layer(cfg, n)
    _randomize(layer, seed + 2)
    _correction_bias(layer, seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    state = {"block." + k: v for k, v in layer.state_dict().items()}
    state |= {"enorm.weight": 1.0 + 0.2 * torch.randn(d, generator=g),
              "hnorm.weight": 1.0 + 0.2 * torch.randn(d, generator=g),
              "eh_proj.weight": torch.randn(d, 2 * d, generator=g) / (2 * d) ** 0.5,
              "head_norm.weight": 1.0 + 0.2 * torch.randn(d, generator=g)}
    head = torch.randn(cfg.vocab_size, d, generator=g) / d ** 0.5
    tensors |= mtp_checkpoint_tensors(state, tensors["model.embed_tokens.weight"], head, n)
    save_file(tensors, str(path), metadata={"format": "pt"})


def build_deepseek_checkpoint(root: Path, name: str, tokenizer_dir: Path | None = None, seed: int = 0,
                              **overrides) -> Path:
    """A tiny random DeepSeek checkpoint (DEEPSEEK_CONFIGS[name]), with a non-zero routing correction bias
    and, where the config has num_nextn_predict_layers, its MTP module."""
    spec = DEEPSEEK_CONFIGS[name]
    out = _build(root, f"deepseek-{name}-{seed}", spec, tokenizer_dir, seed, overrides, randomize=_correction_bias)
    if {**spec, **overrides}.get("num_nextn_predict_layers"):
        _add_mtp_module(out, seed)
    return out


@pytest.fixture(scope="session")
def deepseek_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: build_deepseek_checkpoint(root, name) for name in DEEPSEEK_CONFIGS}


def assert_same_tokens_and_logprobs(got, want, tol: float = 1e-4) -> None:
    """got and want: per request (token ids, per position {token id: logprob}); the same tokens and the same top
    logprob entries, each within tol (a split engine sums in another order than one device)."""
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        assert gt == wt
        for g, w in zip(gl, wl, strict=True):
            assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < tol for t in w)


def assert_tight_pool_gives(tight, prompts, params, expected) -> None:
    """An engine whose KV pool is too small for `prompts` together (preemption) and keeps prefix caching on: the
    expected tokens all the same, with a preemption and prefix hits, prompt 3 again reusing at least 16 cached
    tokens, and every page back."""
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.kv.stats.hits > 0
    again = tight.generate({"prompt_token_ids": prompts[3]}, params)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == expected[3]
    assert_pages_returned(tight)


def assert_pages_returned(llm) -> None:
    """Every KV page is back in the pool and nothing is left queued."""
    engine = llm.engine if hasattr(llm, "engine") else llm
    assert not engine.has_unfinished()
    assert engine.kv.num_free_pages == engine.kv.num_pages, (
        f"{engine.kv.num_pages - engine.kv.num_free_pages} KV pages leaked")
    assert all(c == 0 for c in engine.kv.pool.ref_cnt)
    window = getattr(engine.kv, "window", None)  # (KV cache groups: the windowed layers' own pool)
    if window is not None:
        assert window.num_free_pages == window.num_pages, (
            f"{window.num_pages - window.num_free_pages} window-group KV pages leaked")
        assert all(c == 0 for c in window.pool.ref_cnt)


def random_ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """n random token ids of the tiny vocabulary, reproducible by seed."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generated_tokens(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """Each prompt's output tokens, the prompts in one batch."""
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def check_batched_and_cached(llm, prompts: list[list[int]], expected: list[list[int]], params) -> None:
    """The prompts in one batch (on an engine made tight enough to preempt and chunk), then the last one again from
    the prefix cache: the expected tokens each time, and every page back."""
    assert generated_tokens(llm, prompts, params) == expected
    again = llm.generate({"prompt_token_ids": prompts[-1]}, params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == expected[-1]
    assert_pages_returned(llm)


def continuous_arrivals(llm, prompts: list[list[int]], lengths: list[int], running: int = 3) -> list[list[int]]:
    """Greedy requests of the given output lengths, a new one added each time one ends (at most `running` at
    once), so that each arrival meets the others' decodes or verify rows in a mixed step. -> tokens in order."""
    from atlas import SamplingParams
    from atlas.bench.offline import run_pass

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    return [o.outputs[0].token_ids for o in run_pass(llm, prompts, running, params, "continuous")]


def tool_module(name: str):
    """tools/<name>.py as a module (a tool's main takes the command line's arguments)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkpoint_tool():
    """tools/make_random_checkpoint.py as a module."""
    return tool_module("make_random_checkpoint")


# The KV cache of a CUDA test's tiny-model engine: a fixed size (--kv-cache-memory) rather than a share of the GPU, so
# that the CUDA tests' pytest workers (three on one H200) start their engines beside each other's.
CUDA_KV = "256MiB"


def hf_model(path: Path, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


# transformers releases before these computed the family differently from its published checkpoints (and from vLLM):
# MiniMax-M2 ignored `rotary_dim` (RoPE over the whole head) before 5.18; Bamba and Granite 4.0-H normalized the gated
# Mamba-2 output over its whole width, not per group, before 5.23. The test extra installs a fixed release; the GPU
# machine's may be older, and there the CUDA tests compare with Atlas's CPU path, which CI checks against a fixed one.
REFERENCE_FIXED_IN = {"minimax_m2": (5, 18), "bamba": (5, 23), "granitemoehybrid": (5, 23)}


def stale_reference(path: Path) -> bool:
    """Whether the installed transformers predates its fix for this checkpoint's family (REFERENCE_FIXED_IN)."""
    import json

    import transformers

    fixed = REFERENCE_FIXED_IN.get(json.loads((Path(path) / "config.json").read_text())["model_type"])
    installed = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    return fixed is not None and installed < fixed


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def hf_greedy_margins(model, prompts: list[list[int]], max_new_tokens: int
                      ) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens of each prompt and, at each step, how far apart its best two logits are."""
    device = next(model.parameters()).device
    tokens, margins = [], []
    for prompt_ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens,
                                 output_scores=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt_ids):].tolist())
        margins.append([float(t[0] - t[1]) for t in (s[0].float().topk(2).values for s in out.scores)])
    return tokens, margins


def atlas_greedy_margins(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Atlas's greedy tokens of each prompt and, at each step, how far apart the best two logits are (the difference
    of their log-probabilities)."""
    from atlas import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    margins = [[float(a - b) for a, b in (sorted((e.logprob for e in step.values()), reverse=True)[:2]
                                          for step in o.logprobs)] for o in outs]
    return [o.token_ids for o in outs], margins


def assert_greedy_agrees(got: list[list[int]], want: list[list[int]], margins: list[list[float]],
                         tol: float = 0.01) -> None:
    """Greedy tokens against a reference computed another way (another device, other kernels and summation orders):
    equal up to the first step whose reference logits have their best two within `tol` of each other, a near-tie
    that rounding may break either way (the continuations after it may then differ). A difference before is a
    failure."""
    for i, (g, w, m) in enumerate(zip(got, want, margins, strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        assert first is None or m[first] < tol, (f"prompt {i}: token {first} differs where the reference's best two "
                                                 f"logits are {m[first]:.4g} apart", g, w)


def run_cases_script(script: str, *args: str, timeout: float = 600, **env: str) -> str:
    """Run tests/<script> (kernel cases against their references) with `env` added to the environment, importing
    atlas from this checkout rather than whichever copy is installed; -> its stdout (it must succeed)."""
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": path, **env}, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def run_in_triton_interpreter(script: str, *args: str, timeout: float = 600) -> str:
    """run_cases_script under Triton's CPU interpreter, with no GPU visible."""
    return run_cases_script(script, *args, timeout=timeout, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")


def step_input_numbers(inputs) -> dict:
    """Everything a prepared step (runtime.step_inputs.StepInputs) hands the model and the sampler, copied off the
    reused buffers, for comparing two ways of preparing the same step."""
    meta = inputs.meta
    tensors = {"input_ids": inputs.input_ids, "positions": inputs.positions, "sample_rows": inputs.sample_rows,
               "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens, "page_tables": meta.page_tables,
               "slot_mapping": meta.slot_mapping}
    if meta.programs is not None:
        tensors |= {"programs0": meta.programs.req, "programs1": meta.programs.q0}
    out = {k: v.clone() for k, v in tensors.items()}
    out |= {"qsl_cpu": list(meta.query_start_loc_cpu), "seq_lens_cpu": list(meta.seq_lens_cpu),
            "max_query_len": meta.max_query_len, "max_seq_len": meta.max_seq_len, "rows": inputs.num_sample_rows,
            "owner": inputs.sample_owner, "offset": inputs.sample_offset, "all_rows": inputs.all_rows_sampled}
    return out


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full precision (the CUDA tests compare fp32 results exactly)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def compiled_variants(kernel) -> int | None:
    """How many variants of a Triton kernel are compiled in this process (None where Triton hides its cache)."""
    caches = getattr(kernel, "device_caches", None)  # Triton >= 3.2: device -> (kernel cache, ...)
    if not caches:
        return None
    return sum(len(c[0]) for c in caches.values())
