"""The GQA + mixture-of-experts families (models/sparse_moe.py): Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 / 4.6,
dots.llm1, ERNIE 4.5 MoE, OLMoE and MiniMax-M2 (models/minimax_m2.py) against
transformers on tiny random checkpoints (fp32, CPU): routing, logits of prefill, chunked prefill and decode; greedy
tokens under batching, chunking, preemption and prefix-cache hits; n-gram speculation; tensor (and expert)
parallelism; what is refused; and the random-checkpoint tool's shapes of the three families."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    CUDA_KV,
    _build,
    _correction_bias,
    assert_greedy_agrees,
    assert_pages_returned,
    atlas_greedy_margins,
    checkpoint_tool,
    hf_greedy,
    hf_greedy_margins,
    hf_model,
    stale_reference,
)
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams
from atlas.errors import AtlasError, ConfigError, ModelLoadError, UnsupportedModelError
from atlas.layers.moe import FusedExperts, select_experts

# One config per family, every switch of it on: QK-norm with q/k/v/o biases, YaRN, a dense layer among the MoE
# layers (mlp_only_layers) and un-renormalized softmax weights (Qwen3-MoE); plain attention and renormalized
# top-2 of 4 experts (Mixtral); partial RoPE, QK-norm, q/k/v biases, a dense first layer, a shared expert, grouped
# sigmoid routing with a correction bias and a scaling factor (GLM-4.5).
CONFIGS = {
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                      mlp_only_layers=[1], attention_bias=True,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
    "glm4_moe": dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_hidden_layers=3,
                     n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, num_nextn_predict_layers=1),
    # Solar Open: GLM-4.5's experts in every layer under Llama's attention (whole-head RoPE, no q / k norms)
    "solar_open": dict(architectures=["SolarOpenForCausalLM"], model_type="solar_open", num_hidden_layers=2,
                       n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
                       n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True),
    # MiniMax-M2: q / k norms over the whole projections, RoPE on rotary_dim 8 of head_dim 16, sigmoid top-2 of 8
    # chosen with a correction bias, Mixtral's checkpoint names
    "minimax_m2": dict(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", num_local_experts=8,
                       num_experts_per_tok=2, intermediate_size=32, rotary_dim=8),
    # dots.llm1: Qwen3's attention (q / k norms, biases) and DeepSeek-V3's grouped sigmoid routing with a correction
    # bias, un-renormalized weights times a scaling factor, a shared expert, a dense first layer
    "dots1": dict(architectures=["Dots1ForCausalLM"], model_type="dots1", num_hidden_layers=3, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
                  n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=False, attention_bias=True,
                  sliding_window=None),
    # Qwen2-MoE: q / k / v biases, softmax top-2 of 8 not renormalized, a shared expert of its own width behind a
    # sigmoid gate, a dense layer (mlp_only_layers)
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_hidden_layers=3,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1]),
    # OLMoE: whole-projection q / k norms, softmax top-2 of 8 renormalized
    "olmoe": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", num_experts=8, num_experts_per_tok=2,
                  intermediate_size=32, norm_topk_prob=True),
    # ERNIE 4.5 MoE: RoPE on interleaved pairs, softmax top-2 of 8 chosen with a correction bias, a shared expert,
    # MoE on every second layer from layer 1 (moe_layer_interval 2: layers 1 and 3 of 4), tied embeddings
    "ernie4_5_moe": dict(architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe", num_hidden_layers=4,
                         moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                         moe_layer_interval=2, use_bias=False, tie_word_embeddings=True, pad_token_id=0),
    # GraniteMoeShared (Granite 3.x MoE with a shared expert): Mixtral's routing (top-2 of 8 by logits, softmax over
    # them), a shared SwiGLU expert of its own width, q / k / v / o biases, Granite's four constants
    "granitemoeshared": dict(architectures=["GraniteMoeSharedForCausalLM"], model_type="granitemoeshared",
                             num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=48, attention_bias=True, embedding_multiplier=3.0,
                             attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0),
    # Hunyuan-A13B: q / k norms after RoPE, NTK-alpha RoPE, softmax top-2 of 8 over float32 logits renormalized, a
    # shared expert as wide as the routed ones
    "hunyuan_v1_moe": dict(architectures=["HunYuanMoEV1ForCausalLM"], model_type="hunyuan_v1_moe", num_experts=8,
                           moe_topk=2, intermediate_size=32, pad_token_id=0,
                           rope_parameters={"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0,
                                            "rope_theta": 10000.0}),
}
FAMILIES = list(CONFIGS)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def build_moe_checkpoint(root: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint of the family (a non-zero correction bias where it has one), no tokenizer."""
    return _build(root, f"{family}-{seed}", CONFIGS[family], None, seed, overrides, randomize=_correction_bias)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {family: build_moe_checkpoint(root, family) for family in FAMILIES}


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw})


