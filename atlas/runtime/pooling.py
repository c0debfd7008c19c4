"""Pooling for embedding models (`--runner pooling`): how a prompt's final hidden states become one vector.

The checkpoint says how, as sentence-transformers writes it: `modules.json` lists the modules (a `Pooling`
module whose folder, usually `1_Pooling/`, holds `config.json` with `pooling_mode_lasttoken`,
`pooling_mode_mean_tokens` or `pooling_mode_cls_token`; a `Normalize` module: L2 normalization). Without those
files, the last token's hidden state, L2-normalized: vLLM's default for decoder embedding models (its `embed`
pooler is LAST + normalize). Modules Atlas cannot apply (a `Dense` projection, max or weighted-mean pooling,
several modes at once) are refused, never skipped.

The pooler runs on the model runner's device, on every step's final-normed hidden rows: a prompt computed in
several chunks (chunked prefill) keeps a running sum (mean) or its first row (cls) between its steps, and
gets its vector in the step that computes its last prompt token.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atlas.errors import ModelLoadError
from atlas.runtime.batch import ScheduledSeq

logger = logging.getLogger(__name__)

POOLING_MODES = ("last", "mean", "cls")
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_REFUSED_KEYS = {"pooling_mode_max_tokens": "max pooling", "pooling_mode_mean_sqrt_len_tokens": "mean-sqrt-len pooling",
                 "pooling_mode_weightedmean_tokens": "weighted-mean pooling"}
_ST = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "last"  # last | mean | cls
    normalize: bool = True
    source: str = "default"  # where it was read from (for the log)
    # Matryoshka (shortened embeddings, the request's `dimensions`): config.json's is_matryoshka or
    # matryoshka_dimensions, as vLLM reads them. None: any length up to the hidden size when matryoshka.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def classifier(cls) -> PoolingConfig:
        """A sequence classifier's: the last token's final-normed hidden state (the runner then applies the model's
        score head to it), as transformers' *ForSequenceClassification pools an unpadded prompt."""
        return cls(mode="last", normalize=False, source="sequence classification: the last token, through the "
                                                        "score head")

    def describe(self) -> str:
        return (f"pooling: {self.mode} token{'s' if self.mode == 'mean' else ''}"
                f"{', L2-normalized' if self.normalize else ''} ({self.source})")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"malformed embedding checkpoint: cannot read {path} ({exc})") from exc


def load_pooling_config(model_path: Path, raw_config: dict[str, Any]) -> PoolingConfig:
    """The checkpoint's pooling (module docstring). Raises ModelLoadError for modules Atlas cannot apply."""
    dims = raw_config.get("matryoshka_dimensions")
    matryoshka = bool(raw_config.get("is_matryoshka")) or bool(dims)
    mdims = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else None
    modules_file = model_path / "modules.json"
    pooling_dir: Path | None = None
    normalize = True
    source = "no modules.json: last token, L2-normalized, vLLM's default for decoder embedding models"
    if modules_file.is_file():
        modules = _read_json(modules_file)
        if not isinstance(modules, list):
            raise ModelLoadError(f"malformed embedding checkpoint: {modules_file} must hold a list of modules")
        normalize = False
        source = str(modules_file)
        for m in modules:
            kind = str(m.get("type", "")) if isinstance(m, dict) else ""
            name = kind.removeprefix(_ST)
            if name == "Transformer" or kind == "":
                continue
            if name == "Pooling":
                pooling_dir = model_path / str(m.get("path", "1_Pooling"))
            elif name == "Normalize":
                normalize = True
            else:
                raise ModelLoadError(f"{modules_file} lists a {kind!r} module, which Atlas does not apply; refusing "
                                     "to serve embeddings that would differ from the model's")
    elif (model_path / "1_Pooling" / "config.json").is_file():
        pooling_dir = model_path / "1_Pooling"
        source = str(pooling_dir / "config.json")
    mode = "last"
    if pooling_dir is not None:
        cfg_file = pooling_dir / "config.json"
        cfg = _read_json(cfg_file) if cfg_file.is_file() else {}
        for key, what in _REFUSED_KEYS.items():
            if cfg.get(key):
                raise ModelLoadError(f"{cfg_file}: {key} ({what}) is not supported; Atlas pools by the last token, "
                                     "the mean or the first (cls) token")
        modes = [m for key, m in _MODE_KEYS.items() if cfg.get(key)]
        if len(modes) > 1:
            raise ModelLoadError(f"{cfg_file} asks for several pooling modes at once ({', '.join(modes)}), which "
                                 "Atlas does not concatenate")
        if modes:
            mode = modes[0]
        elif cfg:
            raise ModelLoadError(f"{cfg_file} sets no pooling mode Atlas knows ({', '.join(_MODE_KEYS)})")
    return PoolingConfig(mode, normalize, source, matryoshka, mdims)


class Pooler:
    """Per step: the pooled vector (float32, on the device) of each sequence whose prompt ends in the step."""

    def __init__(self, config: PoolingConfig):
        self.config = config
        # The partial state of prompts computed in several steps (mean: running sum; cls: first row), by request id.
        self._partial: dict[str, torch.Tensor] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._partial.pop(rid, None)

    def __call__(self, hidden: torch.Tensor, seqs: list[ScheduledSeq], starts: list[int], counts: list[int]
                 ) -> list[torch.Tensor | None]:
        mode = self.config.mode
        out: list[torch.Tensor | None] = []
        row = 0
        for seq, start, n in zip(seqs, starts, counts, strict=True):
            rows = hidden[row: row + n]
            row += n
            rid, total = seq.request_id, len(seq.prompt_token_ids)
            done = start + n >= total
            vector = None
            if mode == "last":
                vector = rows[-1].float() if done else None
            elif mode == "mean":
                part = rows.float().sum(0)
                if start > 0:
                    part = part + self._partial.pop(rid)
                if done:
                    vector = part / total
                else:
                    self._partial[rid] = part
            else:  # cls
                first = rows[0].float() if start == 0 else self._partial.pop(rid)
                if done:
                    vector = first
                else:
                    self._partial[rid] = first
            if vector is not None and self.config.normalize:
                vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
            out.append(vector)
        return out
