"""The DraftProposer plug-in: everything the engine knows about a drafter.

The engine, scheduler and model runner never name a proposer. They ask it which target layers to
capture, how many captured rows it can use, how much memory it needs, and they call its hooks:
start of a request, commit of tokens (with the captured residual streams of those tokens), end of a
request, and `propose` for requests that decode next.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atlas.host_copy import to_device
from atlas.kernels.draft_prologue import BlockInputs, next_block_inputs
from atlas.layers.attention_backend import AttentionBackend, attention_backend

# (the types the runtime shares with proposers live in the runtime; named here too for the proposers)
from atlas.runtime.batch import CommittedTokens
from atlas.runtime.drafting import NextVerify, ProposerContext, VerifiedStep, flat_device_drafts

if TYPE_CHECKING:
    from atlas.config import ModelConfig
    from atlas.engine.request import Request
    from atlas.runtime.cuda_graphs import StepGraphs

__all__ = ["CommittedTokens", "Draft", "DraftProposer", "NextVerify", "ProposerContext", "VerifiedStep",
           "PagedDrafter", "device_draft", "flat_device_drafts", "place_drafts"]


@dataclass
class Draft:
    """Draft tokens for one request; `probs` [len(token_ids), V] when the drafter sampled them from a
    distribution (then verification uses full rejection sampling), None for one-hot drafts.

    `device_tokens` [len(token_ids)]: one-hot drafts left on the device (DraftProposer.device_drafts):
    `token_ids` then only holds placeholders (a valid id, so that padding rows stay valid); the verify step
    takes the ids from the device and reads them back with its own results, so the host never waits for
    the drafter."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    device_tokens: torch.Tensor | None = None

    def read_tokens(self) -> list[int]:
        """The draft's ids, read back from the device if they are there (a host wait: not for the step path,
        which reads them with the verify step's results)."""
        return self.token_ids if self.device_tokens is None else self.device_tokens.tolist()


def device_draft(tokens: torch.Tensor, placeholder: int) -> Draft:
    return Draft([placeholder] * tokens.shape[0], None, tokens)


def place_drafts(drafts: list[Draft], rows: list[tuple[int, Request]], tokens: torch.Tensor, on_device: bool) -> None:
    """drafts[i] = row j of tokens [len(rows), K] for each (i, request) of rows: left on the device (one-hot drafts the
    verify step reads there) or read back."""
    if on_device:
        for (i, req), t in zip(rows, tokens, strict=True):
            drafts[i] = device_draft(t, req.all_token_ids[-1])
        return
    for (i, _), t in zip(rows, tokens.tolist(), strict=True):
        drafts[i] = Draft(t)


