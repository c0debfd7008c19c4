"""Soft-capped attention scores (Gemma 2: score -> softcap * tanh(score / softcap) before the softmax).

Each case is one of paged_attention_cases' random problems (prefill chunks over cached prefixes, verify rows,
decodes, with or without a window; split-KV decodes; an 8-bit cache) with a cap small enough to bind on most scores.
The Triton kernel must give what the reference gives.

Run as a script (`python tests/softcap_attention_cases.py STEP SPLIT FP8`: cases of each kind) it checks the kernel
on the default device (the interpreter on CPU) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch
from paged_attention_cases import fp8_case, random_case, split_case


def softcap_case(kind: str, seed: int, device: str, dtype: torch.dtype) -> dict:
    make = {"step": random_case, "split": split_case, "fp8": fp8_case}[kind]
    return {**make(seed, device, dtype), "softcap": [0.5, 1.5, 4.0][seed % 3]}


def run_softcap_case(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from atlas.kernels.paged_attention import block_shape, program_map
    from atlas.kernels.paged_attention_ref import paged_attention_ref
    from atlas.kernels.paged_attention_triton import paged_attention_triton

    q, kv, dev = case["q"], case["kv"], case["q"].device
    ref = paged_attention_ref(q.float(), kv, case["qsl"], case["seq_lens"], case["page_tables"], case["scale"],
                              case["causal"], case["window"], softcap=case["softcap"])
    max_q = max(b - a for a, b in zip(case["qsl"], case["qsl"][1:], strict=False))
    block_q, block_m = block_shape(q.shape[1], kv.shape[3], max_q)
    programs = program_map(case["qsl"], block_q, dev)
    got = paged_attention_triton(
        q, kv, torch.tensor(case["qsl"], dtype=torch.int32, device=dev),
        torch.tensor(case["seq_lens"], dtype=torch.int32, device=dev), case["page_tables"], programs.req,
        programs.q0, block_q, block_m, case["scale"], case["causal"], case["window"],
        num_splits=case.get("num_splits", 1), softcap=case["softcap"])
    return got.float(), ref


def check_softcap(counts: dict[str, int], device: str, dtype: torch.dtype) -> list[str]:
    """Failures over counts[kind] cases of each kind (step, split, fp8)."""
    failures = []
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for kind, n in counts.items():
        for seed in range(n):
            got, ref = run_softcap_case(softcap_case(kind, seed, device, dtype))
            err = (got - ref).abs().max().item()
            if not err <= tol:
                failures.append(f"{kind} seed {seed}: off by {err:.3g}")
    return failures


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    counts = dict(zip(["step", "split", "fp8"], [int(a) for a in sys.argv[1:4]] or [6, 6, 6], strict=False))
    problems = check_softcap(counts, device, dtype)
    print("\n".join(problems) or f"{sum(counts.values())} soft-capped attention cases agree ({device}, {dtype})")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
