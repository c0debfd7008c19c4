"""Verify overlap: what a proposer that drafts right behind a verify step (draft_after_verify) is given of that step
(VerifiedStep), the block it drafts there (BlockBehind), and the verify step that follows such a block, queued
behind it on the device before the host has scheduled it (prelaunch; the next launch adopts it if it schedules that
very step)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch

from atlas.runtime.batch import StepBatch
from atlas.runtime.cuda_graphs import StepGraphs
from atlas.runtime.drafting import NextVerify, VerifiedStep
from atlas.runtime.step_inputs import StepInputs

if TYPE_CHECKING:
    from atlas.runtime.parallel import ParallelState


class BlockBehind(NamedTuple):
    """The block a drafter queued behind the last verify step, and the requests of that step: the next step's
    inputs, if it verifies exactly that block (InputPreparer.prepare_behind)."""

    following: NextVerify
    request_ids: list[str]


@dataclasses.dataclass
class Prelaunched:
    """A verify step queued behind a drafted block before the host scheduled it (prelaunch)."""

    graphs: StepGraphs
    request_ids: list[str]  # the requests it verifies, in order
    drafts: torch.Tensor  # [n, K] the block's drafts, which it verifies
    input_ids: torch.Tensor  # [n * q]
    positions: torch.Tensor  # [n * q]
    outputs: tuple  # (greedy, logits, captured) of its rows

    def matches(self, batch: StepBatch) -> bool:
        """Whether `batch` is this very step: the same requests in the same order, each verifying this block's
        drafts (left on the device, handed out by the proposer from this block) after its one known token.
        Drafts the host cut (grammar, length) are a prefix of the block's; the rows after them are padding whose
        outputs are not read."""
        q = self.drafts.shape[1] + 1
        if len(batch.seqs) != len(self.request_ids) or any(
                s.request_id != rid for s, rid in zip(batch.seqs, self.request_ids, strict=True)):
            return False
        on_device = set(batch.device_drafts)
        for i in range(batch.num_seqs):
            drafts = batch.draft_tokens.get(i)
            if (batch.num_scheduled[i] != q or batch.num_draft_rows[i] != q - 1 or batch.pending_input[i]
                    or (batch.num_drafts[i] and (i not in on_device or drafts is None
                                                 or drafts.data_ptr() != self.drafts[i].data_ptr()))):
                return False
        return True


def verified_step(parallel: ParallelState | None, batch: StepBatch, inputs: StepInputs, greedy: torch.Tensor,
                  captured: torch.Tensor | None, graphs: StepGraphs, pre: Prelaunched | None = None
                  ) -> VerifiedStep | None:
    """A verify step whose accepted drafts the device can tell: every request greedy without logits
    processors or grammars, one-hot drafts, none of its input on the device from an earlier step. A step
    adopted from a pre-launch (`pre`) gives the ids and positions it ran with."""
    if parallel is not None or batch.token_masks is not None or batch.masks_deferred:
        return None
    q = inputs.meta.max_query_len
    plain = batch.plain_greedy
    for i in range(batch.num_seqs):
        if (batch.num_draft_rows[i] != q - 1 or batch.pending_input[i] or i in batch.draft_probs
                or not plain[i]):
            return None
    meta = inputs.meta
    ids, positions = (pre.input_ids, pre.positions) if pre is not None else (inputs.input_ids, inputs.positions)
    # (A pre-launched step ran on the page tables of the step before it: the graphs' static tables are not
    #  this step's.)
    return VerifiedStep([s.request_id for s in batch.seqs], batch.page_tables.counts, batch.start,
                        batch.num_drafts, ids, positions, greedy, captured, meta.slot_mapping, meta.page_tables,
                        graphs if pre is None else None)


def prelaunch(graphs: StepGraphs, batch: StepBatch, verified: VerifiedStep, following: NextVerify) -> Prelaunched:
    """Queue the verify step that follows a drafted block right behind it, from the block's ids, positions,
    slots and lengths on the device (its pages are the ones the step before reserved), before the host has
    read anything back. The next launch adopts its outputs if it schedules that very step (the same requests,
    each verifying the drafts of this block); otherwise they are dropped, and the rows it wrote to the
    cache, past every committed position, are written again before anything reads them."""
    meta = graphs.device_step_meta(following.seq_lens, verified.page_tables, following.slot_mapping,
                                   batch.start)
    ids = following.input_ids
    outputs = graphs.run(ids, following.positions, meta)
    return Prelaunched(graphs, verified.request_ids, following.drafts, ids, following.positions, outputs)
