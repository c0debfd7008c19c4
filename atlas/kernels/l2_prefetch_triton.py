"""Asking the L2 cache to fetch a weight before the kernel that reads it: sm_90's bulk prefetch
(`cp.async.bulk.prefetch.L2.global`, TMA; asynchronous, no register or shared memory holds the bytes), issued by a few
programs of a kernel that leaves the memory bus idle (gpt-oss's one-token MXFP4 expert kernels are bound by their
instruction issue, not their bytes) for the next layer's first weight. Only a hint: no value changes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes of one prefetch: the instruction takes a size of up to 2^16 - 1 units of 16 bytes (sm_90 SASS: UBLKPF.L2)
_CHUNK = 512 * 1024
L2_PREFETCH_CHUNK = tl.constexpr(_CHUNK)
# Chunks a prefetching program issues (one a lane, each warp's lanes in turn)
_BLOCK = 32
L2_PREFETCH_BLOCK = tl.constexpr(_BLOCK)
# The most a kernel asks for: part of the L2 (50 MB on H100 and H200), the rest left to what streams through it
L2_PREFETCH_MAX_BYTES = 32 * 1024 * 1024


@triton.jit
def l2_prefetch_chunks(base_ptr, program, n_chunks, last_bytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program `program`'s chunks of the bytes at base_ptr (n_chunks chunks of CHUNK bytes, the last last_bytes; both
    multiples of 16, base 16-byte aligned) asked of the L2. CUDA sm_90 only (inline PTX)."""
    i = program * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_chunks
    addr = base_ptr.to(tl.pointer_type(tl.uint8)) + tl.where(ok, i, 0).to(tl.int64) * CHUNK
    size = tl.where(i == n_chunks - 1, last_bytes, CHUNK)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_args(weight: torch.Tensor | None, placeholder: torch.Tensor) -> dict:
    """The launch arguments of a kernel's prefetching programs for `weight` (its first L2_PREFETCH_MAX_BYTES): the
    pointer, chunks and last chunk's bytes, and PF_PROGRAMS (0: nothing to prefetch, or no CUDA sm_90+ device; the
    pointer then `placeholder`, never read)."""
    none = {"pf_ptr": placeholder, "pf_chunks": 0, "pf_last": 0, "PF_PROGRAMS": 0}
    if weight is None or not weight.is_cuda or torch.cuda.get_device_capability(weight.device) < (9, 0):
        return none
    nbytes = min(weight.numel() * weight.element_size(), L2_PREFETCH_MAX_BYTES) // 16 * 16
    if nbytes == 0 or weight.data_ptr() % 16 or not weight.is_contiguous():
        return none
    chunks = triton.cdiv(nbytes, _CHUNK)
    return {"pf_ptr": weight, "pf_chunks": chunks, "pf_last": nbytes - (chunks - 1) * _CHUNK,
            "PF_PROGRAMS": triton.cdiv(chunks, _BLOCK)}
