"""Attention output quantized by the attention kernel for a block-FP8 o_proj (the fp8_attention_quant knob).

Each case is one of paged_attention_cases' random problems (prefill chunks over cached prefixes, verify rows, decodes,
with or without a window; split-KV decodes; an 8-bit cache) with heads of 128 (one 1 x 128 group a head). The kernel's
FP8 rows and scales must be, byte for byte, what quantize_groups_triton writes for the output the kernel stores
unquantized, padding rows included.

Run as a script (`python tests/attention_quant_cases.py STEP SPLIT FP8`: cases of each kind) it checks the kernel on
the default device (the interpreter on CPU) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import torch
from paged_attention_cases import CASE_KINDS, kinds_main


def wide_heads_case(kind: str, seed: int, device: str, dtype: torch.dtype) -> dict:
    """CASE_KINDS[kind]'s problem with its queries and cache redrawn at head_dim 128."""
    case = CASE_KINDS[kind](seed, "cpu", dtype)
    g = torch.Generator().manual_seed(9000 + seed)
    q, kv = case["q"], case["kv"]
    q = (torch.randn(*q.shape[:2], 128, generator=g) * 2).to(dtype)
    kv_wide = torch.randn(*kv.shape[:4], 128, generator=g)
    kv = (kv_wide * 2).to(kv.dtype) if kv.dtype.itemsize == 1 else kv_wide.to(dtype)
    return {**case, "q": q.to(device), "kv": kv.to(device), "page_tables": case["page_tables"].to(device),
            "scale": 128 ** -0.5}


def quantized_pair(case: dict):
    """(the kernel's quantized rows, quantize_groups_triton of its stored output): two (q8 as bytes, s8) pairs."""
    from atlas.kernels.fp8_linear import BLOCKWISE_ROWS_ALIGN
    from atlas.kernels.fp8_linear_triton import quantize_groups_triton
    from atlas.kernels.fused_ops_triton import quantized_rows_buffers
    from atlas.kernels.paged_attention import block_shape, program_map
    from atlas.kernels.paged_attention_triton import paged_attention_triton

    q, kv = case["q"], case["kv"]
    max_q = max(b - a for a, b in zip(case["qsl"], case["qsl"][1:], strict=False))
    block_q, block_m = block_shape(q.shape[1], kv.shape[3], max_q)
    programs = program_map(case["qsl"], block_q, q.device)
    dev = q.device

    def attend(quant_out=None):
        return paged_attention_triton(
            q, kv, torch.tensor(case["qsl"], dtype=torch.int32, device=dev),
            torch.tensor(case["seq_lens"], dtype=torch.int32, device=dev), case["page_tables"], programs.req,
            programs.q0, block_q, block_m, case["scale"], case["causal"], case["window"],
            num_splits=case.get("num_splits", 1), quant_out=quant_out)

    T, H = q.shape[0], q.shape[1] * 128
    buffers = quantized_rows_buffers(T, H, 128, BLOCKWISE_ROWS_ALIGN, dev)
    buffers[0].view(torch.uint8).fill_(0x7F)  # (NaN bytes and scales: every byte must be written)
    buffers[1].fill_(float("nan"))
    fused = attend(buffers)
    stored = attend()
    unfused = quantize_groups_triton(stored.reshape(T, H), 128, pad_rows_to=BLOCKWISE_ROWS_ALIGN, m_major=True)
    return [(a.view(torch.uint8).cpu(), b.cpu()) for a, b in (fused, unfused)]


def check_quant(counts: dict[str, int], device: str, dtype: torch.dtype) -> list[str]:
    """Failures over counts[kind] cases of each kind (step, split, fp8)."""
    failures = []
    for kind, n in counts.items():
        for seed in range(n):
            (q_got, s_got), (q_ref, s_ref) = quantized_pair(wide_heads_case(kind, seed, device, dtype))
            if q_got.shape != q_ref.shape or not torch.equal(q_got, q_ref):
                bad = (q_got != q_ref).sum().item() if q_got.shape == q_ref.shape else "shape"
                failures.append(f"{kind} seed {seed}: {bad} FP8 bytes differ")
            elif not torch.equal(s_got, s_ref):
                failures.append(f"{kind} seed {seed}: {(s_got != s_ref).sum().item()} scales differ")
    return failures


def main() -> None:
    """kinds_main's checks; on the CPU also in bf16 (the kernel's rounding to the model dtype before it quantizes),
    where the interpreter can be made to round bf16 as the GPU does."""
    import sys

    if not torch.cuda.is_available():
        from fused_ops_cases import interpreter_rounds_bf16

        if interpreter_rounds_bf16():
            counts = dict(zip(CASE_KINDS, [int(a) for a in sys.argv[1:4]] or [6, 6, 6], strict=False))
            problems = check_quant(counts, "cpu", torch.bfloat16)
            print("\n".join(problems) or f"{sum(counts.values())} quantized-output attention cases agree "
                  "(cpu, torch.bfloat16)")
            if problems:
                sys.exit(1)
    kinds_main(check_quant, "quantized-output attention")


if __name__ == "__main__":
    main()
