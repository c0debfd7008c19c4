"""What the engine returns: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import msgspec


class Logprob(msgspec.Struct, gc=False, array_like=True):
    """Log-probability of one token under the model's raw (unprocessed) distribution.

    A request with many sequences and logprobs holds millions of these (2 prompts x n = 128 x 200 tokens x 21
    entries: over a million), in the engine and in its front end. As a Python class each instance was an object the
    garbage collector tracks, and so was each token's dict of them: every full collection walked them all, and a
    full collection comes each time the tracked objects grow by a quarter, so such a request stalled its process
    (the engine's step loop, the front end's event loop) for a fraction of a second, longer as it went on. A struct
    the collector does not track (it holds a number, a number and a string: no cycles) leaves those dicts
    untracked too; it is also made in C (about 8 times faster than a dataclass's __init__) and takes 40 bytes
    instead of 56. Positional and keyword construction, attributes, equality and repr are a dataclass's. Over the
    wire (msgpack, atlas/engine/wire.py) it is the array [logprob, rank, decoded_token]."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top ones).
SampleLogprobs = list[dict[int, Logprob]]


def mean_acceptance_length(accepted_tokens: int, verify_steps: int) -> float | None:
    """Tokens emitted per speculative verify step: accepted drafts plus the target's own token."""
    return (accepted_tokens + verify_steps) / verify_steps if verify_steps else None


@dataclass(slots=True)
class BucketCounts:
    """A histogram kept as plain counts (no locks, no torch): the engine adds to it in its loop, the metrics
    collector reads it at scrape time. `add(value, n)` counts n equal observations at the cost of one."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket; the last: above every bound
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def add(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    @property
    def count(self) -> int:
        return sum(self.counts)


# Seconds between two outputs of a request (vLLM's inter-token latency; a verify step's tokens come together).
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Tokens computed in one engine step (prompt chunks, decodes and draft rows).
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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
    # When the engine core took the request in: later than its arrival by the front end's hand-over (a server).
    received_time: float | None = None
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


@dataclass
class ClassificationOutput:
    """vLLM's ClassificationOutput: the class probabilities of one prompt (softmax of a sequence classifier's
    logits; the sigmoid of its one logit for a single-label model, as vLLM's classify activation)."""

    probs: list[float]

    @classmethod
    def from_logits(cls, logits: list[float]) -> ClassificationOutput:
        if len(logits) == 1:
            x = logits[0]
            return cls([1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))])
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        total = sum(exps)
        return cls([e / total for e in exps])

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's ClassificationRequestOutput, what LLM.classify returns: `.outputs.probs`."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    """vLLM's ScoringOutput: a pair's score (atlas/scoring.py: an embedding model's cosine similarity, a
    cross-encoder's activated logit)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's ScoringRequestOutput, what LLM.score returns: `.outputs.score`. prompt_token_ids: the one prompt a
    cross-encoder read, or an embedding model's two texts' tokens one after the other."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One beam of a beam search (vLLM's): its tokens (the prompt's, then the generated ones), each generated
    token's logprob entries (the best of its step), the summed logprob of the generated tokens, their text, and
    why it ended ("stop": an end-of-sequence token; "length": max_tokens)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]
