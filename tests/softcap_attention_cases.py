"""Soft-capped attention scores (Gemma 2: score -> softcap * tanh(score / softcap) before the softmax).

Each case is one of paged_attention_cases' random problems (prefill chunks over cached prefixes, verify rows,
decodes, with or without a window; split-KV decodes; an 8-bit cache) with a cap small enough to bind on most scores.
The Triton kernel must give what the reference gives.

Run as a script (`python tests/softcap_attention_cases.py STEP SPLIT FP8`: cases of each kind) it checks the kernel
on the default device (the interpreter on CPU) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import torch
from paged_attention_cases import CASE_KINDS, kinds_main, run_case


def softcap_case(kind: str, seed: int, device: str, dtype: torch.dtype) -> dict:
    return {**CASE_KINDS[kind](seed, device, dtype), "softcap": [0.5, 1.5, 4.0][seed % 3]}


def check_softcap(counts: dict[str, int], device: str, dtype: torch.dtype) -> list[str]:
    """Failures over counts[kind] cases of each kind (step, split, fp8)."""
    failures = []
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for kind, n in counts.items():
        for seed in range(n):
            got, ref = run_case(softcap_case(kind, seed, device, dtype))
            err = (got - ref).abs().max().item()
            if not err <= tol:
                failures.append(f"{kind} seed {seed}: off by {err:.3g}")
    return failures


if __name__ == "__main__":
    kinds_main(check_softcap, "soft-capped attention")