@pytest.fixture(scope="module")
def llms(checkpoints):
    return {family: _llm(path) for family, path in checkpoints.items()}


def _prompts() -> list[list[int]]:
    """Six prompts of 5 to 57 tokens, four of which share a 24-token prefix (three pages), with repeats for n-gram
    lookup."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 384, (24,), generator=g).tolist()
    tails = [torch.randint(1, 384, (n,), generator=g).tolist() for n in (3, 27, 9, 14)]
    return [shared + t + t[:6] for t in tails] + [[5, 17, 42, 99, 3], list(range(100, 131))]


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens of _prompts(), per family."""
    out = {}
    for family, path in checkpoints.items():
        model = hf_model(path)
        out[family] = [hf_greedy(model, p, GREEDY.max_tokens) for p in _prompts()]
    return out


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


# --------------------------------------------------------------------------- the routers
class _MiniMaxRouter(torch.nn.Module):
    """transformers' MiniMax-M2 router with its block's correction bias beside it (the block passes it in)."""

    def __init__(self, config):
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

        super().__init__()
        self.router = MiniMaxM2TopKRouter(config)
        self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(config.num_local_experts), requires_grad=False)

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.router.weight

    def forward(self, x: torch.Tensor):
        return self.router(x, self.e_score_correction_bias)


class _ErnieRouter(torch.nn.Module):
    """transformers' ERNIE 4.5 MoE router, its correction bias ([1, experts] in moe_statics) reachable as the others'."""

    def __init__(self, config):
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

        super().__init__()
        self.router = Ernie4_5_MoeTopKRouter(config)

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.router.weight

    @property
    def e_score_correction_bias(self) -> torch.nn.Parameter:
        return self.router.moe_statics.e_score_correction_bias

    def forward(self, x: torch.Tensor):
        return self.router(x)


class _HunYuanRouter(torch.nn.Module):
    """transformers' HunYuan MoE gate (`wg`, float32 even in a bf16 model, as transformers builds it), its weight
    reachable as the others'."""

    def __init__(self, config):
        from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Gate

        super().__init__()
        self.gate = HunYuanMoEV1Gate(config, layer_idx=0)

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.gate.wg.weight

    def _apply(self, fn, recurse=True):  # (a dtype cast leaves the gate in float32, as transformers keeps it)
        super()._apply(fn, recurse)
        self.gate.wg.float()
        return self

    def forward(self, x: torch.Tensor):
        return self.gate(x)


