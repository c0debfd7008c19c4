"""Speculative decoding: draft proposers and lossless verification."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atlas.errors import ConfigError
from atlas.speculative.proposer import CommittedTokens, Draft, DraftProposer, ProposerContext

if TYPE_CHECKING:
    from atlas.config import EngineConfig

__all__ = ["CommittedTokens", "Draft", "DraftProposer", "ProposerContext", "build_proposer"]

DEFAULT_NGRAM_DRAFT_TOKENS = 4


def build_proposer(config: EngineConfig, ctx: ProposerContext) -> DraftProposer:
    """The proposer that --speculative names, checked against the loaded target."""
    method = config.speculative
    if method == "ngram":
        from atlas.speculative.ngram import NgramProposer

        return NgramProposer(config.num_draft_tokens or DEFAULT_NGRAM_DRAFT_TOKENS, config.ngram_min, config.ngram_max)
    if method == "dflash":
        from atlas.speculative.dflash import DFlashProposer

        return DFlashProposer.from_config(config, ctx)
    if method == "mtp":
        from atlas.speculative.mtp import MTPProposer

        return MTPProposer.from_config(config, ctx)
    raise ConfigError(f"unknown --speculative method {method!r}")
