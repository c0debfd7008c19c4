"""What the model runner and the proposers share: the context a proposer is given of the loaded target, and
the verify step a drafter may draft right behind on the device. These types live in the runtime, so that the
runtime never imports a proposer (proposers import the runtime, not the other way round)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atlas.config import ModelConfig
    from atlas.layers.attention_backend import AttentionBackend
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
    # Graph factory: (name, forward, q_len, the attention backend of the drafter's caches, page-table width,
    # use_graphs) -> StepGraphs over uniform q_len-token steps, padded into the scratch pages.
    make_graphs: Callable[[str, ForwardFn, int, AttentionBackend, int, bool], StepGraphs]
    scratch_pages: list[int] = field(default_factory=list)  # pages that only graph padding rows touch
    # Target capabilities (None / 0 where the target has none):
    # (max positions, the embedding to share or None for the model's, the LM head likewise) -> its first MTP module
    build_mtp: Callable[[int, torch.nn.Module | None, torch.nn.Module | None], torch.nn.Module] | None = None
    num_mtp_modules: int = 0
    # Under tensor parallelism, the driver's whole copy of the embedding (what `embed` calls; the model's
    # is a vocabulary shard); None otherwise.
    whole_embedding: torch.nn.Module | None = None
    # ... and of the LM head, where the proposer asked for it (needs_target_head); None otherwise.
    whole_lm_head: torch.nn.Module | None = None
    # Rows of the target's whole LM head for some token ids (copies, [len, hidden]); None where the target's
    # logits are not a product with such a head.
    head_rows: Callable[[torch.Tensor], torch.Tensor | None] | None = None


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

    request_ids: list[str]
    num_pages: list[int]  # pages of each request's table (the engine reserved them through the block behind)
    start: list[int]  # first position of each request's rows
    num_drafts: list[int]  # real drafts of each request (the rest pad the step to K)
    input_ids: torch.Tensor  # [n * q] the rows' token ids (last token, drafts)
    positions: torch.Tensor  # [n * q] the rows' positions
    target_tokens: torch.Tensor  # [n * q] the target's token after each row (greedy: the argmax)
    captured: torch.Tensor | None  # [n * q, capture width] residual streams of the capture layers
    slot_mapping: torch.Tensor  # [n * q] the rows' cache slots
    page_tables: torch.Tensor  # [n, pages] int32, pages through start + 2q - 1 (the engine allocated them)
    # The verify graphs that ran the step, whose static buffers (ids, positions, slots, page tables) and the
    # outputs of its padded batch size hold it until their next replay; None where it ran otherwise.
    graphs: StepGraphs | None = None

    def pages_hold_next_step(self, block_size: int) -> bool:
        """Whether the engine reserved each request's pages through the rows of the verify step after this one
        (start + 2q - 1: a drafter queues that step's inputs right behind this one)."""
        reach = 2 * (self.input_ids.shape[0] // len(self.request_ids))
        return all(p * block_size >= s + reach for p, s in zip(self.num_pages, self.start, strict=True))


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
