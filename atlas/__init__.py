"""Atlas: an LLM inference and serving engine.

    from atlas import LLM, SamplingParams
    llm = LLM(model="path/or/hub-id")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from atlas.config import EngineConfig
from atlas.engine.llm import LLM
from atlas.errors import AtlasError, ConfigError, InvalidRequestError, ModelLoadError, UnsupportedModelError
from atlas.outputs import CompletionOutput, Logprob, RequestOutput
from atlas.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "AtlasError",
    "ConfigError",
    "InvalidRequestError",
    "ModelLoadError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
