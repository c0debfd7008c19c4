"""The inputs of a drafter block queued right behind a verify step, computed on the device from what the step
computed: per request, how many of its drafts the target accepted (the leading drafts equal to the target's
argmax of the row before), the bonus token (the target's token after them), the block's positions (the bonus
token's, then K more), their cache slots from the request's page table and its length; the step's positions and
slots also become the block's context rows. One Triton kernel on CUDA (a request a program) instead of some thirty
small tensor operations, each a launch the host pays for between two steps; the PyTorch reference elsewhere.
Tests compare the two."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atlas.kernels import triton_available


@dataclass(frozen=True)
class BlockInputs:
    """Where next_block_inputs writes a drafter block's inputs (views of the block graphs' static buffers;
    int64 unless said): n requests of q rows."""

    ids: torch.Tensor  # [n * q] the bonus token, then q - 1 mask tokens
    positions: torch.Tensor  # [n * q]
    slots: torch.Tensor  # [n * q] their cache slots
    seq_lens: torch.Tensor  # [n] int32
    bonus: torch.Tensor  # [n] the target's token after the accepted drafts
    ctx_positions: torch.Tensor  # [n * q] the verify step's positions ...
    ctx_slots: torch.Tensor  # [n * q] ... and slots: the block's context rows

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.ids, self.positions, self.slots, self.seq_lens, self.bonus, self.ctx_positions, self.ctx_slots)


def next_block_inputs_ref(input_ids: torch.Tensor, target_tokens: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, num_drafts: torch.Tensor | None, page_tables: torch.Tensor,
                          block_size: int, mask_token_id: int, out: BlockInputs) -> None:
    """input_ids, target_tokens, positions, slot_mapping: the verify step's [n * q] rows (int64; each request's
    last token then its K = q - 1 drafts); num_drafts [n] (real drafts; the rest pad the step and are never
    accepted) or None when all K are real; page_tables [n, W] int32. Writes every tensor of `out`."""
    n = page_tables.shape[0]
    q = input_ids.shape[0] // n
    k = q - 1
    # (the context rows first: a step adopted from a pre-launch reads its positions and slots from the buffers
    # the block's outputs go to)
    first = positions.view(n, q)[:, 0] + 1
    out.ctx_positions.copy_(positions)
    out.ctx_slots.copy_(slot_mapping)
    j = torch.arange(q, device=input_ids.device)
    target = target_tokens.view(n, q)
    kept = input_ids.view(n, q)[:, 1:] == target[:, :k]
    if num_drafts is not None:
        kept &= j[:k] < num_drafts[:, None]
    accepted = kept.long().cumprod(1).sum(1)
    first = first + accepted
    block_positions = first[:, None] + j
    bonus = target.gather(1, accepted[:, None])[:, 0]
    out.ids.view(n, q)[:, 0] = bonus
    out.ids.view(n, q)[:, 1:] = mask_token_id
    out.positions.view(n, q).copy_(block_positions)
    out.slots.view(n, q).copy_(page_tables.long().gather(1, block_positions // block_size) * block_size
                               + block_positions % block_size)
    out.seq_lens.copy_(first + q)
    out.bonus.copy_(bonus)


def next_block_inputs(input_ids: torch.Tensor, target_tokens: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, num_drafts: torch.Tensor | None, page_tables: torch.Tensor,
                      block_size: int, mask_token_id: int, out: BlockInputs) -> None:
    """next_block_inputs_ref's outputs: the Triton kernel on CUDA, the reference elsewhere."""
    if input_ids.is_cuda and triton_available():
        from atlas.kernels.draft_prologue_triton import next_block_inputs_triton

        next_block_inputs_triton(input_ids, target_tokens, positions, slot_mapping, num_drafts, page_tables,
                                 block_size, mask_token_id, out)
    else:
        next_block_inputs_ref(input_ids, target_tokens, positions, slot_mapping, num_drafts, page_tables,
                              block_size, mask_token_id, out)
