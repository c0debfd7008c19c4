"""Sampling defaults from the model's generation_config.json, applied as vLLM applies them (--generation-config).

Model authors set temperature, top_p, top_k, min_p and repetition_penalty there (Qwen3: 0.6 / 0.95 / 20), and
max_new_tokens. `auto` (the default) reads the model's file, `vllm` ignores it (the built-in defaults: greedy
only when asked, temperature 1.0), and a folder or file path reads that file instead. A request's own values
always win; the defaults fill only the fields it leaves out (offline: `LLM.generate` without SamplingParams, or
`LLM.get_default_sampling_params()`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from atlas.errors import ConfigError

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(setting: str, model_path: Path, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams fields and their defaults for requests that leave them out: the generation_config.json that
    `setting` names, with --override-generation-config's keys on top (checked: an unknown key or a value that is
    not a number is refused, where a file's is only skipped with a warning)."""
    defaults = _read_defaults(setting, model_path)
    for key, value in (override or {}).items():
        if key not in SAMPLING_KEYS:
            raise ConfigError(f"--override-generation-config: {key!r} is not a sampling default Atlas reads from a "
                              f"generation config; use {', '.join(SAMPLING_KEYS)}")
        name = SAMPLING_KEYS[key]
        number = _number(value, name)
        if number is None:
            raise ConfigError(f"--override-generation-config: {key} must be a number"
                              f"{' (an integer)' if name in _INTEGRAL else ''}, got {value!r}")
        defaults[name] = number
    if override:
        logger.info("sampling defaults after --override-generation-config: %s",
                    ", ".join(f"{k} {v:g}" for k, v in defaults.items()))
    return defaults


_INTEGRAL = ("top_k", "max_tokens")


def _number(value: Any, name: str) -> int | float | None:
    """A generation-config value as its SamplingParams field's type, None when it is not a number of that kind."""
    integral = name in _INTEGRAL
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and value != int(value)):
        return None
    return int(value) if integral else float(value)


def _read_defaults(setting: str, model_path: Path) -> dict[str, Any]:
    if setting == "vllm":
        return {}
    if setting == "auto":
        path = model_path / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(setting)
        if path.is_dir():
            path = path / "generation_config.json"
        if not path.is_file():
            raise ConfigError(f"--generation-config {setting!r}: no generation_config.json there (give auto, vllm, "
                              "or a folder or file that has one)")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); fix it or pass --generation-config vllm") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object; fix it or pass --generation-config vllm")
    defaults: dict[str, Any] = {}
    for key, name in SAMPLING_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        number = _number(value, name)
        if number is None:
            logger.warning("%s: %s = %r is not a number; not used as a default", path, key, value)
            continue
        defaults[name] = number
    if defaults:
        logger.info("sampling defaults from %s: %s (a request's own values win; --generation-config vllm ignores "
                    "the file)", path, ", ".join(f"{k} {v:g}" for k, v in defaults.items()))
    return defaults
