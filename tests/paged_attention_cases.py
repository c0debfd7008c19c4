"""Random paged-attention problems, shared by the Triton kernel tests (interpreter on CPU, real on CUDA).

Run as a script (`python tests/paged_attention_cases.py`) it checks the Triton kernel against the
PyTorch reference on the default device and exits non-zero on a mismatch.
"""

from __future__ import annotations

import dataclasses
import sys

import torch


@dataclasses.dataclass
class CapturedDecode:
    """A captured decode step: replay `graph` after rewriting `seq_lens`; `out` holds its output. `inputs` keeps
    the metadata tensors the graph reads alive (freed, their memory would be handed to later allocations and
    the replays would read whatever those wrote)."""

    graph: torch.cuda.CUDAGraph
    out: torch.Tensor
    seq_lens: torch.Tensor
    inputs: tuple


def random_page_tables(seq_lens: list[int], page: int, g: torch.Generator) -> torch.Tensor:
    """Page tables [len(seq_lens), most pages] for sequences of these lengths, the pages a random permutation of
    0 .. total pages - 1 (as a pool hands them out after some traffic)."""
    pages_per = [-(-s // page) for s in seq_lens]
    perm = torch.randperm(sum(pages_per), generator=g)
    tables = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages_per):
        tables[i, :n] = perm[used:used + n]
        used += n
    return tables


def captured_decode_step(attend, batch: int, page_tables: torch.Tensor, page: int, device: str) -> CapturedDecode:
    """A decode step of `batch` one-row requests as StepGraphs captures it: metadata over static buffers
    whose sequence lengths live on the device, the program map preset, attend(meta) warmed up and then
    captured once in a CUDA graph."""
    from atlas.kernels.paged_attention import ProgramMap
    from atlas.layers.attention import AttentionMetadata

    seq_lens = torch.ones(batch, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    slots = torch.zeros(batch, dtype=torch.long, device=device)
    programs = ProgramMap(1, torch.arange(batch, dtype=torch.int32, device=device),
                          torch.zeros(batch, dtype=torch.int32, device=device))

    def step():
        meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, page_tables=page_tables,
                                 slot_mapping=slots, query_start_loc_cpu=list(range(batch + 1)),
                                 seq_lens_cpu=[1] * batch, max_query_len=1, max_seq_len=1, block_size=page,
                                 programs=programs)
        return attend(meta)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)
    return CapturedDecode(graph, out, seq_lens, (qsl, slots, programs, page_tables, stream))


