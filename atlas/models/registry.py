"""Hugging Face `architectures` name -> Atlas model class."""

from __future__ import annotations

from atlas.config import ModelConfig
from atlas.errors import UnsupportedModelError
from atlas.models.base import CausalLM
from atlas.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from atlas.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from atlas.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

_MODELS: dict[str, type[CausalLM]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Hybrids (Gated DeltaNet + gated attention). Qwen3.5's published checkpoints are vision-language models: their
    # language model is served on text (models/qwen3_next.py).
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
    # Bare base models (embedding checkpoints, --runner pooling): the same layers, without an LM head.
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": MistralForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    cls = _MODELS.get(cfg.architecture)
    if cls is None:
        # (a checkpoint that ships its own modeling code says so in auto_map: Atlas runs none, with
        #  --trust-remote-code or without)
        code = (" It ships its own modeling code (auto_map), which Atlas does not run: --trust-remote-code does "
                "not change that." if cfg.raw.get("auto_map") else "")
        raise UnsupportedModelError(
            f"architecture {cfg.architecture!r} (from {cfg.path / 'config.json'}) is not supported.{code} "
            f"Supported: {', '.join(supported_architectures())}")
    return cls
