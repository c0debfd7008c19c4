"""Random absorbed-MLA attention problems over a paged latent cache, shared by the Triton kernel tests
(interpreter on CPU, real on CUDA).

Run as a script (`python tests/mla_attention_cases.py [N] [N_FP8]`) it checks the Triton kernel against the
PyTorch reference on the default device (N cases, then N_FP8 over an 8-bit latent cache) and exits non-zero
on a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def random_case(seed: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    heads = [1, 3, 4, 16, 20][seed % 5]
    latent, rope = [(16, 8), (32, 8), (64, 16), (512, 64)][seed % 4] if seed % 7 else (512, 64)
    page = [8, 16][seed % 2]
    num_reqs = randint(1, 5)
    # Split-KV in a case of three, as the engine uses it: decode steps only (one query row a request), the
    # contexts longer so that every split has keys.
    splits = [1, 2, 8][seed % 3]
    q_lens, seq_lens = [], []
    for _ in range(num_reqs):
        kind = 0 if splits > 1 else randint(0, 3)
        q_len = 1 if kind == 0 else (randint(2, 9) if kind == 1 else randint(10, 70))
        ctx = randint(0, 300 if splits > 1 else 60)
        q_lens.append(q_len)
        seq_lens.append(ctx + q_len)
    pages_per = [-(-s // page) for s in seq_lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()  # scattered pages
    page_tables = torch.zeros(num_reqs, max(pages_per), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages_per):
        page_tables[i, :n] = torch.tensor(perm[used: used + n], dtype=torch.int32)
        used += n
    cache = torch.randn(num_pages, page, latent + rope, generator=g).to(dtype)
    T = sum(q_lens)
    q_latent = (torch.randn(T, heads, latent, generator=g) / latent ** 0.25).to(dtype)
    q_pe = torch.randn(T, heads, rope, generator=g).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return dict(q_latent=q_latent.to(device), q_pe=q_pe.to(device), cache=cache.to(device), qsl=qsl, seq_lens=seq_lens,
                page_tables=page_tables.to(device), scale=(latent // 4 + rope) ** -0.5, splits=splits)


def fp8_case(seed: int, device: str, dtype: torch.dtype):
    """random_case over an 8-bit latent cache (--kv-cache-dtype fp8): the rows doubled (a spread of e4m3
    exponents) and rounded to float8 e4m3; decode, verify and prefill steps, split and unsplit. The kernel
    widens the tiles it reads; the reference attends over the same values widened exactly."""
    case = random_case(seed, "cpu", dtype)
    cache = (case["cache"].float() * 2).to(torch.float8_e4m3fn)
    return {**case, "q_latent": case["q_latent"].to(device), "q_pe": case["q_pe"].to(device),
            "cache": cache.to(device), "page_tables": case["page_tables"].to(device)}


def run_case(case) -> tuple[torch.Tensor, torch.Tensor]:
    from atlas.kernels.mla_attention_ref import mla_attention_ref
    from atlas.kernels.mla_attention_triton import mla_attention_triton
    from atlas.kernels.paged_attention import block_shape, program_map

    ql, qp, cache = case["q_latent"], case["q_pe"], case["cache"]
    ref = mla_attention_ref(ql.float(), qp.float(), cache.float(), case["qsl"], case["seq_lens"], case["page_tables"],
                            case["scale"])
    max_q = max(b - a for a, b in zip(case["qsl"], case["qsl"][1:], strict=False))
    block_q, _ = block_shape(ql.shape[1], 1, max_q)
    programs = program_map(case["qsl"], block_q, ql.device)
    prog_req, prog_q0 = programs.req, programs.q0
    dev = ql.device
    got = mla_attention_triton(ql, qp, cache, torch.tensor(case["qsl"], dtype=torch.int32, device=dev),
                               torch.tensor(case["seq_lens"], dtype=torch.int32, device=dev), case["page_tables"],
                               prog_req, prog_q0, block_q, case["scale"], num_splits=case["splits"])
    return got.float(), ref


def main() -> None:
    """argv[1] cases, then argv[2] cases over an 8-bit cache, on the default device (CUDA in bf16, else CPU in
    fp32: the interpreter's bf16 products are not the GPU's, 8-bit cache or not); exit 1 on a mismatch."""
    from paged_attention_cases import check

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    problems = check(device, dtype, range(n), random_case, run_case)
    print("\n".join(problems) or f"{n} cases agree ({device}, {dtype})")
    if len(sys.argv) > 2:
        n_fp8 = int(sys.argv[2])
        fp8_problems = check(device, dtype, range(n_fp8), fp8_case, run_case)
        print("\n".join(f"fp8 cache {p}" for p in fp8_problems) or f"{n_fp8} fp8-cache cases agree ({dtype})")
        problems += fp8_problems
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
