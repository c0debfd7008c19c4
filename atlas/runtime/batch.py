"""The contract between the scheduler (host numbers) and the model runner (device tensors).

A StepBatch is a snapshot: the scheduler fills in every number the runner needs when it schedules the
step, and one plain record per sequence (ScheduledSeq) with what the runner reads of it, so the runner never reads
request state that changes while the step runs on the device (with asynchronous scheduling the next step is
scheduled before this one's tokens are known). What lasts from step to step (a page table, the output tokens the
sampler's penalties count) the runner keeps itself (runtime/request_tables.py): a record brings only its change.
The batch also carries the deltas of the runner's per-request state (runtime/request_state.py): requests first
scheduled with a seed, requests that ended, requests preempted.

Host types only: the scheduler imports this module and no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from atlas.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from atlas.engine.request import Request
    from atlas.runtime.request_tables import StepPageTables

# A page-table change: (first, pages) makes the runner's copy of a table copy[:first] + pages (first 0: the whole
# table).
PageChange = tuple[int, list[int]]


class ScheduledSeq(NamedTuple):
    """One sequence of a step as the runner sees it: plain values that nothing changes once the step is scheduled
    (its lists are the step's own, or lists the request never changes, shared like the params).

    A parallel worker's records carry the first three fields only (it samples nothing): params None, the other
    lists empty."""

    request_id: str
    # The ids at the step's positions from its first row that is not a pending input (StepBatch.pending_input): known
    # tokens, then the drafts (the last num_draft_rows; placeholders where their values stay on the device). A list,
    # or the empty tuple of a record shared by the steps that bring nothing new (Request.idle_record).
    tokens: list[int] | tuple[()]
    # The change of the request's page table since the runner last saw it (a PageChange), or None: the whole table
    # when it is first scheduled and after a preemption, else the pages added (and those trimmed or released).
    pages: PageChange | None
    params: SamplingParams | None
    stop_token_ids: list[int]
    prompt_token_ids: list[int]
    # Requests with penalties (the sampler counts their output tokens): the output tokens the runner has not seen yet
    # (all of them the first time and after a preemption); None for the others.
    new_output_tokens: list[int] | None = None
    # Requests that want prompt logprobs: how many prompt positions are scored already (a prompt recomputed after a
    # preemption skips them); None for the others.
    prompt_positions_scored: int | None = None
    # Models whose windowed layers keep a page pool of their own (engine/kv_groups.py): the change of the request's
    # table there, as `pages`; None for the others and when it is the same.
    window_pages: PageChange | None = None


def window(tokens: list[int], drafts: list[int], start: int, count: int) -> list[int]:
    """The ids at positions start .. start + count - 1 of a sequence whose known tokens are `tokens`, then `drafts`
    (only that stretch is copied)."""
    known = len(tokens)
    if start + count > known:
        return tokens[start:] + drafts[: start + count - known]
    return tokens[start: start + count]


@dataclass
class TokenMasks:
    """Grammar bitmasks of a step's constrained sample rows (structured outputs)."""

    bitmask: torch.Tensor  # [R, ceil(vocab / 32)] int32 on the host; bit t of a row allows token t
    rows: list[int]  # the sample row (index into the step's sample rows) of each bitmask row
    seqs: frozenset[int]  # batch indices of the constrained sequences


@dataclass
class StepBatch:
    """One engine step. Sequence i computes positions start[i] .. start[i] + num_scheduled[i] - 1.

    The tokens at those positions are seqs[i].tokens (known tokens, then drafts, possibly padded to a uniform count),
    except where `pending_input[i]`: then the token at start[i] is the one sampled for that sequence in the previous
    step, still on the device (asynchronous scheduling), and seqs[i].tokens begins at the next position.
    `num_sample_rows[i]` of the last rows need a next token: 0 for a prefill chunk that does not reach
    the end of the known tokens, 1 for a decode, 1 + num_drafts[i] for a verify. Rows past those (padded
    drafts) are computed and ignored.
    """

    seqs: list[ScheduledSeq]
    num_scheduled: list[int]
    start: list[int] = field(default_factory=list)
    num_sample_rows: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    pending_input: list[bool] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)  # counting a pending one (for min_tokens)
    num_draft_rows: list[int] = field(default_factory=list)  # scheduled draft positions, padding included
    # Sequences whose drafts stay on the device (their drafts in `tokens` are placeholders; Draft.device_tokens).
    device_drafts: list[int] = field(default_factory=list)
    token_masks: TokenMasks | None = None  # set by the engine when some sequences follow a grammar
    # The masks depend on tokens still in flight: the step is launched now and sampled once the engine
    # gives them (StepHandle.apply_masks), so the device never waits for the host's grammar work.
    masks_deferred: bool = False
    # The speculation policy stopped drafting: a proposer's context rows are written right behind this step
    # (ModelRunner.context_behind), since its commits may be read back after the next step has launched.
    plain_speculation: bool = False
    # The speculation policy cut this step's drafts to this many a request (a draft-length ladder; 0: not cut).
    draft_cut: int = 0
    # Models with recurrent state: each sequence's state slot (the scheduler's; empty for other models).
    state_slots: list[int] = field(default_factory=list)
    # ... and copies of recurrent state for prefix caching: (snapshot id, state slot) to load before the step's
    # forward (a prefix hit resumes there), (state slot, snapshot id, rows) to save the state after the sequence's
    # first rows of the step (a prompt page's end: after the forward where that is all its rows, else inside it).
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # ... and for speculative decoding: the state slots backed up before this step's forward (each sequence that
    # verifies drafts: rows past a rejected draft advance its state too), and (slot, kept rows) of those whose last
    # verify step rejected some: before the forward each is restored from its backup and the kept rows' saved inputs
    # are replayed through the linear-attention layers (StateSlots.prepare), so the step computes only new rows.
    state_backups: list[int] = field(default_factory=list)
    state_replays: list[tuple[int, int]] = field(default_factory=list)
    # --enable-lora: each sequence's adapter slot + 1 (0: the base model); empty without adapters or when none is used.
    lora_slots: list[int] = field(default_factory=list)
    # Deltas for the runner's per-request state since the last step: (request id, seed) of requests scheduled
    # for the first time with a seed (the runner makes their generator), requests that ended (it forgets them) and
    # requests preempted (their drafts are void, their page tables gone).
    seeded: list[tuple[str, int]] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # The runner's, bound at launch from its per-request tables (RequestTables.bind): the sequences' page tables and,
    # by batch index, the output tokens of those with penalties.
    page_tables: StepPageTables | None = None
    # ... and their window-group tables (models with KV cache groups: engine/kv_groups.py; else None).
    window_page_tables: StepPageTables | None = None
    output_tokens: dict[int, list[int]] = field(default_factory=dict)
    # ... and from its per-request device state (RequestStates.bind): the sequences' seeded generators (empty: none
    # has one), their drafts left on the device (of device_drafts, until read back) and their draft distributions.
    generators: list[torch.Generator | None] = field(default_factory=list)
    draft_tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Defaults for steps without drafts or inputs on the device."""
        n = len(self.seqs)
        if not self.num_drafts:
            self.num_drafts = [0] * n
        if not self.num_draft_rows:
            self.num_draft_rows = list(self.num_drafts)
        if not self.pending_input:
            self.pending_input = [False] * n

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @functools.cached_property
    def plain_greedy(self) -> list[bool]:
        """Per sequence: greedy with nothing that changes the logits first (logit bias, penalties, a stop token
        held back by min_tokens), so the argmax is the token. (Grammar masks are the runner's to add.)"""
        return [s.params.greedy and not s.params.changes_logits and (n >= s.params.min_tokens or not s.stop_token_ids)
                for s, n in zip(self.seqs, self.num_output_tokens, strict=True)]

    @functools.cached_property
    def wants_prompt_logprobs(self) -> bool:
        return any(s.params.prompt_logprobs is not None for s in self.seqs)

    def drafts(self, i: int) -> list[int]:
        """Sequence i's drafts (padding included; placeholders where they stay on the device)."""
        rows = self.num_draft_rows[i]
        return self.seqs[i].tokens[-rows:] if rows else []


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

    request: Request  # (handed to the proposer by the scheduler: the live request)
    start_position: int
    num_tokens: int
    captured: torch.Tensor | None
    valid_rows: int | None = None

    @property
    def hidden(self) -> torch.Tensor | None:
        rows, valid = self.captured, self.valid_rows
        return rows if rows is None or valid is None or valid >= rows.shape[0] else rows[:valid]


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
    # --runner pooling: the pooled vector of each sequence whose prompt ended in the step (None for the others);
    # empty for a generating engine.
    pooled: list[list[float] | None] = field(default_factory=list)
