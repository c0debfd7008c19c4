"""Speculative decoding: draft proposers and lossless verification."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atlas.errors import ConfigError
from atlas.speculative.proposer import CommittedTokens, Draft, DraftProposer, ProposerContext

if TYPE_CHECKING:
    from atlas.config import EngineConfig, ModelConfig
    from atlas.engine.request import Request

__all__ = ["CommittedTokens", "Draft", "DraftProposer", "ProposerContext", "VerifyOnly", "build_proposer",
           "proposer_class", "verify_only"]

DEFAULT_NGRAM_DRAFT_TOKENS = 4


def proposer_class(method: str) -> type[DraftProposer]:
    """The proposer class that --speculative names (imported on demand)."""
    if method == "ngram":
        from atlas.speculative.ngram import NgramProposer

        return NgramProposer
    if method == "dflash":
        from atlas.speculative.dflash import DFlashProposer

        return DFlashProposer
    if method == "mtp":
        from atlas.speculative.mtp import MTPProposer

        return MTPProposer
    raise ConfigError(f"unknown --speculative method {method!r}")


def build_proposer(config: EngineConfig, ctx: ProposerContext) -> DraftProposer:
    """The proposer that --speculative names, checked against the loaded target."""
    cls = proposer_class(config.speculative)
    if config.speculative == "ngram":
        return cls(config.num_draft_tokens or DEFAULT_NGRAM_DRAFT_TOKENS, config.ngram_min, config.ngram_max)
    return cls.from_config(config, ctx)


class VerifyOnly(DraftProposer):
    """A parallel worker's proposer: drafts come from the driver inside each step, so it holds no drafter,
    capture buffer or draft cache; it only says K (its verify-step graphs are captured for K + 1 rows)."""

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens

    def propose(self, requests: list[Request]) -> list[Draft]:
        raise RuntimeError("a parallel worker does not draft: the driver does")


def verify_only(config: EngineConfig, target: ModelConfig) -> VerifyOnly:
    """The worker's stand-in for the proposer that --speculative names on the driver."""
    method = config.speculative
    if method == "ngram":
        return VerifyOnly(config.num_draft_tokens or DEFAULT_NGRAM_DRAFT_TOKENS)
    if method == "dflash":
        from atlas.speculative.dflash import DFlashProposer

        return VerifyOnly(DFlashProposer.draft_count(config, target))
    if method == "mtp":
        from atlas.speculative.mtp import MTPProposer

        return VerifyOnly(MTPProposer.draft_count(config, target))
    raise ConfigError(f"--speculative {method} does not run on parallel workers")