class DraftProposer(ABC):
    """Base class of the drafters. Subclasses implement `propose` and whatever hooks they need."""

    #: draft tokens per verify step (K)
    num_draft_tokens: int
    #: KV slots a request needs past its last token before `propose` runs (e.g. a drafter that writes
    #: its own block K/V into the request's pages). 0 = none.
    lookahead_slots: int = 0
    #: it calls the context's embed / compute_logits (a tensor-parallel driver then gives it whole copies)
    uses_target_vocab: bool = False
    #: ... and compute_logits too (False: the embedding alone, e.g. a drafter with its own head)
    uses_target_head: bool = True
    #: the rows it captures are its target's own MTP input (CausalLM.capture_blocker, captured_width), not plain
    #: hidden states of the layers it names
    reads_mtp_input: bool = False

    @classmethod
    def needs_target_head(cls, model: object) -> bool:
        """Whether a tensor-parallel driver must hold a whole copy of this target's LM head for it (before it is
        built: the memory plan counts the copy)."""
        return cls.uses_target_head
    #: set by the engine: drafts may stay on the device (Draft.device_tokens) instead of being read back
    device_drafts: bool = False
    #: it implements `draft_after_verify`
    can_draft_after_verify: bool = False
    #: set by the engine (one device, drafts on it): verify steps reserve pages for the next block and call
    #: `draft_after_verify` right after the target's forward
    drafts_after_verify: bool = False

    def capture_layers(self) -> tuple[int, ...]:
        """Target decoder layers whose output (residual stream) this proposer reads."""
        return ()

    def prefill_hidden_rows(self, max_rows: int) -> int:
        """How many captured rows of one step it can use, at most max_rows (default: all)."""
        return max_rows

    def weight_bytes(self) -> int:
        """Device memory of its weights and fixed buffers (for the memory plan)."""
        return 0

    def kv_bytes_per_token(self) -> int:
        """Device memory of its own KV cache per target token slot (for the memory plan)."""
        return 0

    def graph_bytes(self, target: ModelConfig, max_num_seqs: int) -> int:
        """Device memory its own CUDA graphs (their pools) and their static buffers will take when the runtime
        captures graphs: they are made in `bind`, after the KV pages are allocated, so the memory plan counts
        them beforehand."""
        return 0

    def bind(self, ctx: ProposerContext) -> None:  # noqa: B027 (optional hook)
        """Attach to the loaded target and runtime; called once after the KV pages are allocated."""

    def allocate_kv_cache(self, num_pages: int, block_size: int) -> None:  # noqa: B027 (optional hook)
        """Allocate its own cache (with its attention backend, layers.attention_backend), addressed by the target's
        page ids."""

    def on_request_start(self, req: Request) -> None:  # noqa: B027 (optional hook)
        pass

    def on_commit(self, commits: list[CommittedTokens]) -> None:  # noqa: B027 (optional hook)
        pass

    @property
    def takes_commits(self) -> bool:
        """Whether on_commit does anything: the scheduler gathers each step's commits only for a proposer that
        reads them (n-gram does not: at 256 requests the gathering alone is a tenth of a millisecond a step)."""
        return type(self).on_commit is not DraftProposer.on_commit

    def on_request_finish(self, req: Request) -> None:  # noqa: B027 (optional hook)
        pass

    def on_request_preempt(self, req: Request) -> None:  # noqa: B027 (optional hook)
        """req gave its pages back (preempted): it computes its tokens again when it is next scheduled."""

    def on_pages_released(self) -> None:  # noqa: B027 (optional hook)
        """Pages of a running request went back to the pool (a sliding window passed them)."""

    #: it implements `write_context_behind`: its commits need no captured rows while drafting is off, so plain
    #: steps may then overlap (asynchronous scheduling). A proposer that captures nothing needs none either.
    can_write_context_behind: bool = False

    def write_context_behind(self, captured: torch.Tensor, positions: torch.Tensor,  # noqa: B027 (optional hook)
                             slot_mapping: torch.Tensor) -> None:
        """Take a plain step's captured rows right behind it on the device (every row is committed: a plain
        step has no drafts to reject); its commits then come with no captured rows."""

    def bind_verify_graphs(self, graphs: StepGraphs | None) -> None:  # noqa: B027 (optional hook)
        """The target's verify graphs (K + 1-token steps), once captured: a drafter that drafts after verify
        steps may capture its block behind them, reading their static buffers."""

    def takes_captured_rows(self, step: VerifiedStep) -> bool:
        """Whether `draft_after_verify(step)` will queue a block for every request that reads the step's
        captured rows itself: the runner then keeps none of them for `on_commit`."""
        return False

    def draft_after_verify(self, step: VerifiedStep) -> NextVerify | None:
        """Queue the next drafts of every request of a verify step on the device, right behind the step,
        from what the step computed (which drafts the target accepts is known there before the host reads
        it): the host then overlaps its bookkeeping with the drafter, and `propose` hands these drafts out.
        -> the next verify step's inputs on the device, or None if it queued nothing (`propose` then drafts
        as usual)."""
        return None

    @abstractmethod
    def propose(self, requests: list[Request]) -> list[Draft]:
        """Drafts for requests whose next step is a decode (their last token is not computed yet)."""


