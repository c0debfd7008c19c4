"""A one-shot all-reduce for the small tensors of decode steps under tensor parallelism, optionally fused
with the residual add and RMSNorm that follow it in a decoder layer.

NCCL's all-reduce of one 8 KiB row costs ~8 us inside a CUDA graph on two H200s, twice a layer. Here
each rank writes its row straight into its peers' buffers (torch symmetric memory, over NVLink; no
multicast, which stays off on our machines) and sums the rows its peers wrote into its own buffer, polling
them until no element holds the EMPTY mark (no flags, no fences): one kernel, no remote reads. With
`add_rms_norm` the same kernel also adds the residual and normalises, so the separate norm launch after
the all-reduce goes too. A GEMV whose output goes straight to this all-reduce may send its rows to the
peers itself, in its epilogue (`push_args`), so the data is on its way before the all-reduce starts.
The kernel and its memory-ordering argument are in peer_all_reduce_triton.py.
Memory: 2 * world * MAX_ROWS * ROW_SLOT elements a rank (8 MiB in bf16 at two ranks), every element
EMPTY before first use (`mark_empty`).

Every rank sums in rank order and rounds once, so the ranks agree bit for bit; against NCCL the sums
agree too for two ranks (one float32 add, one rounding). Tensors of more rows than `max_rows` (prefill
chunks) or wider rows than `row_slot`, or of another dtype, go to NCCL: `takes(x)` says which.
"""

from __future__ import annotations

import torch

from atlas.kernels.fused_ops import as_rows

MAX_ROWS = 64
ROW_SLOT = 16384  # elements of one row's slot: hidden sizes up to 16,384


class PeerAllReduce:
    """One rank's view. `buffer_ptrs`: the addresses, in this process, of every rank's peer-visible buffer
    (`size(world, ...)` elements of `dtype`, each marked EMPTY before any rank's first use), this rank's own at
    index `rank`; `own_buffer` is that one as a tensor; `keep` holds what backs the others."""

    def __init__(self, rank: int, world: int, buffer_ptrs: list[int], own_buffer: torch.Tensor,
                 dtype: torch.dtype, device: torch.device, keep: object = None, max_rows: int = MAX_ROWS,
                 row_slot: int = ROW_SLOT):
        assert len(buffer_ptrs) == world and 0 <= rank < world and buffer_ptrs[rank] == own_buffer.data_ptr()
        assert own_buffer.dtype == dtype and own_buffer.numel() >= self.size(world, max_rows, row_slot)
        self.rank, self.world, self.dtype = rank, world, dtype
        self.max_rows, self.row_slot = max_rows, row_slot
        self._keep = keep  # the kernel reaches that memory through the raw addresses below
        self.buffer_ptrs = torch.tensor(buffer_ptrs, dtype=torch.int64, device=device)
        self.own_bits = _as_bits(own_buffer)
        self.counters = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._pushed: tuple[int, int] | None = None  # (address, elements) of rows a kernel has sent (push_args)

    @staticmethod
    def size(world: int, max_rows: int = MAX_ROWS, row_slot: int = ROW_SLOT) -> int:
        """Buffer elements each rank provides."""
        return 2 * world * max_rows * row_slot

    @staticmethod
    def mark_empty(buffer: torch.Tensor) -> None:
        """Fill a rank's buffer with the EMPTY mark (peer_all_reduce_triton.py), before any rank's first use."""
        from atlas.kernels.peer_all_reduce_triton import empty_bits

        bits = _as_bits(buffer)
        bits.fill_(empty_bits(bits.element_size()))

    @classmethod
    def over_group(cls, group, device: torch.device, dtype: torch.dtype) -> PeerAllReduce:
        """Collective over `group` (every rank calls it): symmetric buffers, mapped on every rank."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        own_buffer = symm_mem.empty(cls.size(world), dtype=dtype, device=device)
        cls.mark_empty(own_buffer)
        handle = symm_mem.rendezvous(own_buffer, group.group_name)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's buffer is EMPTY before any rank writes into it
        return cls(rank, world, _peer_addresses(own_buffer, handle, world), own_buffer, dtype, device,
                   keep=(own_buffer, handle))

    def takes(self, x: torch.Tensor) -> bool:
        if x.dtype != self.dtype or x.device != self.counters.device or x.dim() == 0 or x.numel() == 0:
            return False
        width = x.shape[-1]
        return width <= self.row_slot and x.numel() // width <= self.max_rows

    def push_args(self, y: torch.Tensor) -> dict:
        """For a kernel about to compute y [rows, width] (taken by this all-reduce, which must be the next one
        to run, on y itself): the arguments of peer_all_reduce_triton.push_tile, by which it sends y to the
        peers as it computes it. The all-reduce of y then skips that step. Every rank must do the same."""
        assert self.takes(y) and y.is_contiguous(), "push only rows this all-reduce takes"
        assert self._pushed is None, "a pushed tensor was never all-reduced"
        self._pushed = (y.data_ptr(), y.numel())
        return {"pointers": (self.buffer_ptrs, self.own_bits, self.counters),
                "constexprs": dict(PUSH=True, RANK=self.rank, WORLD=self.world, EMPTY=self._empty(),
                                   ROW_SLOT=self.row_slot, SOURCE_STRIDE=self.max_rows * self.row_slot,
                                   PARITY_STRIDE=self.world * self.max_rows * self.row_slot)}

    def _was_pushed(self, rows: torch.Tensor) -> bool:
        pushed, self._pushed = self._pushed, None
        if pushed is None:
            return False
        # (the peers' slots hold rows for the next epoch: any other all-reduce now would read them as its own)
        assert pushed == (rows.data_ptr(), rows.numel()), "a pushed tensor must be the next one all-reduced"
        return True

    def _empty(self) -> int:
        from atlas.kernels.peer_all_reduce_triton import empty_bits

        return empty_bits(self.own_bits.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (a fresh tensor)."""
        from atlas.kernels.peer_all_reduce_triton import launch

        rows = as_rows(x)
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        launch(rows, None, None, out, None, self.buffer_ptrs, self.own_bits, self.counters, 0.0, self.rank,
               self.world, self.max_rows, self.row_slot, pushed=self._was_pushed(rows))
        return out.view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(sum(x) + residual), sum(x) + residual) in one launch; None where the kernel does not
        take these tensors (the caller all-reduces and normalises separately)."""
        if not (self.takes(x) and residual.shape == x.shape and residual.dtype == x.dtype
                and weight.shape == (x.shape[-1],) and weight.is_contiguous()):
            return None
        from atlas.kernels.peer_all_reduce_triton import launch

        rows, res = as_rows(x), as_rows(residual)
        out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        new_residual = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        launch(rows, res, weight, out, new_residual, self.buffer_ptrs, self.own_bits, self.counters, eps,
               self.rank, self.world, self.max_rows, self.row_slot, pushed=self._was_pushed(rows))
        return out.view(x.shape), new_residual.view(x.shape)


def _as_bits(buffer: torch.Tensor) -> torch.Tensor:
    """The buffer viewed as the signed integer type of its element's width (the kernel compares bits)."""
    return buffer.view({2: torch.int16, 4: torch.int32}[buffer.element_size()])


def _peer_addresses(own: torch.Tensor, handle, world: int) -> list[int]:
    """Every rank's copy of `own`, as addresses in this process: the same offset into each rank's mapped
    symmetric allocation."""
    offset = own.data_ptr() - handle.buffer_ptrs[handle.rank]
    return [handle.buffer_ptrs[r] + offset for r in range(world)]
