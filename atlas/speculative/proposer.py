"""The DraftProposer plug-in: everything the engine knows about a drafter.

The engine, scheduler and model runner never name a proposer. They ask it which target layers to
capture, how many captured rows it can use, how much memory it needs, and they call its hooks:
start of a request, commit of tokens (with the captured residual streams of those tokens), end of a
request, and `propose` for requests that decode next.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atlas.config import ModelConfig
    from atlas.engine.request import Request
    from atlas.runtime.cuda_graphs import ForwardFn, StepGraphs


@dataclass
class ProposerContext:
    """What a proposer may use of the loaded target and the runtime (it never sees the runner).

    Built by the model runner; the one given to `bind` is complete (scratch pages allocated), the one
    given to a proposer's constructor may not be."""

    target_config: ModelConfig  # the target's config.json view (sizes, vocabulary, checkpoint path)
    embed: Callable[[torch.Tensor], torch.Tensor]  # the target's token embedding
    compute_logits: Callable[[torch.Tensor], torch.Tensor]  # the target's LM head
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    max_num_seqs: int
    graphs_enabled: bool  # CUDA graphs are in use (CUDA, not --enforce-eager)
    # Graph factory: (name, forward, q_len, (query heads, key heads) of the kernels, page-table width,
    # use_graphs) -> StepGraphs over uniform q_len-token steps, padded into the scratch pages.
    make_graphs: Callable[[str, ForwardFn, int, tuple[int, int], int, bool], StepGraphs]
    scratch_pages: list[int] = field(default_factory=list)  # pages that only graph padding rows touch
    # Target capabilities (None / 0 where the target has none):
    # (max positions, the embedding to share or None for the model's) -> its first MTP module
    build_mtp: Callable[[int, torch.nn.Module | None], torch.nn.Module] | None = None
    num_mtp_modules: int = 0
    # Under tensor parallelism, the driver's whole copy of the embedding (what `embed` calls; the model's
    # is a vocabulary shard); None otherwise.
    whole_embedding: torch.nn.Module | None = None
    # Rows of the target's whole LM head for some token ids (copies, [len, hidden]); None where the target's
    # logits are not a product with such a head.
    head_rows: Callable[[torch.Tensor], torch.Tensor | None] | None = None


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


def flat_device_drafts(drafts: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """The first counts[j] ids of each drafts[j] (drafts left on the device), back to back in one tensor: a view
    where they already lie so in one tensor (the rows of one drafter block, in order: the usual step), else a
    concatenation. A view per request costs the host a few microseconds: a step of many requests adds up."""
    parts = [t if t.shape[0] == k else t[:k] for t, k in zip(drafts, counts, strict=True)]
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    base, size = first._base, first.element_size()
    if base is not None and base.is_contiguous():
        end = first.data_ptr()
        for t in parts:
            if t._base is not base or t.data_ptr() != end or (t.shape[0] > 1 and t.stride(0) != 1):
                break
            end += t.shape[0] * size
        else:
            return base.view(-1).narrow(0, (first.data_ptr() - base.data_ptr()) // size,
                                        (end - first.data_ptr()) // size)
    return torch.cat(parts)


@dataclass
class VerifiedStep:
    """A verify step just launched, as a proposer that drafts right after it (`draft_after_verify`) sees it:
    device tensors the step computed, and the host numbers it was scheduled with. Every request verifies
    q = K + 1 rows (its last token, then K drafts of which num_drafts are real); row j of a request is
    position start + j."""

    requests: list[Request]
    start: list[int]  # first position of each request's rows
    num_drafts: list[int]  # real drafts of each request (the rest pad the step to K)
    input_ids: torch.Tensor  # [n * q] the rows' token ids (last token, drafts)
    positions: torch.Tensor  # [n * q] the rows' positions
    target_tokens: torch.Tensor  # [n * q] the target's token after each row (greedy: the argmax)
    captured: torch.Tensor | None  # [n * q, capture width] residual streams of the capture layers
    slot_mapping: torch.Tensor  # [n * q] the rows' cache slots
    block_tables: torch.Tensor  # [n, pages] int32, pages through start + 2q - 1 (the engine allocated them)
    # The verify graphs that ran the step, whose static buffers (ids, positions, slots, page tables) and the
    # outputs of its padded batch size hold it until their next replay; None where it ran otherwise.
    graphs: StepGraphs | None = None


@dataclass
class NextVerify:
    """What a block drafted behind a verify step gives the verify step after it, on the device: each request's
    bonus token and its K drafts (q = K + 1 rows), at the block's positions, cache slots and lengths (the next
    verify's rows sit exactly where the block's did)."""

    bonus: torch.Tensor  # [n, 1] each request's next token (the target's, after its accepted drafts)
    drafts: torch.Tensor  # [n, K] (the ids `propose` hands out once the host has read the verify step back)
    positions: torch.Tensor  # [n * q]
    slot_mapping: torch.Tensor  # [n * q]
    seq_lens: torch.Tensor  # [n] int32
    # Whether bonus, positions, slot_mapping and seq_lens still hold this block's values (views of buffers a later
    # drafter run rewrites); None: not known, so the next step's inputs are made on the host.
    still_valid: Callable[[], bool] | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        """[n * q]: each request's bonus token, then its drafts."""
        return torch.cat([self.bonus, self.drafts], 1).flatten()


@dataclass
class CommittedTokens:
    """Tokens of one request whose KV became valid in the target cache this step.

    positions start_position .. start_position + num_tokens - 1. `hidden` holds the captured residual
    streams [rows, capture width] of the LAST `rows` of those tokens (rows <= num_tokens: fewer when
    the capture buffer could not hold a whole prefill chunk), or None when nothing was captured.
    `captured` is the request's rows as the step captured them, of which the first `valid_rows` (None: all)
    hold committed tokens (a verify step's rejected drafts follow); `hidden` cuts them only when a proposer
    asks, since one that drafted the request right behind its step never does.
    """

    request: Request
    start_position: int
    num_tokens: int
    captured: torch.Tensor | None
    valid_rows: int | None = None

    @property
    def hidden(self) -> torch.Tensor | None:
        rows, valid = self.captured, self.valid_rows
        return rows if rows is None or valid is None or valid >= rows.shape[0] else rows[:valid]


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
        """Allocate its own cache (layers.attention.allocate_kv_caches), addressed by the target's page ids."""

    def on_request_start(self, req: Request) -> None:  # noqa: B027 (optional hook)
        pass

    def on_commit(self, commits: list[CommittedTokens]) -> None:  # noqa: B027 (optional hook)
        pass

    def on_request_finish(self, req: Request) -> None:  # noqa: B027 (optional hook)
        pass

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
