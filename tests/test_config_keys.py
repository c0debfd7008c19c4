"""Every key of each served family's config.json, as its transformers config class writes it, is read by Atlas or
declared here irrelevant to inference (with the reason): a key the reference model reads and Atlas ignores would
make that family fluent and wrong for a checkpoint that sets it (Ministral 3's query temperature and ERNIE's
moe_norm_min were such keys). The reads are recorded while ModelConfig reads config.json and the model class is
built (on the meta device) from each family's default config and from variants that turn on the switches other keys
depend on (a window, an MoE block, a derived layer list left out)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atlas.config import ModelConfig
from atlas.models.loader import constructing
from atlas.models.registry import _MODELS

# Keys of every transformers config that do not change what a model computes in inference.
COMMON = {
    "_name_or_path", "architectures", "transformers_version", "model_type", "dtype", "torch_dtype", "use_cache",
    "return_dict", "output_attentions", "output_hidden_states", "is_encoder_decoder", "chunk_size_feed_forward",
    "problem_type", "id2label", "label2id", "initializer_range", "pad_token_id", "bos_token_id",
    # training only: dropouts and the router's auxiliary losses / noise
    "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "residual_dropout", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "router_z_loss_coef", "z_loss_coefficient",
    # generation only: how many positions' logits transformers computes
    "num_logits_to_keep",
    # transformers' tensor-parallel pretraining split of Llama's matmuls: the same product
    "pretraining_tp",
    # derived by the config class from fields Atlas reads (qk_nope_head_dim + qk_rope_head_dim)
    "qk_head_dim",
    # an image-text checkpoint's image, video and audio inputs, which Atlas refuses (it serves the text model)
    "image_token_id", "image_token_index", "video_token_id", "vision_start_token_id", "vision_end_token_id",
    "boi_token_id", "boi_token_index", "eoi_token_id", "eoi_token_index", "boa_token_id", "eoa_token_index",
    "mm_tokens_per_image", "multimodal_projector_bias", "projector_hidden_act", "spatial_merge_size",
    "vision_feature_layer", "audio_config",
}
# Per architecture: keys that do not change inference there, and why.
IRRELEVANT = {
    "Gemma3ForCausalLM": {"_sliding_window_pattern": "the private copy of sliding_window_pattern"},
    "Gemma3ForConditionalGeneration": {"_sliding_window_pattern": "the private copy of sliding_window_pattern"},
    "LongcatFlashForCausalLM": {"ffn_hidden_size": "read as intermediate_size (ModelConfig's alias)"},
    "Qwen3VLMoeForConditionalGeneration": {"sliding_window": "Qwen3VLMoeTextConfig sets it None always"},
    **dict.fromkeys(("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"), {
        "max_window_layers": "derives layer_types, which the config class writes (read where layer_types is absent, "
                             "as Qwen2's audit shows)"}),
    "Phi3ForCausalLM": {"original_max_position_embeddings": "read into rope_parameters for longrope only "
                                                            "(rope_type default here)"},
    "GptOssForCausalLM": {"hidden_act": "the experts' clamped SwiGLU is fixed (transformers' GptOss reads no "
                                        "hidden_act)"},
    "DeepseekV4ForCausalLM": {"norm_topk_prob": "transformers' DeepseekV4 does not read it (sqrtsoftplus scores "
                                                "renormalized always)",
                              "num_nextn_predict_layers": "the MTP module's, read where --speculative mtp builds it",
                              "qk_rope_head_dim": "read into partial_rotary_factor where that is absent",
                              "compress_rates": "read whole (merged over the defaults by v4_settings)",
                              "rope_parameters": "read whole (its main and compress sets, by v4_settings)"},
    "DeepseekV32ForCausalLM": {"mlp_bias": "transformers' DeepseekV32 MLP has no bias (it does not read it)"},
    "GlmMoeDsaForCausalLM": {"mlp_bias": "transformers' GlmMoeDsa MLP has no bias (it does not read it)"},
    "Ernie4_5_MoeForCausalLM": {"num_nextn_predict_layers": "its MTP tensors are skipped (logged)"},
    "JambaForCausalLM": dict.fromkeys(("use_mamba_kernels", "use_mambapy", "use_associative_scan"),
                                      "which of transformers' own scan implementations runs (the same recurrence)"),
    "HunYuanDenseV1ForCausalLM": {"eod_token_id": "a special token's id (stopping reads eos_token_id and "
                                                  "generation_config.json)"},
    "HunYuanMoEV1ForCausalLM": dict.fromkeys(("eod_token_id", "sep_token_id"), "special tokens' ids (stopping reads "
                                             "eos_token_id and generation_config.json)"),
    "SmolLM3ForCausalLM": {"no_rope_layer_interval": "derives no_rope_layers, which the config class writes"},
    "Qwen2MoeForCausalLM": {"layer_types": "a window that binds is refused, on whichever layers",
                            "max_window_layers": "a window that binds is refused, on whichever layers"},
    "NemotronHForCausalLM": {
        **dict.fromkeys(("attention_bias", "sliding_window", "residual_in_fp32", "expand", "mamba_proj_bias"),
                        "transformers' NemotronH does not read it (no attention bias or window; the residual in the "
                        "model dtype; the Mamba-2 width is mamba_num_heads x mamba_head_dim; use_bias is the "
                        "projections' bias)"),
        "mamba_ssm_cache_dtype": "the state is kept in float32 (transformers does not read it)",
        **dict.fromkeys(("rescale_prenorm_residual", "time_step_floor", "time_step_min", "time_step_max"),
                        "initialization only"),
        "use_mamba_kernels": "deprecated, no effect",
        "moe_shared_expert_overlap": "a scheduling choice (the shared expert computed beside the routed ones)",
        "n_shared_experts": "one shared expert, of moe_shared_expert_intermediate_size (transformers reads no count)",
        **dict.fromkeys(("mtp_layers_block_type", "num_nextn_predict_layers"),
                        "the multi-token-prediction module, whose tensors are skipped"),
    },
}
# Variants of a family's default config whose switches make other keys count: (fields, keys to drop).
VARIANTS = {
    **dict.fromkeys(("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM"), [
        ({"rope_parameters": {"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0, "rope_theta": 10000.0}}, ())]),
    "Qwen2ForCausalLM": [({"use_sliding_window": True}, ("layer_types",)), ({"use_sliding_window": True}, ())],
    "Qwen3ForCausalLM": [({"use_sliding_window": True}, ("layer_types",)), ({"use_sliding_window": True}, ())],
    "Qwen2MoeForCausalLM": [({"use_sliding_window": True}, ())],
    "Qwen3MoeForCausalLM": [({"use_sliding_window": True}, ())],
    "SmolLM3ForCausalLM": [({"use_sliding_window": True, "sliding_window": 64}, ())],
    "Gemma4ForCausalLM": [({"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                            "moe_intermediate_size": 64}, ())],
    "Exaone4ForCausalLM": [({}, ("layer_types",))],
    "FalconH1ForCausalLM": [({"mamba_rms_norm": True}, ()), ({"mamba_d_ssm": None}, ())],
    "Lfm2ForCausalLM": [({"full_attn_idxs": [1]}, ("layer_types",))],
    "Gemma4ForConditionalGeneration": [({"text_config": {"enable_moe_block": True, "num_experts": 8,
                                                         "top_k_experts": 2, "moe_intermediate_size": 64}}, ())],
    "Qwen2VLForConditionalGeneration": [({"text_config": {"use_sliding_window": True}}, ())],
    "Qwen2_5_VLForConditionalGeneration": [({"text_config": {"use_sliding_window": True}}, ())],
    "Phi3ForCausalLM": [({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                              "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}, ()),
                        ({"original_max_position_embeddings": 1024,  # (a context past it: the long factors)
                          "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                              "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}, ())],
}
# The model_type of each architecture, and the fields its default config needs to build.
FAMILIES = {
    "LlamaForCausalLM": ("llama", {}), "MistralForCausalLM": ("mistral", {}), "Qwen2ForCausalLM": ("qwen2", {}),
    "Qwen3ForCausalLM": ("qwen3", {}), "Phi3ForCausalLM": ("phi3", {}), "GraniteForCausalLM": ("granite", {}),
    "Olmo2ForCausalLM": ("olmo2", {}), "Olmo3ForCausalLM": ("olmo3", {}), "Glm4ForCausalLM": ("glm4", {}),
    "GlmForCausalLM": ("glm", {}),
    "Exaone4ForCausalLM": ("exaone4", {}), "SmolLM3ForCausalLM": ("smollm3", {}),
    "SeedOssForCausalLM": ("seed_oss", {}), "Ernie4_5ForCausalLM": ("ernie4_5", {}),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", {}), "Gemma2ForCausalLM": ("gemma2", {}),
    "Gemma3ForCausalLM": ("gemma3_text", {}), "Gemma4ForCausalLM": ("gemma4_text", {}),
    "CohereForCausalLM": ("cohere", {}), "Cohere2ForCausalLM": ("cohere2", {}),
    "MixtralForCausalLM": ("mixtral", {}), "Qwen2MoeForCausalLM": ("qwen2_moe", {}),
    "Qwen3MoeForCausalLM": ("qwen3_moe", {}), "OlmoeForCausalLM": ("olmoe", {}),
    "MiniMaxM2ForCausalLM": ("minimax_m2", {}), "GptOssForCausalLM": ("gpt_oss", {}),
    "DeepseekV3ForCausalLM": ("deepseek_v3", {}), "DeepseekV32ForCausalLM": ("deepseek_v32", {}),
    "DeepseekV4ForCausalLM": ("deepseek_v4", {}), "GlmMoeDsaForCausalLM": ("glm_moe_dsa", {}),
    "Glm4MoeLiteForCausalLM": ("glm4_moe_lite", {}), "Qwen3NextForCausalLM": ("qwen3_next", {}),
    "Glm4MoeForCausalLM": ("glm4_moe", {"head_dim": 128}), "SolarOpenForCausalLM": ("solar_open", {}),
    "Dots1ForCausalLM": ("dots1", {"n_routed_experts": 8, "num_experts_per_tok": 2}),
    "DeepseekV2ForCausalLM": ("deepseek_v2", {"num_experts_per_tok": 2, "n_routed_experts": 8}),
    "HunYuanDenseV1ForCausalLM": ("hunyuan_v1_dense", {}), "HunYuanMoEV1ForCausalLM": ("hunyuan_v1_moe", {}),
    "ApertusForCausalLM": ("apertus", {}), "ArceeForCausalLM": ("arcee", {}), "HeliumForCausalLM": ("helium", {}), "GraniteMoeForCausalLM": ("granitemoe", {}), "GraniteMoeSharedForCausalLM": ("granitemoeshared", {}),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", {"layer_types": ["mamba", "attention"],
                                                         "num_hidden_layers": 2}),
    "NemotronHForCausalLM": ("nemotron_h", {"layers_block_type": ["linear_attention", "full_attention", "mlp",
                                                                  "moe"]}),
    "BambaForCausalLM": ("bamba", {"attn_layer_indices": [1], "num_hidden_layers": 3}),
    "FalconH1ForCausalLM": ("falcon_h1", {}),
    "JambaForCausalLM": ("jamba", {}),
    "Lfm2ForCausalLM": ("lfm2", {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2}),
    "Lfm2MoeForCausalLM": ("lfm2_moe", {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3,
                                        "num_dense_layers": 1}),
    "Ministral3ForCausalLM": ("ministral3", {}), "Llama4ForCausalLM": ("llama4_text", {}),
    "Qwen3_5ForCausalLM": ("qwen3_5_text", {}), "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", {}),
    "LongcatFlashForCausalLM": ("longcat_flash", {}),
    # image-text checkpoints: their text model, as ModelConfig merges it
    "Llama4ForConditionalGeneration": ("llama4", {}), "Gemma3ForConditionalGeneration": ("gemma3", {}),
    "Gemma4ForConditionalGeneration": ("gemma4", {}), "Mistral3ForConditionalGeneration": ("mistral3", {}),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", {}), "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", {}),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", {}), "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe", {}),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", {}), "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", {}),
}
# The keys _parse_rope reads from its own copy of rope_parameters (at any depth: per layer type too).
ROPE_BASE = {"rope_theta", "rope_type", "type", "partial_rotary_factor"}


class Recorded(dict):
    """A config dict that records each key read through get, [] and `in` (nested dicts as prefix.key)."""

    def __init__(self, d: dict, log: set[str], prefix: str = ""):
        super().__init__({k: Recorded(v, log, f"{prefix}{k}.") if isinstance(v, dict) else v for k, v in d.items()})
        self._log, self._prefix = log, prefix

    def _read(self, key) -> None:
        self._log.add(f"{self._prefix}{key}")

    def get(self, key, default=None):
        self._read(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._read(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._read(key)
        return super().__contains__(key)

    def items(self):  # (iterating a dict's entries reads them all)
        for key in dict.__iter__(self):
            self._read(key)
        return super().items()

    def values(self):
        for key in dict.__iter__(self):
            self._read(key)
        return super().values()


def _keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out.add(f"{prefix}{k}")
        if isinstance(v, dict):
            out |= _keys(v, f"{prefix}{k}.")
    return out


def _reads(arch: str, raw: dict) -> tuple[set[str], set[str]]:
    """(every key of the config as Atlas reads it, the keys read) for one config dict."""
    merged = dict(ModelConfig.from_dict(raw, Path("/audit")).raw)  # (an image-text config's text model merged in)
    merged.pop("vlm_config", None)
    log: set[str] = set()
    cfg = ModelConfig.from_dict(Recorded(merged, log), Path("/audit"))
    cfg.raw = Recorded(dict(cfg.raw), log)
    object.__setattr__(cfg.rope, "params", Recorded(dict(cfg.rope.params), log, "rope_parameters."))
    with constructing(torch.device("meta"), torch.bfloat16):
        _MODELS[arch](cfg, 4096)
    for key in list(log):  # (rope_parameters, or one layer type's, read whole by _parse_rope)
        if key == "rope_parameters" or key.startswith("rope_parameters."):
            log |= {f"{key}.{base}" for base in ROPE_BASE}
    return _keys(merged), log


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_config_key_is_read_or_declared_irrelevant(arch):
    from transformers import AutoConfig

    model_type, fields = FAMILIES[arch]
    keys, read = set(), set()
    for extra, drop in [({}, ()), *VARIANTS.get(arch, [])]:
        raw = AutoConfig.for_model(model_type, **{**fields, **extra}).to_dict()
        for key in drop:
            raw.pop(key, None)
        raw["architectures"] = [arch]
        k, r = _reads(arch, raw)
        keys |= k
        read |= r
    declared = set(IRRELEVANT.get(arch, {}))
    assert declared <= keys, f"{arch}: declared keys not in its config: {sorted(declared - keys)}"

    def covered(key: str) -> bool:  # (a key declared, or under one: a dict read whole)
        parts = key.split(".")
        return parts[0] in COMMON or any(".".join(parts[:i]) in declared for i in range(1, len(parts) + 1))

    unread = sorted(k for k in keys - read if not covered(k))
    assert not unread, f"{arch}: config keys Atlas never reads: {unread}"


def test_every_served_architecture_is_audited():
    """A new family joins the audit: every registered architecture but the embedding and classification names of
    audited families (the same model class) and LongCat-Flash's n-gram variant (no transformers config class)."""
    same = {a for a in _MODELS if a.endswith(("ForSequenceClassification", "Model"))}
    assert set(_MODELS) - same - {"LongcatFlashNgramForCausalLM"} == set(FAMILIES)
