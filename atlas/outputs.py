"""What the engine returns: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw (unprocessed) distribution."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top ones).
SampleLogprobs = list[dict[int, Logprob]]


def mean_acceptance_length(accepted_tokens: int, verify_steps: int) -> float | None:
    """Tokens emitted per speculative verify step: accepted drafts plus the target's own token."""
    return (accepted_tokens + verify_steps) / verify_steps if verify_steps else None


@dataclass(kw_only=True)
class SpecDecodeCounters:
    """Speculative decoding's counters, one definition for a request's metrics and the engine's totals."""

    spec_num_draft_tokens: int = 0  # draft tokens proposed
    spec_num_accepted_tokens: int = 0  # of them accepted
    spec_num_verify_steps: int = 0  # (the engine's: a step that verifies drafts of n requests counts n)

    def count_verify(self, num_drafts: int, accepted: int) -> None:
        """One request's verify step: `num_drafts` drafts, `accepted` of them accepted."""
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += accepted
        self.spec_num_verify_steps += 1

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        return mean_acceptance_length(self.spec_num_accepted_tokens, self.spec_num_verify_steps)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # with finish_reason "error": why the sequence could not go on

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics(SpecDecodeCounters):
    """One request's times, preemptions and (inherited) speculative decoding counters."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # With SamplingParams(prompt_logprobs=k): one entry per prompt token (None for the first, which
    # nothing predicts): that token's logprob given the tokens before it, plus the top k.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # --runner pooling: the prompt's pooled vector (finished outputs only).
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: the pooled (and, where the model says so, L2-normalized) vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput, what LLM.embed returns: `.outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