def random_case(seed: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    num_kv_heads = [1, 2, 4][seed % 3]
    group = [1, 2, 3, 4][seed % 4]
    head_dim = [16, 24, 32, 64][seed % 4]
    page = [8, 16][seed % 2]
    num_reqs = randint(1, 6)
    q_lens, seq_lens = [], []
    for _ in range(num_reqs):
        kind = randint(0, 3)
        q_len = 1 if kind == 0 else (randint(2, 9) if kind == 1 else randint(10, 90))
        ctx = randint(0, 70)
        q_lens.append(q_len)
        seq_lens.append(ctx + q_len)
    pages_per = [-(-s // page) for s in seq_lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()  # scattered pages
    tables, used = [], 0
    for n in pages_per:
        tables.append(perm[used: used + n])
        used += n
    width = max(pages_per)
    page_tables = torch.zeros(num_reqs, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        page_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    kv = torch.randn(2, num_pages, page, num_kv_heads, head_dim, generator=g).to(dtype)
    T = sum(q_lens)
    q = torch.randn(T, num_kv_heads * group, head_dim, generator=g).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    causal = seed % 5 != 0
    window = [None, None, 7, 33][seed % 4] if causal else None
    return dict(q=q.to(device), kv=kv.to(device), qsl=qsl, seq_lens=seq_lens, page_tables=page_tables.to(device),
                scale=head_dim ** -0.5, causal=causal, window=window)


def split_case(seed: int, device: str, dtype: torch.dtype):
    """A decode step (one query row per request) for the split-KV path: short sequences leave some of
    the S splits empty, long ones fill them all; windows, GQA groups and page sizes vary."""
    g = torch.Generator().manual_seed(5000 + seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    num_kv_heads = [1, 2, 4][seed % 3]
    group = [1, 4, 3, 8][seed % 4]
    head_dim = [16, 32, 64, 128][seed % 4]
    page = [8, 16, 32][seed % 3]
    num_splits = [2, 4, 8, 32][seed % 4]
    num_reqs = randint(1, 4)
    # The first request fills several splits; the others may be short (empty splits) or length 1.
    seq_lens = [randint(60, 300)] + [[1, randint(2, 40), randint(40, 300)][randint(0, 3)]
                                     for _ in range(num_reqs - 1)]
    pages_per = [-(-s // page) for s in seq_lens]
    num_pages = sum(pages_per) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    page_tables = torch.zeros(num_reqs, max(pages_per) + 1, dtype=torch.int32)  # padded past the end
    used = 0
    for i, n in enumerate(pages_per):
        page_tables[i, :n] = torch.tensor(perm[used: used + n], dtype=torch.int32)
        used += n
    kv = torch.randn(2, num_pages, page, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(num_reqs, num_kv_heads * group, head_dim, generator=g).to(dtype)
    causal = seed % 6 != 5
    window = [None, None, 5, 40, 100][seed % 5] if causal else None
    return dict(q=q.to(device), kv=kv.to(device), qsl=list(range(num_reqs + 1)), seq_lens=seq_lens,
                page_tables=page_tables.to(device), scale=head_dim ** -0.5, causal=causal, window=window,
                num_splits=num_splits)


def fp8_case(seed: int, device: str, dtype: torch.dtype):
    """A case over an 8-bit cache (--kv-cache-dtype fp8): random_case for even seeds, split_case for odd ones,
    split (seed % 4 == 3) or not (seed % 4 == 1: unsplit decode rows over 8 bits take 128-key tiles, which its
    contexts of up to 300 keys cross). The kernel widens the tiles it reads; the reference attends over the
    same values widened exactly."""
    case = (split_case if seed % 4 in (1, 3) else random_case)(seed, "cpu", dtype)
    if seed % 4 == 1:
        case["num_splits"] = 1
    kv = (case["kv"].float() * 2).to(torch.float8_e4m3fn)
    return {**case, "q": case["q"].to(device), "kv": kv.to(device), "page_tables": case["page_tables"].to(device)}


def run_case(case) -> tuple[torch.Tensor, torch.Tensor]:
    from atlas.kernels.paged_attention import block_shape, program_map
    from atlas.kernels.paged_attention_ref import paged_attention_ref
    from atlas.kernels.paged_attention_triton import paged_attention_triton

    q, kv = case["q"], case["kv"]
    # (a case may also say "chunk" (chunked attention) or "softcap" (soft-capped scores): chunked_attention_cases,
    #  softcap_attention_cases)
    chunk, softcap = case.get("chunk"), case.get("softcap")
    ref = paged_attention_ref(q.float(), kv, case["qsl"], case["seq_lens"], case["page_tables"],
                              case["scale"], case["causal"], case["window"], chunk_size=chunk, softcap=softcap)
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
        chunk_size=chunk, softcap=softcap, counts=counts)
    check_counts_back_to_zero(counts)
    return got.float(), ref


def fused_counts(case, prog_req: torch.Tensor, kv: torch.Tensor) -> torch.Tensor | None:
    """For a split case marked "fused_combine": the kernel's counts (zeros, one a program and KV head), so that its
    last split of each program merges the partials (the attention_fused_combine knob); else None."""
    if not case.get("fused_combine") or case.get("num_splits", 1) < 2:
        return None
    return torch.zeros(prog_req.numel() * kv.shape[3], dtype=torch.int32, device=kv.device)


def check_counts_back_to_zero(counts: torch.Tensor | None) -> None:
    """The next call (a CUDA graph's next replay) starts from zeros: the last split must have reset every count."""
    if counts is not None and bool(counts.any()):
        raise AssertionError(f"counts left after the call: {counts.tolist()}")


def fused_split_case(seed: int, device: str, dtype: torch.dtype):
    """A split_case whose last split of each program merges the partials itself (no combine kernel)."""
    return {**split_case(seed, device, dtype), "fused_combine": True}


CASE_KINDS = {"step": random_case, "split": split_case, "fp8": fp8_case}


def kinds_main(check_kinds, label: str) -> None:
    """The main of a case file that checks each kind of case (`python FILE STEP SPLIT FP8`: how many of each):
    check_kinds(counts, device, dtype) -> failures, on the default device (CUDA in bf16, else CPU in fp32); exits
    non-zero on a failure."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    counts = dict(zip(CASE_KINDS, [int(a) for a in sys.argv[1:4]] or [6, 6, 6], strict=False))
    problems = check_kinds(counts, device, dtype)
    print("\n".join(problems) or f"{sum(counts.values())} {label} cases agree ({device}, {dtype})")
    sys.exit(1 if problems else 0)


def check(device: str, dtype: torch.dtype, seeds: range, make=None, run=None) -> list[str]:
    """Failures of the kernel against its reference on random cases (make(seed, device, dtype) builds
    one, run(case) -> (kernel output, reference); this file's paged-attention cases by default)."""
    make, run = make or random_case, run or run_case
    failures = []
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for seed in seeds:
        got, ref = run(make(seed, device, dtype))
        err = (got - ref).abs().max().item()
        if not err <= tol:
            failures.append(f"seed {seed}: max abs error {err:.3g} > {tol}")
    return failures


def main(make=None, run=None) -> None:
    """Check on the default device (CUDA in bf16, else CPU in fp32); argv[1] cases; exit 1 on a mismatch."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    problems = check(device, dtype, range(n), make, run)
    print("\n".join(problems) or f"{n} cases agree ({device}, {dtype})")
    if make is None and len(sys.argv) > 2:  # argv[2]: split-KV decode cases
        n_split = int(sys.argv[2])
        split_problems = check(device, dtype, range(n_split), split_case)
        print("\n".join(f"split-KV {p}" for p in split_problems) or f"{n_split} split-KV cases agree")
        problems += split_problems
    if make is None and len(sys.argv) > 3:  # argv[3]: cases over an 8-bit cache
        n_fp8 = int(sys.argv[3])
        dtypes = [dtype]
        if device == "cpu":  # also bf16 queries (the kernel's fp16 products), where the interpreter rounds bf16
            from fused_ops_cases import interpreter_rounds_bf16
            dtypes += [torch.bfloat16] if interpreter_rounds_bf16() else []
        for dt in dtypes:
            fp8_problems = check(device, dt, range(n_fp8), fp8_case)
            print("\n".join(f"fp8 cache {dt} {p}" for p in fp8_problems) or f"{n_fp8} fp8-cache cases agree ({dt})")
            problems += fp8_problems
    if make is None and len(sys.argv) > 4:  # argv[4]: split-KV cases merged by their last split (and with sinks)
        from sink_attention_cases import run_sink_case, with_sinks

        n_fused = int(sys.argv[4])
        fused_problems = check(device, dtype, range(n_fused), fused_split_case)
        fused_problems += [f"with sinks {p}" for p in check(
            device, dtype, range(n_fused), lambda seed, dev, dt: with_sinks(fused_split_case(seed, dev, dt), seed),
            run_sink_case)]
        print("\n".join(f"merged in the kernel {p}" for p in fused_problems)
              or f"{n_fused} split-KV cases merged in the kernel agree, with and without sinks")
        problems += fused_problems
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
