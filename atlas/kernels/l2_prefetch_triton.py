"""Asking the L2 cache to fetch a weight before the kernel that reads it: sm_90's bulk prefetch
(`cp.async.bulk.prefetch.L2.global`, TMA; asynchronous, no register or shared memory holds the bytes), issued by the
programs of a kernel that leaves the memory bus idle (gpt-oss's one-token MXFP4 expert kernels are bound by their
instruction issue, not their bytes) for the next layer's first weight. Only a hint: no value changes.

Each program asks for its own part, from one thread: a few programs asking for many megabytes each (session 86's
form: 32 chunks of 512 KB a program, every warp repeating them) made gpt-oss's down kernel 16x slower on an H100.
This form still costs that kernel more (6 us a layer) than the next GEMV gains (1.5 us): the moe_l2_prefetch knob is
off (BENCHMARKS.md 7.3)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The most one prefetch instruction takes: a size of up to 2^16 - 1 units of 16 bytes (sm_90 SASS: UBLKPF.L2)
_MAX_PART = (2**16 - 1) * 16
# The most a kernel asks for: part of the L2 (50 MB on H100 and H200), the rest left to what streams through it
L2_PREFETCH_MAX_BYTES = 32 * 1024 * 1024


@triton.jit
def l2_prefetch_part(base_ptr, part, n_parts, part_bytes, last_bytes):
    """Part `part` of the bytes at base_ptr (n_parts parts of part_bytes bytes, the last last_bytes; both multiples of
    16, base 16-byte aligned) asked of the L2 by the program's thread 0; parts past n_parts ask nothing. Returns 0
    (a [1] int32 the caller keeps alive). CUDA sm_90 only (inline PTX)."""
    i = part + tl.zeros([1], dtype=tl.int32)
    ok = i < n_parts
    addr = base_ptr.to(tl.pointer_type(tl.uint8)) + tl.where(ok, i, 0).to(tl.int64) * part_bytes
    size = tl.where(i == n_parts - 1, last_bytes, part_bytes)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 r; mov.u32 r, %tid.x; setp.ne.u32 p, $3, 0; setp.eq.and.u32 p, r, 0, p; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_args(weight: torch.Tensor | None, programs: int, placeholder: torch.Tensor) -> dict:
    """The launch arguments with which `programs` programs of a kernel ask the L2 for `weight` (its first
    L2_PREFETCH_MAX_BYTES), a part each: the pointer, the parts, a part's and the last part's bytes, and PREFETCH
    (False: nothing to prefetch, or no CUDA sm_90+ device; the pointer then `placeholder`, never read)."""
    none = {"pf_ptr": placeholder, "pf_parts": 0, "pf_part": 0, "pf_last": 0, "PREFETCH": False}
    if weight is None or not weight.is_cuda or torch.cuda.get_device_capability(weight.device) < (9, 0):
        return none
    nbytes = min(weight.numel() * weight.element_size(), L2_PREFETCH_MAX_BYTES, programs * _MAX_PART) // 16 * 16
    if nbytes == 0 or programs == 0 or weight.data_ptr() % 16 or not weight.is_contiguous():
        return none
    part = triton.cdiv(triton.cdiv(nbytes, programs), 16) * 16
    parts = triton.cdiv(nbytes, part)
    return {"pf_ptr": weight, "pf_parts": parts, "pf_part": part, "pf_last": nbytes - (parts - 1) * part,
            "PREFETCH": True}
