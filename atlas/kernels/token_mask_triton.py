"""Grammar bitmasks applied to float32 logits in place, in one Triton kernel (imported lazily, only on CUDA
and in the tests). The PyTorch reference is `apply_token_bitmask`'s own path in runtime/sampler.py.

One program per constrained row walks the row's vocabulary in blocks: it reads each token's bit from
the bitmask word (bit t % 32 of word t // 32; words past the bitmask's width allow nothing), writes -inf
over the masked logits and remembers whether any allowed logit is left other than -inf. If none is (the
grammar allows only tokens already banned), a second walk over the same row gives the allowed tokens 0
and the rest -inf. Keeping the whole row in one program settles that fallback inside the program: no
second launch, no flags in memory and no host sync. The fallback walk is rare, and the first walk reads
and writes each logit once, so the kernel is bound by the row's bytes; with the tens of constrained rows
of a busy step there are enough programs to spread across the GPU; a lone row runs on one SM, which
still has only its few hundred KB to read (unmeasured on a GPU so far: `atlas bench structured`).

Nothing that changes from step to step specialises the kernel: the row count is the grid only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # logits per iteration of a row's walk
NUM_WARPS = 8


@triton.jit
def _allowed(row_words, t, in_vocab, n_words):
    """Whether the bitmask row allows tokens t (bit t % 32 of word t // 32; words past n_words allow none)."""
    word_idx = t // 32
    words = tl.load(row_words + word_idx, mask=in_vocab & (word_idx < n_words), other=0)
    return ((words >> (t % 32)) & 1) != 0


@triton.jit
def _token_mask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, n_words, logits_stride, bitmask_stride,
                       HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r).to(tl.int64)
    else:
        row = r.to(tl.int64)
    row_logits = logits_ptr + row * logits_stride
    row_words = bitmask_ptr + r.to(tl.int64) * bitmask_stride
    offs = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    # any allowed logit that is not -inf (NaN and +inf count, as amax sees them)
    alive = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        t = start + offs
        in_vocab = t < vocab
        allowed = _allowed(row_words, t, in_vocab, n_words)
        x = tl.load(row_logits + t, mask=in_vocab, other=neg_inf)
        alive = alive | (allowed & (x != neg_inf)).to(tl.int32)
        # only masked logits are written: allowed ones keep their value
        tl.store(row_logits + t, tl.full([BLOCK], neg_inf, tl.float32), mask=in_vocab & ~allowed)
    if tl.max(alive, axis=0) == 0:
        for start in range(0, vocab, BLOCK):
            t = start + offs
            in_vocab = t < vocab
            allowed = _allowed(row_words, t, in_vocab, n_words)
            tl.store(row_logits + t, tl.where(allowed, 0.0, neg_inf), mask=in_vocab)


def apply_token_bitmask_triton_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
                                ) -> torch.Tensor:
    """In place: logits [N, V] float32 (unit stride along V), bitmask [R, words] int32 (unit stride along
    words), rows [R] of logits row indices (None: R == N, in order). Returns logits."""
    assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2
    if bitmask.shape[1] and bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    num_rows = bitmask.shape[0]
    if rows is None:
        assert num_rows == logits.shape[0], "a bitmask row per logits row when rows is None"
    else:
        assert rows.shape == (num_rows,)
    if num_rows == 0 or logits.shape[1] == 0:
        return logits
    _token_mask_kernel[(num_rows,)](
        logits, bitmask, rows if rows is not None else bitmask, logits.shape[1], bitmask.shape[1],
        logits.stride(0), bitmask.stride(0), HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return logits
