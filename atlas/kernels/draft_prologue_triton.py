"""Triton kernel of kernels/draft_prologue.py: one program a request of the verify step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas.kernels.draft_prologue import BlockInputs


@triton.jit
def _next_block_inputs_kernel(
    ids_ptr, target_ptr, pos_ptr, slot_ptr, num_drafts_ptr, tables_ptr, stride_t,
    out_ids_ptr, out_pos_ptr, out_slots_ptr, out_lens_ptr, out_bonus_ptr, ctx_pos_ptr, ctx_slots_ptr,
    MASK_ID, Q: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr, HAS_NUM_DRAFTS: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    in_q = j < Q
    draft = j < Q - 1
    row = i * Q + j
    # Every load before any store: a verify step adopted from a pre-launch took its positions and slots from the
    # block's static buffers, which the outputs overwrite (one warp a program, so its loads all come first).
    step_pos = tl.load(pos_ptr + row, mask=in_q, other=0)
    step_slots = tl.load(slot_ptr + row, mask=in_q, other=0)
    following = tl.load(ids_ptr + row + 1, mask=draft, other=0)  # the draft after row j
    target = tl.load(target_ptr + row, mask=in_q, other=0)  # the target's token after row j
    ok = (following == target) & draft
    if HAS_NUM_DRAFTS:
        ok = ok & (j < tl.load(num_drafts_ptr + i))
    accepted = tl.min(tl.where(ok, BLOCK, j), 0)  # the first row whose draft failed (row K has none)
    bonus = tl.sum(tl.where(j == accepted, target, 0), 0)
    first = tl.sum(tl.where(j == 0, step_pos, 0), 0) + accepted + 1
    block_pos = first + j
    page = tl.load(tables_ptr + i * stride_t + block_pos // PAGE, mask=in_q, other=0)
    tl.store(out_ids_ptr + row, tl.where(j == 0, bonus, MASK_ID), mask=in_q)
    tl.store(out_pos_ptr + row, block_pos, mask=in_q)
    tl.store(out_slots_ptr + row, page.to(tl.int64) * PAGE + block_pos % PAGE, mask=in_q)
    tl.store(out_lens_ptr + i, (first + Q).to(tl.int32))
    tl.store(out_bonus_ptr + i, bonus)
    tl.store(ctx_pos_ptr + row, step_pos, mask=in_q)
    tl.store(ctx_slots_ptr + row, step_slots, mask=in_q)


def next_block_inputs_triton(input_ids: torch.Tensor, target_tokens: torch.Tensor, positions: torch.Tensor,
                             slot_mapping: torch.Tensor, num_drafts: torch.Tensor | None, page_tables: torch.Tensor,
                             block_size: int, mask_token_id: int, out: BlockInputs) -> None:
    n = page_tables.shape[0]
    q = input_ids.shape[0] // n
    for t in (input_ids, target_tokens, positions, slot_mapping, *out.tensors()):
        assert t.is_contiguous() and t.dtype in (torch.int64, torch.int32), (t.dtype, t.stride())
    assert page_tables.stride(1) == 1 and page_tables.dtype == torch.int32
    assert out.seq_lens.dtype == torch.int32 and out.bonus.dtype == torch.int64
    _next_block_inputs_kernel[(n,)](
        input_ids, target_tokens, positions, slot_mapping, num_drafts if num_drafts is not None else input_ids,
        page_tables, page_tables.stride(0),
        out.ids, out.positions, out.slots, out.seq_lens, out.bonus, out.ctx_positions,
        out.ctx_slots, mask_token_id, Q=q, BLOCK=triton.next_power_of_2(q), PAGE=block_size,
        HAS_NUM_DRAFTS=num_drafts is not None, num_warps=1,
    )
