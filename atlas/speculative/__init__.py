"""Speculative decoding: draft proposers and lossless verification."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atlas.errors import ConfigError
from atlas.speculative.proposer import CommittedTokens, Draft, DraftProposer

if TYPE_CHECKING:
    from atlas.config import EngineConfig
    from atlas.runtime.model_runner import ModelRunner

__all__ = ["CommittedTokens", "Draft", "DraftProposer", "build_proposer"]

DEFAULT_NGRAM_DRAFT_TOKENS = 4


def build_proposer(config: EngineConfig, runner: ModelRunner) -> DraftProposer:
    """The proposer that --speculative names, checked against the loaded target."""
    method = config.speculative
    if method == "ngram":
        from atlas.speculative.ngram import NgramProposer

        return NgramProposer(config.num_draft_tokens or DEFAULT_NGRAM_DRAFT_TOKENS, config.ngram_min, config.ngram_max)
    if method == "dflash":
        from atlas.speculative.dflash import DFlashProposer

        return DFlashProposer.from_config(config, runner)
    if method == "mtp":
        make = getattr(runner.model, "mtp_proposer", None)
        if make is None:
            raise ConfigError(
                f"--speculative mtp needs a model with multi-token-prediction heads; "
                f"{runner.model_config.architecture} has none. Use --speculative ngram or dflash")
        return make(config)
    raise ConfigError(f"unknown --speculative method {method!r}")
