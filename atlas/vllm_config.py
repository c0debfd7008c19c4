"""vLLM's structured settings as Atlas's engine fields: its speculative config, its structured-outputs config and
its optimization levels, for `atlas serve`'s vLLM flags (server/vllm_compat.py) and for LLM(...)'s keywords
(`engine_kwargs`), so that a vLLM command line or script means the same here. A setting Atlas has no counterpart
for is refused by name (ConfigError), never dropped."""

from __future__ import annotations

from typing import Any

from atlas.config import json_object
from atlas.errors import ConfigError

# vLLM's speculative methods -> Atlas's --speculative (config.SPECULATIVE_METHODS)
VLLM_SPECULATIVE_METHODS = {"ngram": "ngram", "dflash": "dflash", "mtp": "mtp", "deepseek_mtp": "mtp",
                            "draft_model": "draft_model", "eagle3": "eagle3"}
# vLLM's speculative-config keys -> Atlas's engine fields
SPECULATIVE_FIELDS = {"num_speculative_tokens": "num_draft_tokens", "model": "draft_model",
                      "prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max",
                      "max_model_len": "speculative_max_model_len"}
# vLLM's structured-outputs backends -> Atlas's --structured-outputs-backend ("guidance" is vLLM's name for llguidance)
STRUCTURED_BACKENDS = {"auto": "auto", "xgrammar": "xgrammar", "guidance": "llguidance", "llguidance": "llguidance"}


def speculative_fields(config: Any, what: str = "--speculative-config") -> dict[str, Any]:
    """vLLM's speculative config ({"method": ..., "num_speculative_tokens": K, "model": PATH, ...}) as engine fields."""
    config = dict(json_object(config, what))
    method = config.pop("method", None)
    if method == "eagle":
        raise ConfigError(f"{what}: method 'eagle' (EAGLE-1/2 drafters) is not one Atlas implements; EAGLE-3 drafters "
                          "are (method 'eagle3')")
    if method not in VLLM_SPECULATIVE_METHODS:
        raise ConfigError(f"{what}: method {method!r} is not one Atlas implements (it has "
                          f"{', '.join(VLLM_SPECULATIVE_METHODS)}; see --speculative)")
    fields = {"speculative": VLLM_SPECULATIVE_METHODS[method]}
    for key, value in config.items():
        if key not in SPECULATIVE_FIELDS:
            raise ConfigError(f"{what}: {key!r} is not a setting Atlas implements (it takes method, "
                              f"{', '.join(SPECULATIVE_FIELDS)})")
        fields[SPECULATIVE_FIELDS[key]] = value
    return fields


def structured_outputs_fields(config: Any, reasoning_parsers: tuple[str, ...] | None = None,
                              what: str = "--structured-outputs-config") -> dict[str, Any]:
    """vLLM's structured-outputs config ({"backend": ..., "reasoning_parser": NAME}) as Atlas's settings:
    structured_outputs_backend, and reasoning_parser where `reasoning_parsers` (the server's) is given; without
    it (LLM(...): the offline engine parses no reasoning) reasoning_parser is refused."""
    config = dict(json_object(config, what))
    fields: dict[str, Any] = {}
    if "backend" in config:
        backend = config.pop("backend")
        if backend not in STRUCTURED_BACKENDS:
            raise ConfigError(f"{what}: backend {backend!r} is not one Atlas implements (it has "
                              f"{', '.join(STRUCTURED_BACKENDS)}; see --structured-outputs-backend)")
        fields["structured_outputs_backend"] = STRUCTURED_BACKENDS[backend]
    if "reasoning_parser" in config and reasoning_parsers is not None:
        name = config.pop("reasoning_parser") or None
        if name is not None and name not in reasoning_parsers:
            raise ConfigError(f"{what}: reasoning_parser {name!r} is not one Atlas has (it has "
                              f"{', '.join(reasoning_parsers)})")
        fields["reasoning_parser"] = name
    if config:
        takes = ("backend, reasoning_parser" if reasoning_parsers is not None
                 else "backend; the reasoning parser is the server's: atlas serve --reasoning-parser")
        raise ConfigError(f"{what}: {next(iter(config))!r} is not a setting Atlas implements here (it takes {takes})")
    return fields


def optimization_level_fields(level: Any, what: str = "-O") -> dict[str, Any]:
    """vLLM's optimization level 0-3: 0 is no CUDA graphs (--enforce-eager); 1-3 trade start-up time for speed through
    vLLM's compiler, where Atlas's own kernels and CUDA graphs are already the default."""
    if str(level) not in ("0", "1", "2", "3"):
        raise ConfigError(f"{what} {level}: Atlas takes vLLM's optimization levels 0-3 (0: no CUDA graphs, as "
                          "--enforce-eager; 1-3: Atlas's default); vLLM's compiler settings are not implemented")
    return {"enforce_eager": True} if str(level) == "0" else {}


def engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """LLM(...)'s keywords with vLLM's forms (speculative_config, structured_outputs_config, optimization_level,
    disable_log_stats) turned into Atlas's fields; a field given both ways must agree."""
    kwargs = dict(kwargs)
    translated: dict[str, Any] = {}
    if "speculative_config" in kwargs:
        config = kwargs.pop("speculative_config")
        if config is not None:
            translated.update(speculative_fields(config, "speculative_config"))
    if "structured_outputs_config" in kwargs:
        config = kwargs.pop("structured_outputs_config")
        if config is not None:
            translated.update(structured_outputs_fields(config, None, "structured_outputs_config"))
    if "optimization_level" in kwargs:
        translated.update(optimization_level_fields(kwargs.pop("optimization_level"), "optimization_level"))
    if "disable_log_stats" in kwargs and not kwargs.pop("disable_log_stats"):
        raise ConfigError("disable_log_stats=False: the offline LLM logs no periodic stats (atlas serve does, "
                          "to its log and /metrics); leave it out")
    if "compilation_config" in kwargs:
        raise ConfigError("compilation_config is a vLLM setting that Atlas does not implement: Atlas captures CUDA "
                          "graphs itself (enforce_eager=True turns them off; optimization_level=0 is the same)")
    for key, value in translated.items():
        if key in kwargs and kwargs[key] != value:
            raise ConfigError(f"{key}={kwargs[key]!r} and the vLLM setting that means {key}={value!r}: give one")
        kwargs.setdefault(key, value)
    return kwargs
