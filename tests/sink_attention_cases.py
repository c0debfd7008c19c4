"""Paged attention with attention sinks (gpt-oss): the Triton kernel against the PyTorch reference.

Each case is one of paged_attention_cases' random problems (prefill chunks over cached prefixes, verify-sized rows
and decodes in one step; split-KV decodes; windows and GQA groups vary) with a random sink logit per query head,
some of them large enough to take most of a row's weight. The split-KV cases check that the combine kernel adds
the sink once, not once per split.

Run as a script (`python tests/sink_attention_cases.py STEP SPLIT`: cases of each kind) it checks the kernel on the
default device (Triton's interpreter on CPU) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch
from paged_attention_cases import check_counts_back_to_zero, fused_counts, random_case, split_case


def with_sinks(case: dict, seed: int) -> dict:
    """The case with sinks [Hq]: N(0, 2) logits, one head's at +6 (it dominates short rows) and one at -30 (it
    weighs nothing)."""
    g = torch.Generator().manual_seed(9000 + seed)
    heads = case["q"].shape[1]
    sinks = 2 * torch.randn(heads, generator=g)
    sinks[0] = 6.0
    if heads > 1:
        sinks[-1] = -30.0
    return {**case, "sinks": sinks.to(case["q"].dtype).to(case["q"].device)}


def sink_case(kind: str, seed: int, device: str, dtype: torch.dtype) -> dict:
    return with_sinks((random_case if kind == "step" else split_case)(seed, device, dtype), seed)


def run_sink_case(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the Triton kernel's output, the reference's in float32) for a case with sinks."""
    from atlas.kernels.paged_attention import block_shape, program_map
    from atlas.kernels.paged_attention_ref import paged_attention_ref
    from atlas.kernels.paged_attention_triton import paged_attention_triton

    q, kv, sinks = case["q"], case["kv"], case["sinks"]
    ref = paged_attention_ref(q.float(), kv.float(), case["qsl"], case["seq_lens"], case["page_tables"],
                              case["scale"], case["causal"], case["window"], sinks.float())
    max_q = max(b - a for a, b in zip(case["qsl"], case["qsl"][1:], strict=False))
    block_q, block_m = block_shape(q.shape[1], kv.shape[3], max_q)
    programs = program_map(case["qsl"], block_q, q.device)
    prog_req, prog_q0 = programs.req, programs.q0
    dev = q.device
    counts = fused_counts(case, prog_req, kv)
    got = paged_attention_triton(
        q, kv, torch.tensor(case["qsl"], dtype=torch.int32, device=dev),
        torch.tensor(case["seq_lens"], dtype=torch.int32, device=dev), case["page_tables"], prog_req, prog_q0,
        block_q, block_m, case["scale"], case["causal"], case["window"], num_splits=case.get("num_splits", 1),
        sinks=sinks, counts=counts)
    check_counts_back_to_zero(counts)
    return got.float(), ref


def check(counts: dict[str, int], device: str, dtype: torch.dtype) -> list[str]:
    failures = []
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for kind, n in counts.items():
        for seed in range(n):
            got, ref = run_sink_case(sink_case(kind, seed, device, dtype))
            err = (got - ref).abs().max().item()
            if not err <= tol:
                failures.append(f"{kind} seed {seed}: max abs error {err:.3g} > {tol}")
    return failures


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    counts = dict(zip(["step", "split"], [int(a) for a in sys.argv[1:3]] or [12, 12], strict=False))
    problems = check(counts, device, dtype)
    print("\n".join(problems) or f"{sum(counts.values())} sink cases agree ({device}, {dtype})")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
