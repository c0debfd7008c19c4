"""Sliding-window attention over page tables whose pages below the window went back to the pool.

Each case is one of paged_attention_cases' random problems with a window (unsplit steps of every kind,
split-KV decodes, an 8-bit cache), whose pages that hold only keys below the window of every query row of
their request are swapped for a page of NaN (what a released page may hold by now: another sequence's rows,
anything). The kernel must give what the reference gives over the intact table: it never loads those keys.

Run as a script (`python tests/sliding_window_cases.py STEP SPLIT FP8`: cases of each kind) it checks the Triton
kernel on the default device (the interpreter on CPU) and exits non-zero on a mismatch. (In the interpreter an
8-bit NaN widens to a finite value, so there the fp8 cases check the masking only; on a GPU they check that
no released page is read too.)
"""

from __future__ import annotations

import torch
from paged_attention_cases import CASE_KINDS, kinds_main, run_case


def released(case: dict) -> dict:
    """The case with a NaN page appended to the cache and every page wholly below the window of its request's
    first query row (the window's start for all its rows) pointing there instead."""
    window, page = case["window"], case["kv"].shape[2]
    kv = case["kv"]
    poison = torch.full((2, 1, *kv.shape[2:]), float("nan"), dtype=torch.float32).to(kv.dtype).to(kv.device)
    kv = torch.cat([kv, poison], dim=1)
    null = kv.shape[1] - 1
    tables = case["page_tables"].clone()
    qsl = case["qsl"]
    for b, seq_len in enumerate(case["seq_lens"]):
        first_q = seq_len - (qsl[b + 1] - qsl[b])
        n_released = max(0, first_q - window + 1) // page
        tables[b, :n_released] = null
    return {**case, "kv": kv, "page_tables": tables}


def window_case(kind: str, seed: int, device: str, dtype: torch.dtype) -> dict:
    """A case of paged_attention_cases (`kind`: step, split or fp8) with a window that leaves keys behind it."""
    case = CASE_KINDS[kind](seed, device, dtype)
    case["causal"] = True
    case["window"] = [5, 9, 17][seed % 3]
    return case


def check_released(counts: dict[str, int], device: str, dtype: torch.dtype) -> list[str]:
    """Failures over counts[kind] cases of each kind (step, split, fp8)."""
    failures = []
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for kind, n in counts.items():
        for seed in range(n):
            case = window_case(kind, seed, device, dtype)
            _, ref = run_case(case)  # (the reference over the intact pages)
            got, ref_released = run_case(released(case))
            for name, out in (("kernel", got), ("reference", ref_released)):
                err = (out - ref).abs().max().item()
                if not err <= tol:
                    failures.append(f"{kind} seed {seed}: {name} over released pages off by {err:.3g}")
    return failures


if __name__ == "__main__":
    kinds_main(check_released, "released-page")