class PagedDrafter(DraftProposer):
    """A proposer whose drafter keeps its own paged KV cache, at the target's page ids and slots (freed and
    preempted with the request's pages). Subclasses set `device`, `dtype` and the drafter module
    (`cache_module`, by default the `model` attribute)."""

    kv_caches: list[torch.Tensor]
    block_size: int = 0
    # The backend of its caches (set with them): their slots, per-step metadata and graph inputs.
    attention: AttentionBackend

    def cache_module(self) -> torch.nn.Module:
        return self.model

    def _graph_width(self, ctx: ProposerContext) -> int:
        """Page-table width of its graphs: every position below max model len + K + 1 (its lookahead rows)."""
        return -(-(ctx.max_model_len + self.num_draft_tokens + 1) // self.block_size)

    def kv_bytes_per_token(self) -> int:
        return sum(spec.bytes_per_token(self.dtype) for spec in self.cache_module().kv_cache_specs())

    def allocate_kv_cache(self, num_pages: int, block_size: int) -> None:
        self.kv_caches = []  # (the old cache freed before the new one is allocated)
        self.block_size = block_size
        self.attention = attention_backend(self.cache_module().kv_cache_specs(), block_size)
        self.kv_caches = self.attention.allocate(num_pages, self.dtype, self.device)


class DraftsBehind:
    """Drafts queued right behind verify steps (`draft_after_verify`), by request id: (the step's first position,
    the K draft ids on the device). `queued` fills while the step runs; its commit moves them to `ready`
    (`read_back`), which the following `propose` takes."""

    def __init__(self):
        self.queued: dict[str, tuple[int, torch.Tensor]] = {}
        self.ready: dict[str, tuple[int, torch.Tensor]] = {}

    def record(self, step: VerifiedStep, drafts: torch.Tensor) -> None:
        # (unbind: every request's row as a view in one call, where n slicings would each cost the host)
        self.queued = dict(zip(step.request_ids, zip(step.start, drafts.unbind(0), strict=True), strict=True))

    def read_back(self) -> None:
        self.ready, self.queued = self.queued, {}

    def take(self) -> dict[str, tuple[int, torch.Tensor]]:
        ready, self.ready = self.ready, {}
        return ready

    def forget(self, request_id: str) -> None:
        self.queued.pop(request_id, None)
        self.ready.pop(request_id, None)

    @staticmethod
    def draft(entry: tuple[int, torch.Tensor], req: Request, num_draft_tokens: int) -> Draft | None:
        """The drafts of `entry` for req, if they were drafted where the host's acceptance puts it (start +
        accepted + 1); None otherwise."""
        if 0 < req.num_computed_tokens - entry[0] <= num_draft_tokens + 1:
            return device_draft(entry[1], req.all_token_ids[-1])
        return None


def verify_outcome(step: VerifiedStep, num_draft_tokens: int, block_size: int) -> tuple[BlockInputs, torch.Tensor]:
    """What a verify step's outputs tell on the device, for a drafter that drafts right behind it (new tensors,
    which nothing rewrites): the next verify step's positions, slots and lengths and each request's bonus token
    (`BlockInputs`; its ids and context rows are DFlash's and unused here), and each request's accepted drafts [n]
    (kernels/draft_prologue.py)."""
    n, k, dev = len(step.request_ids), num_draft_tokens, step.input_ids.device
    rows = n * (k + 1)
    # (drafts the host cut, at the end of a request: their padding is never accepted)
    cut = to_device(step.num_drafts, torch.long, dev) if any(d != k for d in step.num_drafts) else None
    out = BlockInputs(*(torch.empty(rows, dtype=torch.long, device=dev) for _ in range(3)),
                      torch.empty(n, dtype=torch.int32, device=dev), torch.empty(n, dtype=torch.long, device=dev),
                      *(torch.empty(rows, dtype=torch.long, device=dev) for _ in range(2)))
    next_block_inputs(step.input_ids, step.target_tokens, step.positions, step.slot_mapping, cut, step.page_tables,
                      block_size, 0, out)
    accepted = out.positions[:: k + 1] - step.positions[:: k + 1] - 1
    return out, accepted


def run_rows_behind(graphs: StepGraphs, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    page_tables: torch.Tensor, bound: list[int]) -> tuple:
    """One row a request through one-row `graphs` at positions and slots computed on the device behind a verify
    step (contiguous [n]). `bound`: the most each row's length can be, the host lengths a replay carries (eagerly,
    on a CPU, the reference attention reads the real ones)."""
    lens = (positions + 1).to(torch.int32)
    meta = graphs.attn.device_step_meta(lens, page_tables, slots, lens.tolist() if not graphs.use_graphs else bound)
    return graphs.run(ids, positions, meta)
