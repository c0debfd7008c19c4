"""A one-shot all-reduce for the small tensors of decode steps under tensor parallelism, optionally fused
with the residual add and RMSNorm that follow it in a decoder layer.

NCCL's all-reduce of one 8 KiB row costs ~8 us inside a CUDA graph on two H200s, twice a layer. Here
each rank writes its row straight into its peers' buffers (torch symmetric memory, over NVLink; no
multicast, which stays off on our machines), raises one flag per row on each of them, and sums the rows
its peers wrote into its own buffer: one kernel, no remote reads, ~4.5 us. With `add_rms_norm` the same
kernel also adds the residual and normalises, so the separate norm launch after the all-reduce goes
too. The kernel and its memory-ordering argument are in peer_all_reduce_triton.py. Memory: 2 * world *
MAX_ROWS * ROW_SLOT elements a rank (8 MiB in bf16 at two ranks).

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
    """One rank's view. `buffer_ptrs` / `flag_ptrs`: the addresses, in this process, of every rank's
    peer-visible buffer (2 * world * max_rows * row_slot elements of `dtype`) and flag array (max_rows * world
    int32, zeroed before first use), this rank's own at index `rank`; `keep` holds what backs them."""

    def __init__(self, rank: int, world: int, buffer_ptrs: list[int], flag_ptrs: list[int], dtype: torch.dtype,
                 device: torch.device, keep: object = None, max_rows: int = MAX_ROWS, row_slot: int = ROW_SLOT):
        assert len(buffer_ptrs) == len(flag_ptrs) == world and 0 <= rank < world
        self.rank, self.world, self.dtype = rank, world, dtype
        self.max_rows, self.row_slot = max_rows, row_slot
        self._keep = keep  # the kernel reaches that memory through the raw addresses below
        self.buffer_ptrs = torch.tensor(buffer_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flag_ptrs, dtype=torch.int64, device=device)
        self.counters = torch.zeros(max_rows, dtype=torch.int32, device=device)

    @staticmethod
    def sizes(world: int, max_rows: int = MAX_ROWS, row_slot: int = ROW_SLOT) -> tuple[int, int]:
        """(buffer elements, flag elements) each rank provides."""
        return 2 * world * max_rows * row_slot, max_rows * world

    @classmethod
    def over_group(cls, group, device: torch.device, dtype: torch.dtype) -> PeerAllReduce:
        """Collective over `group` (every rank calls it): symmetric buffers, mapped on every rank."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        n_buffer, n_flags = cls.sizes(world)
        own_buffer = symm_mem.empty(n_buffer, dtype=dtype, device=device)
        own_flags = symm_mem.empty(n_flags, dtype=torch.int32, device=device)
        own_flags.zero_()
        buffer_handle = symm_mem.rendezvous(own_buffer, group.group_name)
        flag_handle = symm_mem.rendezvous(own_flags, group.group_name)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's flags are zero before any rank signals
        return cls(rank, world, _peer_addresses(own_buffer, buffer_handle, world),
                   _peer_addresses(own_flags, flag_handle, world), dtype, device,
                   keep=(own_buffer, own_flags, buffer_handle, flag_handle))

    def takes(self, x: torch.Tensor) -> bool:
        if x.dtype != self.dtype or x.device != self.counters.device or x.dim() == 0 or x.numel() == 0:
            return False
        width = x.shape[-1]
        return width <= self.row_slot and x.numel() // width <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (a fresh tensor)."""
        from atlas.kernels.peer_all_reduce_triton import launch

        rows = as_rows(x)
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        launch(rows, None, None, out, None, self.buffer_ptrs, self.flag_ptrs, self.counters, 0.0, self.rank,
               self.world, self.max_rows, self.row_slot)
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
        launch(rows, res, weight, out, new_residual, self.buffer_ptrs, self.flag_ptrs, self.counters, eps,
               self.rank, self.world, self.max_rows, self.row_slot)
        return out.view(x.shape), new_residual.view(x.shape)


def _peer_addresses(own: torch.Tensor, handle, world: int) -> list[int]:
    """Every rank's copy of `own`, as addresses in this process: the same offset into each rank's mapped
    symmetric allocation."""
    offset = own.data_ptr() - handle.buffer_ptrs[handle.rank]
    return [handle.buffer_ptrs[r] + offset for r in range(world)]
