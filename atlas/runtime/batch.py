"""The contract between the scheduler (host numbers) and the model runner (device tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from atlas.sampling_params import SamplingParams


class SequenceView(Protocol):
    """What the runner reads from a scheduled sequence (the engine's Request satisfies it)."""

    request_id: str
    all_token_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    spec_token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    generator: torch.Generator | None
    params: SamplingParams
    spec_draft_probs: torch.Tensor | None
    prompt_logprobs: list | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def stop_token_ids(self) -> list[int]: ...


@dataclass
class StepBatch:
    """One engine step: each sequence computes `num_scheduled[i]` tokens starting at its
    num_computed_tokens. A sequence whose scheduled tokens reach its last known token is sampled
    (one row, or 1 + drafts when it carries speculative tokens)."""

    seqs: list[SequenceView]
    num_scheduled: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)

    def num_sample_rows(self, i: int) -> int:
        seq = self.seqs[i]
        end = seq.num_computed_tokens + self.num_scheduled[i]
        return max(0, end - seq.num_tokens + 1)


@dataclass
class StepResult:
    """Per sequence of the batch.

    sampled_token_ids: the tokens to append: empty for a prefill chunk that has not reached the end of
    the prompt; one for a decode; for a verify, the accepted drafts then the target's own token.
    logprobs: per appended token (logprob, rank, [(token, logprob) of the top ones]) when asked for.
    hidden: captured residual streams of the LAST rows of the sequence's scheduled tokens
    ([rows, capture width], a view valid until the next step), or None.
    """

    sampled_token_ids: list[list[int]]
    logprobs: list[list[tuple[float, int, list[tuple[int, float]]]] | None]
    hidden: list[torch.Tensor | None]
    # For sequences that asked: (position p, logprob of prompt token p + 1, its rank, top) per computed
    # prompt position whose next token is a prompt token.
    prompt_logprobs: list[list[tuple[int, float, int, list[tuple[int, float]]]] | None] = field(
        default_factory=list)
