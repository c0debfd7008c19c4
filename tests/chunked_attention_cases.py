"""Chunked attention (Llama 4's local layers: a query at position p sees the keys at positions p // C * C .. p).

Each case is one of paged_attention_cases' random problems (prefill chunks over cached prefixes, verify rows,
decodes; split-KV decodes; an 8-bit cache) with a chunk size C small enough that requests cross chunk boundaries,
some inside a step's query rows, and the pages wholly below the chunk of each request's first query row swapped for
a page of NaN (what a released page may hold by now). The Triton kernel, and the reference over those pages, must
give what the reference gives over the intact table: neither loads them.

Run as a script (`python tests/chunked_attention_cases.py STEP SPLIT FP8`: cases of each kind) it checks the kernel
on the default device (the interpreter on CPU) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import torch
from paged_attention_cases import CASE_KINDS, kinds_main, run_case


def chunk_case(kind: str, seed: int, device: str, dtype: torch.dtype) -> dict:
    case = CASE_KINDS[kind](seed, device, dtype)
    return {**case, "causal": True, "window": None, "chunk": [4, 7, 16][seed % 3]}


def released(case: dict) -> dict:
    """The case with a NaN page appended and every page wholly below its request's first query row's chunk pointing
    there."""
    chunk, page, kv = case["chunk"], case["kv"].shape[2], case["kv"]
    poison = torch.full((2, 1, *kv.shape[2:]), float("nan"), dtype=torch.float32).to(kv.dtype).to(kv.device)
    kv = torch.cat([kv, poison], dim=1)
    tables, qsl = case["page_tables"].clone(), case["qsl"]
    for b, seq_len in enumerate(case["seq_lens"]):
        first_q = seq_len - (qsl[b + 1] - qsl[b])
        tables[b, :(first_q // chunk * chunk) // page] = kv.shape[1] - 1
    return {**case, "kv": kv, "page_tables": tables}


def check_chunks(counts: dict[str, int], device: str, dtype: torch.dtype) -> list[str]:
    """Failures over counts[kind] cases of each kind (step, split, fp8)."""
    failures = []
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for kind, n in counts.items():
        for seed in range(n):
            case = chunk_case(kind, seed, device, dtype)
            got, ref = run_case(case)
            got_released, ref_released = run_case(released(case))
            for name, out in (("kernel", got), ("kernel over released pages", got_released),
                              ("reference over released pages", ref_released)):
                err = (out - ref).abs().max().item()
                if not err <= tol:
                    failures.append(f"{kind} seed {seed}: {name} off by {err:.3g}")
    return failures


if __name__ == "__main__":
    kinds_main(check_chunks, "chunked-attention")
