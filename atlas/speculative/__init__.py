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
    if method == "eagle3":
        from atlas.speculative.eagle3 import Eagle3Proposer

        return Eagle3Proposer
    if method == "draft_model":
        from atlas.speculative.draft_model import DraftModelProposer

        return DraftModelProposer
    raise ConfigError(f"unknown --speculative method {method!r}")


def build_proposer(config: EngineConfig, ctx: ProposerContext) -> DraftProposer:
    """The proposer that --speculative names, checked against the loaded target."""
    cls = proposer_class(config.speculative)
    if config.speculative == "ngram":
        return cls(config.num_draft_tokens or DEFAULT_NGRAM_DRAFT_TOKENS, config.ngram_min, config.ngram_max)
    return cls.from_config(config, ctx)


class VerifyOnly(DraftProposer):
    """A parallel worker's proposer: drafts come from the driver inside each step, so it holds no drafter,
    capture buffer or draft cache; it says K (its verify-step graphs are captured for K + 1 rows) and, on a
    later pipeline stage, which of its layers' residual streams the driver's drafter reads (the stage
    captures them and sends them to the first stage with the step's rows)."""

    def __init__(self, num_draft_tokens: int, layers: tuple[int, ...] = ()):
        self.num_draft_tokens = num_draft_tokens
        self.layers = layers

    def capture_layers(self) -> tuple[int, ...]:
        return self.layers

    def propose(self, requests: list[Request]) -> list[Draft]:
        raise RuntimeError("a parallel worker does not draft: the driver does")


def verify_only(config: EngineConfig, target: ModelConfig) -> VerifyOnly:
    """The worker's stand-in for the proposer that --speculative names on the driver."""
    method = config.speculative
    staged = config.pipeline_parallel_size > 1  # (tensor-parallel workers capture nothing: the driver has it all)
    if method == "ngram":
        return VerifyOnly(config.num_draft_tokens or DEFAULT_NGRAM_DRAFT_TOKENS)
    if method == "dflash":
        from atlas.models.dflash import DFlashConfig
        from atlas.speculative.dflash import DFlashProposer, find_draft_model

        layers = ()
        if staged:
            layers = tuple(DFlashConfig.from_path(find_draft_model(config, target.path),
                                                  target.num_hidden_layers).target_layer_ids)
        return VerifyOnly(DFlashProposer.draft_count(config, target), layers)
    if method == "mtp":
        from atlas.speculative.mtp import MTPProposer

        return VerifyOnly(MTPProposer.draft_count(config, target),
                          (target.num_hidden_layers - 1,) if staged else ())
    if method == "eagle3":
        from atlas.speculative.eagle3 import Eagle3Proposer, worker_capture_layers

        return VerifyOnly(Eagle3Proposer.draft_count(config, target),
                          worker_capture_layers(config, target) if staged else ())
    if method == "draft_model":
        from atlas.speculative.draft_model import draft_count

        return VerifyOnly(draft_count(config))  # (it reads token ids only: no stage captures anything for it)
    raise ConfigError(f"--speculative {method} does not run on parallel workers")
