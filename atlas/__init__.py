"""Atlas: an LLM inference and serving engine.

    from atlas import LLM, SamplingParams
    llm = LLM(model="path/or/hub-id")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from typing import TYPE_CHECKING

# The public names load on first use: `atlas --help`, `atlas --version` and a mistyped flag answer without
# importing torch.
_EXPORTS = {
    "LLM": "atlas.engine.llm",
    "SamplingParams": "atlas.sampling_params",
    "StructuredOutputsParams": "atlas.sampling_params",
    "LoRARequest": "atlas.lora_request",
    "BeamSearchParams": "atlas.sampling_params",
    "RequestOutput": "atlas.outputs",
    "CompletionOutput": "atlas.outputs",
    "Logprob": "atlas.outputs",
    "EngineConfig": "atlas.config",
    "TuningConfig": "atlas.config",
    "AtlasError": "atlas.errors",
    "ConfigError": "atlas.errors",
    "InvalidRequestError": "atlas.errors",
    "ModelLoadError": "atlas.errors",
    "UnsupportedModelError": "atlas.errors",
}

if TYPE_CHECKING:
    from atlas.config import EngineConfig, TuningConfig
    from atlas.engine.llm import LLM
    from atlas.errors import (
        AtlasError,
        ConfigError,
        InvalidRequestError,
        ModelLoadError,
        UnsupportedModelError,
    )
    from atlas.lora_request import LoRARequest
    from atlas.outputs import CompletionOutput, Logprob, RequestOutput
    from atlas.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'atlas' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "LoRARequest",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "TuningConfig",
    "AtlasError",
    "ConfigError",
    "InvalidRequestError",
    "ModelLoadError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