def _hf_router(family: str):
    """transformers' router of the family over 16 experts (4 groups of 4 for GLM), with random weights (and bias)
    -> (router, our RouterConfig, correction bias or None)."""
    from transformers import (
        Dots1Config,
        Ernie4_5_MoeConfig,
        Glm4MoeConfig,
        MiniMaxM2Config,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )
    from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.granitemoeshared.modeling_granitemoeshared import (
        GraniteMoeSharedConfig,
        GraniteMoeSharedTopKRouter,
    )
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from atlas.models.sparse_moe import checked_router

    g = torch.Generator().manual_seed(7)
    bias = None
    if family == "qwen3_moe":
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                                   norm_topk_prob=True))
        ours = checked_router("test", 16, 4, "softmax", "greedy", 1, 1, True, 1.0)
    elif family == "mixtral":
        router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=16, num_experts_per_tok=2))
        ours = checked_router("test", 16, 2, "softmax", "greedy", 1, 1, True, 1.0)
    elif family == "qwen2_moe":
        router = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                                   norm_topk_prob=False))
        ours = checked_router("test", 16, 4, "softmax", "greedy", 1, 1, False, 1.0)
    elif family == "olmoe":
        router = OlmoeTopKRouter(OlmoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True))
        ours = checked_router("test", 16, 4, "softmax", "greedy", 1, 1, True, 1.0)
    elif family == "dots1":
        router = Dots1TopkRouter(Dots1Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                             topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=False))
        bias = 0.3 * torch.randn(16, generator=g)
        router.e_score_correction_bias.copy_(bias)
        ours = checked_router("test", 16, 4, "sigmoid", "noaux_tc", 4, 2, False, 2.5)
    elif family == "ernie4_5_moe":
        router = _ErnieRouter(Ernie4_5_MoeConfig(hidden_size=32, moe_num_experts=16, moe_k=4))
        bias = 0.3 * torch.randn(16, generator=g)
        router.e_score_correction_bias.copy_(bias[None])
        ours = checked_router("test", 16, 4, "softmax", "noaux_tc", 1, 1, True, 1.0)
    elif family == "granitemoeshared":
        router = GraniteMoeSharedTopKRouter(GraniteMoeSharedConfig(hidden_size=32, num_local_experts=16,
                                                                   num_experts_per_tok=4))
        ours = checked_router("test", 16, 4, "softmax", "greedy", 1, 1, True, 1.0)
    elif family == "hunyuan_v1_moe":
        router = _HunYuanRouter(_hf_router_config(family, 32, checked_router("test", 16, 4, "softmax", "greedy", 1, 1,
                                                                             True, 1.0)))
        ours = checked_router("test", 16, 4, "softmax", "greedy", 1, 1, True, 1.0)
    elif family == "minimax_m2":
        router = _MiniMaxRouter(MiniMaxM2Config(hidden_size=32, num_local_experts=16, num_experts_per_tok=4))
        bias = 0.3 * torch.randn(16, generator=g)
        router.e_score_correction_bias.copy_(bias)
        ours = checked_router("test", 16, 4, "sigmoid", "noaux_tc", 1, 1, True, 1.0)
    else:
        router = Glm4MoeTopkRouter(Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                                 topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True))
        bias = 0.3 * torch.randn(16, generator=g)
        router.e_score_correction_bias.copy_(bias)
        ours = checked_router("test", 16, 4, "sigmoid", "noaux_tc", 4, 2, True, 2.5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
    return router, ours, bias


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_matches_transformers(family):
    """The same experts and weights as the family's transformers router, from the same logits (DeepSeek's routing
    function serves all three: softmax top-k renormalized or not, and grouped sigmoid with a correction bias)."""
    router, ours, bias = _hf_router(family)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
    w, ids = select_experts(logits.float(), ours, bias)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.float().gather(1, hf_order))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_routers_choose_the_experts_transformers_chooses(family, checkpoints):
    """In bf16, each family's router as the model builds it (its settings read from the checkpoint's config) picks
    the experts transformers' router picks: Qwen3-MoE's and Mixtral's compute their logits in the model dtype, as
    transformers does (float32 logits would pick others where two experts' bf16 logits tie or cross), GLM's in
    float32, as its reference does; MiniMax-M2's in the model dtype too, ERNIE's in float32. 64 experts, 4,096
    tokens."""
    from atlas.config import ModelConfig
    from atlas.layers.moe import TopKRouter
    from atlas.models.loader import constructing
    from atlas.models.registry import model_class

    router, _, bias = _hf_router(family)  # (its type; rebuilt wider below)
    cfg = ModelConfig.from_path(checkpoints[family])
    settings = model_class(cfg).read_settings(cfg, 512)
    ours_cfg = dataclasses.replace(settings.router, num_experts=64)
    g = torch.Generator().manual_seed(11)
    # (bf16 values, as a checkpoint stores them: GLM's router reads them into float32)
    weight = (torch.randn(64, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5).to(torch.bfloat16).float()
    hf = type(router)(_hf_router_config(family, cfg.hidden_size, ours_cfg))
    with torch.no_grad():
        hf.weight.copy_(weight)
        if bias is not None:
            hf.e_score_correction_bias.copy_(0.3 * torch.randn(64, generator=g))
    hf = hf.to(torch.bfloat16)
    if bias is not None:
        hf.e_score_correction_bias.data = hf.e_score_correction_bias.data.float()
    with constructing(torch.device("cpu"), torch.bfloat16):
        ours = TopKRouter(cfg.hidden_size, ours_cfg, correction_bias=bias is not None)
    with torch.no_grad():
        ours.weight.copy_(weight)
        if bias is not None:
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias.reshape(-1))
    x = torch.randn(4096, cfg.hidden_size, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        _, hf_w, hf_ids = hf(x)
        w, ids = ours(x)
    float32_routers = ("glm4_moe", "solar_open", "ernie4_5_moe", "dots1", "hunyuan_v1_moe")
    assert ours.weight.dtype == (torch.float32 if family in float32_routers else torch.bfloat16)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    # (transformers rounds Qwen3-MoE's and GLM's weights to the logits' dtype; Atlas keeps them in float32)
    torch.testing.assert_close(w.gather(1, order), hf_w.float().gather(1, hf_order), atol=2 ** -8, rtol=2 ** -7)


def _hf_router_config(family: str, hidden: int, cfg):
    """transformers' config for the family's router with our RouterConfig's experts, top-k and groups."""
    from transformers import (
        Dots1Config,
        Ernie4_5_MoeConfig,
        Glm4MoeConfig,
        MiniMaxM2Config,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    if family == "qwen2_moe":
        return Qwen2MoeConfig(hidden_size=hidden, num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                              norm_topk_prob=cfg.norm_topk_prob)
    if family == "olmoe":
        return OlmoeConfig(hidden_size=hidden, num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                           norm_topk_prob=cfg.norm_topk_prob)
    if family == "dots1":
        return Dots1Config(hidden_size=hidden, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                           n_group=cfg.n_group, topk_group=cfg.topk_group,
                           routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
    if family == "ernie4_5_moe":
        return Ernie4_5_MoeConfig(hidden_size=hidden, moe_num_experts=cfg.num_experts, moe_k=cfg.top_k)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(hidden_size=hidden, num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                              norm_topk_prob=cfg.norm_topk_prob)
    if family == "minimax_m2":
        return MiniMaxM2Config(hidden_size=hidden, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k)
    if family == "granitemoeshared":
        from transformers import GraniteMoeSharedConfig

        return GraniteMoeSharedConfig(hidden_size=hidden, num_local_experts=cfg.num_experts,
                                      num_experts_per_tok=cfg.top_k)
    if family == "hunyuan_v1_moe":
        from transformers import HunYuanMoEV1Config

        return HunYuanMoEV1Config(hidden_size=hidden, num_experts=cfg.num_experts, moe_topk=cfg.top_k,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    if family == "mixtral":
        return MixtralConfig(hidden_size=hidden, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k)
    return Glm4MoeConfig(hidden_size=hidden, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                         n_group=cfg.n_group, topk_group=cfg.topk_group,
                         routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("family", FAMILIES)
def test_single_row_routers_run_the_gemv_on_cuda_and_give_transformers_tokens(family, checkpoints):
    """On CUDA a decode step's router takes the small-M GEMV (its shape recorded at load, like a linear layer's):
    one request at a time in float32, transformers' greedy tokens on the same GPU."""
    from atlas.kernels import gemv

    path = checkpoints[family]
    cfg = json.loads((path / "config.json").read_text())
    experts = (cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("moe_num_experts")
               or cfg["n_routed_experts"])
    llm = _llm(path, device="cuda", dtype="float32", kv_cache_memory=CUDA_KV)
    assert gemv.choice(experts, cfg["hidden_size"], torch.float32) is not None
    prompts = _prompts()[3:]
    # (the tokens equal up to a near-tie of the reference's logits: tests/conftest.assert_greedy_agrees)
    if stale_reference(path):  # (this transformers computes the family wrongly: Atlas's CPU path is the reference)
        want, margins = atlas_greedy_margins(_llm(path, device="cpu", dtype="float32"), prompts, GREEDY.max_tokens)
    else:
        ref = hf_model(path, dtype=torch.float32, device="cuda")
        want, margins = hf_greedy_margins(ref, prompts, GREEDY.max_tokens)
    assert_greedy_agrees([_tokens(llm, [prompt])[0] for prompt in prompts], want, margins)  # (one at a time)
    assert_pages_returned(llm)


def test_moe_layers_follow_the_config_as_transformers_builds_them(tmp_path):
    """Which layers are MoE: Qwen3-MoE's decoder_sparse_step and mlp_only_layers, GLM's first_k_dense_replace,
    ERNIE's moe_layer_interval between moe_layer_start_index and moe_layer_end_index."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from atlas.config import ModelConfig
    from atlas.models.registry import model_class

    cases = [("qwen3_moe", dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])),
             ("glm4_moe", dict(num_hidden_layers=4, first_k_dense_replace=2)),
             ("ernie4_5_moe", dict(num_hidden_layers=7, moe_layer_start_index=2, moe_layer_end_index=5))]
    for family, fields in cases:
        spec = {**CONFIGS[family], **fields, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
        spec.pop("model_type")
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **spec))
        hf_moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
        cfg = ModelConfig.from_dict(spec, tmp_path)
        with torch.device("meta"):
            ours = model_class(cfg)(cfg, 64)
        assert [i for i, layer in enumerate(ours.model.layers) if isinstance(getattr(layer.mlp, "experts", None),
                                                                              FusedExperts)] == hf_moe
        assert hf_moe and len(hf_moe) < len(hf.model.layers)


# --------------------------------------------------------------------------- against transformers, end to end
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_chunked_and_decode_logits_match_transformers(family, checkpoints, llms):
    """One prefill, then chunks that start mid-page over the cached K/V, then decode steps: every position's
    logits within 1e-4 (rtol and atol) of transformers' in float32."""
    ids = torch.randint(0, 384, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    want = hf_logits(checkpoints[family], ids)
    torch.testing.assert_close(atlas_logits(llms[family], ids, [60]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llms[family], ids, [13, 21, 9] + [1] * 17), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_batched_chunked_preempted_and_from_the_prefix_cache(family, checkpoints, expected):
    """transformers' greedy tokens for a batch of prompts of different lengths: without prefix caching with room to
    spare, and with 16 pages of 8 tokens for six requests of up to 73 tokens (preemption forced), 32-token steps
    (chunked prefills) and the shared prefix served from the prefix cache."""
    prompts = _prompts()
    roomy = _llm(checkpoints[family], enable_prefix_caching=False, kv_cache_memory="16MiB")
    assert _tokens(roomy, prompts) == expected[family]
    assert_pages_returned(roomy)
    llm = _llm(checkpoints[family], num_gpu_blocks_override=16, max_num_batched_tokens=32, max_model_len=80,
               max_num_seqs=6)
    assert _tokens(llm, prompts) == expected[family]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.stats.hits > 0
    again = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY)[0]
    assert again.num_cached_tokens >= 24 and again.outputs[0].token_ids == expected[family][1]
    assert_pages_returned(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_speculation_equals_plain_greedy(family, checkpoints, expected):
    llm = _llm(checkpoints[family], speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
               ngram_max=3)
    assert _tokens(llm, _prompts()) == expected[family]
    stats = llm.engine.stats
    assert stats.spec_num_verify_steps > 0 and stats.spec_num_draft_tokens > 0
    assert_pages_returned(llm)


# --------------------------------------------------------------------------- tensor and expert parallelism
@pytest.mark.parametrize("family,tp,pp,expert_parallel", [("glm4_moe", 2, 1, False), ("qwen3_moe", 2, 1, True),
                                                        ("mixtral", 1, 2, False), ("minimax_m2", 2, 1, False),
                                                        ("granitemoeshared", 2, 1, False),
                                                        ("hunyuan_v1_moe", 2, 1, False)])
def test_parallel_matches_one_device(family, tp, pp, expert_parallel, checkpoints):
    """Two ranks on gloo: logprobs, greedy tokens with preemption and prefix hits, seeded samples and n-gram drafts
    as on one device (tests/test_parallel.py's comparison). GLM with tensor parallelism: every expert and the shared
    expert sharded, q/k/v biases with an unbiased o_proj; Qwen3-MoE with --enable-expert-parallel (4 whole experts a
    rank), an o_proj bias; Mixtral in two pipeline stages; MiniMax-M2's whole-projection q / k norms summing their
    squares over the ranks; GraniteMoeShared's residual multiplier folded into each rank's shards (and the o_proj
    bias); HunYuan's q / k norms after RoPE on each rank's heads. The families share every layer's code but the
    attention's norms, so one layout each."""
    from test_parallel import ENGINE, PARALLEL, check_against_one_device

    llm = LLM(str(checkpoints[family]), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              enable_expert_parallel=expert_parallel, **ENGINE, **PARALLEL)
    try:
        moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts))
        assert moe.expert_parallel == expert_parallel and moe.w13.shape[1] == 2 * moe.full_intermediate_size // (
            1 if expert_parallel else tp)
        check_against_one_device(llm, {f"moe-{family}": checkpoints[family]}, f"moe-{family}")
    finally:
        llm.shutdown()


# --------------------------------------------------------------------------- loaded as the reference means, or refused
def _variant(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of checkpoint src with config.json fields set and tensors added."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    if tensors:
        save_file({**load_file(str(dst / "model.safetensors")), **tensors}, str(dst / "model.safetensors"))
    return dst


def test_a_binding_sliding_window_is_refused_naming_it(checkpoints, tmp_path):
    """Mixtral's sliding_window (and Qwen3-MoE's, with use_sliding_window; dots.llm1's, from max_window_layers on)
    loads where it never binds (at least the context length) and is refused, naming it, where it would."""
    mixtral = _variant(checkpoints["mixtral"], tmp_path / "mixtral", {"sliding_window": 64})
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=64 .* --max-model-len 64 or less"):
        _llm(mixtral)
    assert _tokens(_llm(mixtral, max_model_len=64), [[5, 6, 7]]) == _tokens(_llm(checkpoints["mixtral"]), [[5, 6, 7]])
    qwen = _variant(checkpoints["qwen3_moe"], tmp_path / "qwen", {"sliding_window": 64, "use_sliding_window": True})
    with pytest.raises(UnsupportedModelError, match="sliding_window=64"):
        _llm(qwen)
    _llm(_variant(checkpoints["qwen3_moe"], tmp_path / "qwen-off", {"sliding_window": 64}))  # (use_sliding_window off)
    dots = _variant(checkpoints["dots1"], tmp_path / "dots", {"sliding_window": 64, "max_window_layers": 1,
                                                              "layer_types": None})
    with pytest.raises(UnsupportedModelError, match="sliding_window=64"):
        _llm(dots)  # (transformers' dots1: the layers from max_window_layers on are windowed)


def test_glm_without_partial_rotary_factor_rotates_half_of_each_head(checkpoints, tmp_path):
    """A GLM-4.5 config.json that names no partial_rotary_factor means 0.5 (transformers' default for glm4_moe)."""
    path = _variant(checkpoints["glm4_moe"], tmp_path / "glm")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("partial_rotary_factor", None)
    cfg["rope_parameters"].pop("partial_rotary_factor")
    (path / "config.json").write_text(json.dumps(cfg))
    llm = _llm(path)
    assert llm.engine.runner.model.model.layers[0].self_attn.rotary.rotary_dim == 8  # (of head_dim 16)
    ids = list(range(30, 60))
    torch.testing.assert_close(atlas_logits(llm, ids, [30]), hf_logits(path, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("field", [{"first_k_dense_replace": 1}, {"use_qk_norm": True}, {"num_nextn_predict_layers": 1}])
def test_solar_open_refuses_glm_fields_its_reference_does_not_read(checkpoints, tmp_path, field):
    """Solar Open is GLM-4.5's config class with the dense first layers, q / k norms and MTP layers taken out:
    transformers' model reads none of them, so a config that sets one is refused naming it, not read as GLM's."""
    path = _variant(checkpoints["solar_open"], tmp_path / "solar", field)
    with pytest.raises(UnsupportedModelError, match=f"{next(iter(field))} = .* Solar Open reads no such field"):
        _llm(path)


def test_glm_mtp_layers_are_not_loaded_and_say_so(checkpoints, tmp_path, caplog):
    """GLM-4.5's MTP layer (index num_hidden_layers) is skipped with a log line (and --speculative mtp refused, naming
    why); a layer past it is refused."""
    n, d = 3, 64
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.zeros(d, 2 * d), f"model.layers.{n}.enorm.weight": torch.ones(d),
           f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.zeros(32, d)}
    path = _variant(checkpoints["glm4_moe"], tmp_path / "mtp", tensors=mtp)
    with caplog.at_level(logging.INFO, logger="atlas.models.sparse_moe"):
        llm = _llm(path)
    assert "not loading the 3 tensors of its multi-token-prediction layer(s)" in caplog.text
    assert _tokens(llm, [[5, 6, 7]]) == _tokens(_llm(checkpoints["glm4_moe"]), [[5, 6, 7]])
    with pytest.raises(ConfigError, match="does not run the multi-token-prediction layers of Glm4MoeForCausalLM"):
        _llm(path, speculative="mtp")
    beyond = _variant(checkpoints["glm4_moe"], tmp_path / "beyond", tensors={f"model.layers.{n + 1}.x.weight":
                                                                               torch.zeros(2)})
    with pytest.raises(ModelLoadError, match=r"does not know how to use: model\.layers\.4\.x\.weight"):
        _llm(beyond)


def test_minimax_as_released_rotary_dim_mtp_modules_and_what_is_refused(checkpoints, tmp_path):
    """MiniMax-M2's released config.json: rotary_dim with no partial_rotary_factor (transformers derives it), the MTP
    modules' layers (num_mtp_modules, from index num_hidden_layers) in the checkpoint and skipped; LoRA, a softmax
    router, shared experts and linear-attention layers refused by name."""
    n, d = 2, 64
    mtp = {f"model.layers.{n + i}.self_attn.q_proj.weight": torch.zeros(d, d) for i in range(3)}
    path = _variant(checkpoints["minimax_m2"], tmp_path / "released", {"num_mtp_modules": 3, "use_mtp": True,
                                                                      "scoring_func": "sigmoid", "use_qk_norm": True,
                                                                      "attn_type_list": [1, 1]}, tensors=mtp)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"].pop("partial_rotary_factor")
    (path / "config.json").write_text(json.dumps(cfg))
    llm = _llm(path)
    assert llm.engine.runner.model.model.layers[0].self_attn.rotary.rotary_dim == 8
    ids = list(range(30, 60))
    torch.testing.assert_close(atlas_logits(llm, ids, [30]), hf_logits(path, ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(AtlasError, match="(?i)lora|adapter"):
        _llm(path, enable_lora=True)
    for change, match in [({"scoring_func": "softmax"}, "scoring_func='softmax'"),
                          ({"shared_intermediate_size": 64}, "shared experts"),
                          ({"attn_type_list": [0, 1]}, "linear attention")]:
        with pytest.raises(UnsupportedModelError, match=match):
            _llm(_variant(checkpoints["minimax_m2"], tmp_path / f"refused-{len(change)}-{next(iter(change))}",
                          change))


def test_granitemoe_without_a_shared_expert_in_either_layout_and_what_is_refused(tmp_path):
    """Granite 3.x MoE (granitemoe: no shared expert, tied embeddings) against transformers; the same tokens from the
    checkpoint in transformers 5's names (experts.gate_up_proj / down_proj, router.weight); LoRA adapters and
    --quantization fp8, whose weights the residual multiplier's folding would change, refused by name."""
    from safetensors.torch import load_file, save_file

    spec = {**CONFIGS["granitemoeshared"], "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe",
            "tie_word_embeddings": True, "attention_bias": False}
    del spec["shared_intermediate_size"]
    path = _build(tmp_path, "granitemoe", spec, None, 0, {})
    ids = list(range(30, 75))
    llm = _llm(path)
    torch.testing.assert_close(atlas_logits(llm, ids, [20, 25]), hf_logits(path, ids), rtol=1e-4, atol=1e-4)
    renamed = _variant(path, tmp_path / "renamed")
    names = {".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.gate_up_proj",
             ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.down_proj",
             ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.router.weight"}
    tensors = {}
    for name, tensor in load_file(str(renamed / "model.safetensors")).items():
        for old, new in names.items():
            name = name.replace(old, new)
        tensors[name] = tensor
    assert any(name.endswith("experts.gate_up_proj") for name in tensors)
    save_file(tensors, str(renamed / "model.safetensors"))
    prompts = [[5, 6, 7, 8], list(range(20, 44))]
    assert _tokens(_llm(renamed), prompts) == _tokens(llm, prompts)
    with pytest.raises(AtlasError, match="(?i)lora|adapter"):
        _llm(path, enable_lora=True)
    with pytest.raises(UnsupportedModelError, match=r"--quantization fp8.*GraniteMoeForCausalLM"):
        _llm(path, quantization="fp8")


def test_ernie_mtp_tensors_are_skipped_and_use_bias_is_refused(checkpoints, tmp_path, caplog):
    d = 64
    mtp = {"model.mtp_block.0.self_attn.q_proj.weight": torch.zeros(d, d), "model.mtp_emb_norm.0.weight": torch.ones(d),
           "model.mtp_linear_proj.0.weight": torch.zeros(d, 2 * d)}
    path = _variant(checkpoints["ernie4_5_moe"], tmp_path / "mtp", {"num_nextn_predict_layers": 1}, tensors=mtp)
    with caplog.at_level(logging.INFO, logger="atlas.models.sparse_moe"):
        llm = _llm(path)
    assert "not loading the 3 tensors of its multi-token-prediction block" in caplog.text
    assert _tokens(llm, [[5, 6, 7]]) == _tokens(_llm(checkpoints["ernie4_5_moe"]), [[5, 6, 7]])
    with pytest.raises(UnsupportedModelError, match="use_bias"):
        _llm(_variant(checkpoints["ernie4_5_moe"], tmp_path / "bias", {"use_bias": True}))


def test_a_missing_mixtral_expert_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _variant(checkpoints["mixtral"], tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing weight\(s\) model\.layers\.1\.mlp\.experts\.3\.up_proj"):
        _llm(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_block_checkpoint_loads_as_its_dequantized_weights_and_awq_is_refused(family, checkpoints, tmp_path):
    """Quantized checkpoints as in every family (tests/test_quantization_refusal.py): block FP8 gives exactly the
    tokens of its dequantized weights; AWQ is refused naming it."""
    from test_quantization_refusal import (
        BLOCK,
        _dequantize,
        _is_linear,
        _rewrite,
        awq_checkpoint,
        fp8_block_quantize,
        fp8_checkpoint,
    )

    source = checkpoints[family]

    def dequantized(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: _dequantize(*fp8_block_quantize(t, BLOCK)).to(t.dtype) if _is_linear(name, t) else t}

    fp8 = fp8_checkpoint(source, tmp_path / "fp8")
    reference = _rewrite(source, tmp_path / "dequantized", dequantized, None)
    prompts = [[5, 6, 7, 8], list(range(20, 44))]
    assert _tokens(_llm(fp8), prompts) == _tokens(_llm(reference), prompts)
    with pytest.raises(UnsupportedModelError, match=r"quantized \(awq, 4-bit"):
        _llm(awq_checkpoint(source, tmp_path / "awq"))


@pytest.mark.parametrize("fields, refused", [
    ({"num_shared_expert": [2, 2]}, "num_shared_expert=2"),
    ({"moe_intermediate_size": [32, 16]}, "moe_intermediate_size"),
    ({"moe_topk": [2, 1]}, "moe_topk"),
    ({"use_mixed_mlp_moe": False}, "use_mixed_mlp_moe"),
])
def test_hunyuan_moe_configs_read_two_ways_are_refused(checkpoints, tmp_path, fields, refused):
    """Hunyuan-A13B's per-layer fields where transformers and vLLM would build different models (the shared expert's
    width, experts' widths or top-k changing between layers, no shared expert) are refused by name."""
    with pytest.raises(UnsupportedModelError, match=refused):
        _llm(_variant(checkpoints["hunyuan_v1_moe"], tmp_path / "variant", fields))


# --------------------------------------------------------------------------- tools/make_random_checkpoint.py shapes


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "mixtral-tiny", "glm-4.5-tiny", "minimax-m2-tiny"])
def test_random_checkpoint_tool_and_dummy_weights(shape, tmp_path):
    """The tool's tiny shape of each family: its weights load completely into transformers and into Atlas (the same
    parameter count), and its config alone runs with --load-format dummy."""
    from transformers import AutoModelForCausalLM

    tool = checkpoint_tool()
    out = tmp_path / shape
    assert tool.main(["--shape", shape, "--out", str(out), "--std", "0.2"]) == 0
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    llm = _llm(out)
    hf_count = sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    assert sum(p.numel() for p in llm.engine.runner.model.parameters()) == hf_count
    config_only = tmp_path / f"{shape}-config"
    assert tool.main(["--shape", shape, "--out", str(config_only), "--config-only"]) == 0
    dummy = _llm(config_only, load_format="dummy")
    assert [len(t) for t in _tokens(dummy, [[3, 4, 5], list(range(3, 20))])] == [GREEDY.max_tokens] * 2
    assert_pages_returned(dummy)


def test_published_shapes_have_their_published_parameter_counts():
    """qwen3-30b-a3b, mixtral-8x7b, glm-4.5-air and minimax-m2 as the engine builds them (on the meta device): total
    parameters as published (30.5B, 46.7B, 106B, 230B), and active ones (3.3B and 12.9B with the embedding and LM
    head; GLM-4.5-Air's published 12B and MiniMax-M2's 10B without them)."""
    from atlas.bench.roofline import ModelShape

    tool = checkpoint_tool()
    published = {"qwen3-30b-a3b": (30.5e9, 3.3e9, True), "mixtral-8x7b": (46.7e9, 12.9e9, True),
                 "glm-4.5-air": (106e9, 12e9, False), "minimax-m2": (230e9, 10e9, False)}
    for name, (total, active, with_embeddings) in published.items():
        shape = ModelShape.from_config(tool.model_config(tool.SHAPES[name], "bfloat16"))
        embeddings = 2 * shape.embedding_params  # (untied: embedding and LM head)
        assert shape.non_embedding_params + embeddings == pytest.approx(total, rel=0.01), name
        got = shape.active_non_embedding_params + (embeddings if with_embeddings else 0)
        assert got == pytest.approx(active, rel=0.02), name


def test_ernie_moe_norm_min_floors_the_renormalization_as_transformers_does(checkpoints, tmp_path):
    """moe_norm_min above every sum of the chosen experts' scores (which are at most 1): the routed experts' weights
    are divided by it, not renormalized to 1, in transformers and here alike (other tokens than without it)."""
    path = _variant(checkpoints["ernie4_5_moe"], tmp_path / "floor", {"moe_norm_min": 4.0})
    ids = torch.randint(0, 384, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    want = hf_logits(path, ids)
    torch.testing.assert_close(atlas_logits(_llm(path), ids, [30]), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want, hf_logits(checkpoints["ernie4_5_moe"], ids), atol=1e-3)
