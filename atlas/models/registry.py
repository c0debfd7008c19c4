"""Hugging Face `architectures` name -> Atlas model class."""

from __future__ import annotations

from atlas.config import ModelConfig
from atlas.errors import UnsupportedModelError
from atlas.models.apertus import ApertusForCausalLM
from atlas.models.arcee import ArceeForCausalLM
from atlas.models.base import CausalLM
from atlas.models.cohere import CohereForCausalLM
from atlas.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    DeepseekV32ForCausalLM,
    Glm4MoeLiteForCausalLM,
    GlmMoeDsaForCausalLM,
)
from atlas.models.deepseek_v4 import DeepseekV4ForCausalLM
from atlas.models.exaone4 import Exaone4ForCausalLM
from atlas.models.falcon_h1 import FalconH1ForCausalLM
from atlas.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from atlas.models.gemma4 import Gemma4ForCausalLM
from atlas.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from atlas.models.gpt_oss import GptOssForCausalLM
from atlas.models.granite_hybrid import BambaForCausalLM, GraniteMoeHybridForCausalLM
from atlas.models.granite_moe import GraniteMoeForCausalLM
from atlas.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from atlas.models.jamba import JambaForCausalLM
from atlas.models.lfm2 import Lfm2ForCausalLM
from atlas.models.llama import (
    Ernie4_5ForCausalLM,
    GraniteForCausalLM,
    HeliumForCausalLM,
    LlamaForCausalLM,
    Mistral3ForConditionalGeneration,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen2VLForConditionalGeneration,
    Qwen3ForCausalLM,
    Qwen3VLForConditionalGeneration,
    SeedOssForCausalLM,
    SmolLM3ForCausalLM,
)
from atlas.models.llama4 import Llama4ForCausalLM
from atlas.models.longcat import LongcatFlashForCausalLM, LongcatFlashNgramForCausalLM
from atlas.models.minimax_m2 import MiniMaxM2ForCausalLM
from atlas.models.nemotron_h import NemotronHForCausalLM
from atlas.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
from atlas.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from atlas.models.sparse_moe import (
    Dots1ForCausalLM,
    Ernie4_5_MoeForCausalLM,
    Glm4MoeForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen3VLMoeForConditionalGeneration,
    SolarOpenForCausalLM,
)

_MODELS: dict[str, type[CausalLM]] = {
    "ApertusForCausalLM": ApertusForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": CohereForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Gemma 3's image-text checkpoints (gemma-3-4b and larger): their language model is served on text.
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
    # Gemma 4's image-text(-audio) checkpoints: their language model is served on text (models/gemma4.py).
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "HeliumForCausalLM": HeliumForCausalLM,
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunYuanMoEV1ForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    # Llama 4 (Scout, Maverick): the image-text checkpoints' language model served on text
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "Llama4ForConditionalGeneration": Llama4ForCausalLM,
    "LongcatFlashForCausalLM": LongcatFlashForCausalLM,
    "LongcatFlashNgramForCausalLM": LongcatFlashNgramForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    # Ministral 3's text model (its query temperature: models/llama.llama4_query_scaling)
    "Ministral3ForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "SolarOpenForCausalLM": SolarOpenForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    # Image-text checkpoints whose language model is one of the above: served on text (models/llama.py).
    "Mistral3ForConditionalGeneration": Mistral3ForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
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
    # Sequence classifiers (reward models, classifiers; --runner pooling, POST /classify): the same layers with a
    # `score` head over the last token in place of the LM head.
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "MistralForSequenceClassification": MistralForCausalLM,
    "Qwen2ForSequenceClassification": Qwen2ForCausalLM,
    "Qwen3ForSequenceClassification": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_class(architecture: object) -> type[CausalLM] | None:
    """The model class of an `architectures` name, None if Atlas has none (no error: model_class says why)."""
    return _MODELS.get(architecture) if isinstance(architecture, str) else None


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
