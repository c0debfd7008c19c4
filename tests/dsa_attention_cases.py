"""DeepSeek sparse attention steps over a paged latent cache, for the Triton kernels
(kernels/dsa_attention_triton.py) against the PyTorch reference (kernels/dsa_attention_ref.py). Shared by the
interpreter test on CPU (float32, tiny shapes) and the CUDA test (bf16, DeepSeek-V3.2's per-layer shapes with
16 of its 128 heads).

    TRITON_INTERPRET=1 python tests/dsa_attention_cases.py  # CPU, the interpreter
    python tests/dsa_attention_cases.py v32                 # CUDA, bf16, contexts 1K-8K, index_topk 2048
    TRITON_INTERPRET=1 python tests/dsa_attention_cases.py v32   # the same shapes at ~2K contexts (~2 min)
    TRITON_INTERPRET=1 python tests/dsa_attention_cases.py models [all]   # tiny GLM-5 (V3.2) models, Triton

Each step mixes requests: decodes (one row), verifies (a few rows) and prefill chunks over a cached prefix, on
scattered pages with the last one partial, contexts shorter and longer than index_topk. Per step it checks
- the indexer scores [T, S_max] against the reference's (same -inf pattern, finite values within rounding);
- the top-k of the kernel's own scores against the reference's select_topk of them: the same set, exactly;
- dsa_attention_triton against dsa_attention_ref with `record`: the selected sets equal (the recorded index
  lists against the recorded masks) and the outputs within rounding; the attention over those selections split
  in 2 and 4 shares a row (decode steps' split) within rounding too;
- a GLM-5 shared layer: both paths handed their own records as `reuse` over a [c | k_pe] cache of their own.
"Exact" steps make the scores exact in float32 whatever the summation order (small integers in the indexer
queries, keys and weights, a power-of-two index_scale), so the whole pipeline's selections must equal the
reference's; they are full of tied scores (and one step has all-zero indexer keys: every score ties), which
the stable rule breaks to the earlier key. "Float" steps have random scores: the selection is checked on the
kernel's own scores only.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int
    latent: int
    rope: int
    index_heads: int
    index_dim: int
    index_topk: int
    page: int


TINY = [Shape(3, 16, 8, 4, 16, 8, 4), Shape(4, 32, 8, 5, 8, 12, 8), Shape(16, 16, 16, 16, 16, 6, 4),
        Shape(1, 32, 8, 1, 16, 40, 8)]
V32 = Shape(16, 512, 64, 64, 128, 2048, 16)  # (DeepSeek-V3.2 per layer: 128 heads cut to 16, --block-size 16)


def random_step(seed: int, shape: Shape, device: str, dtype: torch.dtype, exact: bool,
                reqs: list[tuple[int, int]], fp8: bool = False, zero_keys: bool = False):
    """reqs: (context before the step, query rows) per request."""
    g = torch.Generator().manual_seed(seed)
    s = shape
    q_lens = [q for _, q in reqs]
    seq_lens = [c + q for c, q in reqs]
    pages_per = [-(-n // s.page) for n in seq_lens]
    num_pages = sum(pages_per) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.zeros(len(reqs), max(pages_per) + 1, dtype=torch.int32)  # (a spare column: padding)
    used = 0
    for i, n in enumerate(pages_per):
        tables[i, :n] = torch.tensor(perm[used: used + n], dtype=torch.int32)
        used += n
    t = sum(q_lens)
    latent = torch.randn(num_pages, s.page, s.latent + s.rope, generator=g)
    if exact:
        keys = torch.randint(-2, 3, (num_pages, s.page, s.index_dim), generator=g).float()
        q_idx = torch.randint(-2, 3, (t, s.index_heads, s.index_dim), generator=g).float()
        w_idx = torch.randint(-2, 3, (t, s.index_heads), generator=g).float()
        index_scale = 1 / 16
    else:
        keys = torch.randn(num_pages, s.page, s.index_dim, generator=g)
        q_idx = torch.randn(t, s.index_heads, s.index_dim, generator=g)
        w_idx = torch.randn(t, s.index_heads, generator=g) * s.index_heads ** -0.5
        index_scale = s.index_dim ** -0.5
    if zero_keys:
        keys.zero_()
    cache = torch.cat([latent, keys], dim=-1).to(dtype)
    shared_cache = torch.randn(num_pages, s.page, s.latent + s.rope, generator=g).to(dtype)
    if fp8:  # (--kv-cache-dtype fp8: rows rounded to e4m3, the small integer keys exactly)
        cache, shared_cache = (c.float().to(torch.float8_e4m3fn) for c in (cache, shared_cache))
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)

    def queries():
        return ((torch.randn(t, s.heads, s.latent, generator=g) / s.latent ** 0.25).to(dtype).to(device),
                torch.randn(t, s.heads, s.rope, generator=g).to(dtype).to(device))

    (q_latent, q_pe), (q_latent2, q_pe2) = queries(), queries()
    return dict(shape=s, q_latent=q_latent, q_pe=q_pe, q_latent2=q_latent2, q_pe2=q_pe2,
                q_idx=q_idx.to(dtype).to(device), w_idx=w_idx.to(device), cache=cache.to(device),
                shared_cache=shared_cache.to(device), qsl=qsl, seq_lens=seq_lens, tables=tables.to(device),
                index_scale=index_scale, scale=(s.latent // 4 + s.rope) ** -0.5, exact=exact)


def tiny_steps():
    """(seed, shape, exact, reqs, fp8, zero_keys) of the interpreter's steps."""
    # decodes, a first chunk, a verify, a chunk over a prefix
    mixed = [(9, 1), (0, 7), (13, 3), (2, 1), (5, 12)]
    return [
        (0, TINY[0], True, mixed, False, False),
        (1, TINY[1], True, [(30, 1), (3, 9), (17, 4)], False, False),
        (2, TINY[2], True, [(11, 1), (0, 16), (1, 1)], False, False),
        (3, TINY[0], True, [(14, 6), (0, 1)], False, True),  # every score ties
        (4, TINY[3], True, [(25, 1), (8, 8)], False, False),  # every context within index_topk: dense
        (5, TINY[0], False, mixed, False, False),
        (6, TINY[1], True, [(21, 3), (6, 1)], True, False),  # an 8-bit cache
        (7, TINY[1], True, [(12, 1), (10, 3)], False, False),  # one key past index_topk: one key dropped
        # (40 of up to 62 keys selected: the 16-key tiles of 2 and 4 splits all hold some, the 4th none)
        (8, TINY[3], True, [(60, 1), (45, 2)], False, False),
    ]


def v32_interpreter_steps():
    """V3.2's shapes at contexts just past index_topk, for the interpreter (about 2 minutes on a CPU core; not
    in the test suite: a manual check that the real tile shapes run)."""
    return [(20, V32, True, [(2100, 1), (2050, 2)], False, False), (21, V32, True, [(2060, 1)], True, False),
            (22, V32, False, [(2080, 1)], False, False)]


def v32_steps():
    # decodes at 1K-8K, a 4-row verify at 3K, a 96-row prefill chunk over a 2K prefix, a 300-row first chunk
    reqs = [(1023, 1), (4095, 1), (8191, 1), (3000, 4), (2048, 96), (0, 300)]
    return [(10, V32, True, reqs, False, False), (11, V32, False, reqs[:4], False, False),
            (12, V32, True, [(5000, 1), (1500, 2)], True, False),
            (13, V32, True, [(1500, 1), (100, 1)], False, False)]


def reference_scores(case) -> torch.Tensor:
    """[T, S_max] float32 from dsa_attention_ref.indexer_scores, -inf past each row's position."""
    from atlas.kernels.dsa_attention_ref import indexer_scores
    from atlas.kernels.paged_attention_ref import gather_positions

    s = case["shape"]
    s_max = max(case["seq_lens"])
    qsl, cache = case["qsl"], case["cache"]
    out = torch.full((qsl[-1], s_max), float("-inf"), device=cache.device)
    for b, seq in enumerate(case["seq_lens"]):
        keys = gather_positions(cache, case["tables"][b: b + 1], seq)[0, :, s.latent + s.rope:].float()
        for t in range(qsl[b], qsl[b + 1]):
            p = seq - (qsl[b + 1] - t)
            out[t, : p + 1] = indexer_scores(case["q_idx"][t: t + 1], case["w_idx"][t: t + 1], keys[: p + 1],
                                             case["index_scale"])[0]
    return out


def as_mask(indices: torch.Tensor, width: int) -> torch.Tensor:
    """[T, K] positions (-1 none) -> [T, width] bool; raises on a repeated position."""
    mask = torch.zeros(indices.shape[0], width + 1, dtype=torch.bool, device=indices.device)
    idx = torch.where(indices >= 0, indices.long(), width)
    mask.scatter_(1, idx, True)
    assert (mask[:, :width].sum(1) == (indices >= 0).sum(1)).all(), "a position selected twice"
    return mask[:, :width]


def reference_mask(case, record: list[torch.Tensor]) -> torch.Tensor:
    """The reference's recorded masks (per request and 256-row block) as one [T, S_max] mask."""
    qsl, seq_lens = case["qsl"], case["seq_lens"]
    out = torch.zeros(qsl[-1], max(seq_lens), dtype=torch.bool, device=record[0].device)
    i = 0
    for b in range(len(seq_lens)):
        for a in range(0, qsl[b + 1] - qsl[b], 256):
            blk = record[i]
            out[qsl[b] + a: qsl[b] + a + blk.shape[0], : blk.shape[1]] = blk
            i += 1
    assert i == len(record)
    return out


def run_step(case, tol: float, chunk_rows: int | None = None, splits: tuple[int, ...] = (2, 4)) -> list[str]:
    """chunk_rows: score and select that many query rows at a time (dsa_select's chunks; default its own);
    splits: the split counts the attention is checked at too."""
    import atlas.kernels.dsa_attention_triton as kernels
    from atlas.kernels.dsa_attention_ref import dsa_attention_ref, select_topk
    from atlas.kernels.dsa_attention_triton import (
        dsa_attention_triton,
        dsa_index_scores,
        dsa_sparse_mla,
        row_requests_and_positions,
        select_topk_indices,
    )

    s, dev = case["shape"], case["cache"].device
    qsl_d = torch.tensor(case["qsl"], dtype=torch.int32, device=dev)
    seq_d = torch.tensor(case["seq_lens"], dtype=torch.int32, device=dev)
    s_max = max(case["seq_lens"])
    t = case["qsl"][-1]
    problems = []

    def differ(name, got, want):
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        scale = max(1.0, want.float().abs().max().item()) if want.numel() else 1.0
        if not err <= tol * scale:
            problems.append(f"{name}: max abs error {err:.3g} > {tol * scale:.3g}")

    # 1. scores (over a bound 3 past the longest request: the extra columns are -inf)
    row_req, row_pos = row_requests_and_positions(t, qsl_d, seq_d)
    scores = dsa_index_scores(case["q_idx"], case["w_idx"], case["cache"], case["tables"], row_req, row_pos,
                              s_max + 3, s.latent + s.rope, case["index_scale"])
    if not bool(torch.isinf(scores[:, s_max:]).all()):
        problems.append("scores past S_max are not -inf")
    scores = scores[:, :s_max]
    want = reference_scores(case)
    if not torch.equal(torch.isinf(scores), torch.isinf(want)):
        problems.append("scores: the -inf (not visible) pattern differs")
    finite = ~torch.isinf(want)
    differ("scores", scores[finite], want[finite])
    # 2. the device top-k of those scores against the reference rule on the same scores
    got_sel = as_mask(select_topk_indices(scores, s.index_topk), s_max)
    if not torch.equal(got_sel, select_topk(scores, finite, s.index_topk)):
        problems.append("top-k of the kernel's scores: not the reference's set")
    # 3. the whole layer, recording
    rec_t, rec_r = [], []
    args = (case["q_latent"], case["q_pe"], case["q_idx"], case["w_idx"], case["cache"])
    default_chunk = kernels.SCORE_CHUNK_ELEMENTS
    if chunk_rows:
        kernels.SCORE_CHUNK_ELEMENTS = chunk_rows * s_max
    try:
        got = dsa_attention_triton(*args, qsl_d, seq_d, case["tables"], s_max, case["scale"], s.index_topk,
                                   case["index_scale"], record=rec_t)
    finally:
        kernels.SCORE_CHUNK_ELEMENTS = default_chunk
    ref = dsa_attention_ref(*(a.float() for a in args[:4]), case["cache"],
                            case["qsl"], case["seq_lens"], case["tables"], case["scale"], s.index_topk,
                            case["index_scale"], record=rec_r)
    differ("output", got, ref)
    # (decode steps' split: each row's index list in 2 and 4 shares, some of them empty where a row has few
    #  keys, merged by the combine kernel)
    for n in splits:
        split = dsa_sparse_mla(case["q_latent"], case["q_pe"], case["cache"], case["tables"], row_req, rec_t[0],
                               case["scale"], num_splits=n)
        differ(f"output over {n} splits", split, ref)
    if len(rec_t) != 1 or rec_t[0].shape != (t, min(s.index_topk, s_max)):
        problems.append(f"record: {[tuple(r.shape) for r in rec_t]}")
    ind = rec_t[0].long()
    ascending = torch.where(ind < 0, s_max, ind)
    if not bool((ascending[:, 1:] > ascending[:, :-1]).logical_or(ascending[:, 1:] == s_max).all()):
        problems.append("indices: not ascending with the -1 at the end")
    sel_t, sel_r = as_mask(rec_t[0], s_max), reference_mask(case, rec_r)
    if case["exact"] and not torch.equal(sel_t, sel_r):
        problems.append(f"selections: {int((sel_t != sel_r).sum())} (row, key) pairs differ from the "
                        "reference's")
    if not torch.equal(sel_t.sum(1), sel_r.sum(1)):
        problems.append("selections: not as many keys as the reference's")
    # (a request alone gives its rows of the batch's output bit for bit: batch invariance; with two padding
    #  rows after its own, which see no key: zeros)
    last = len(case["seq_lens"]) - 1
    a, b = case["qsl"][last], case["qsl"][last + 1]
    padded = [torch.cat([x[a:b], x[a:a + 2]]) for x in args[:4]]
    alone = dsa_attention_triton(*padded, case["cache"], qsl_d.new_tensor([0, b - a]), seq_d[last:],
                                 case["tables"][last:], case["seq_lens"][last], case["scale"], s.index_topk,
                                 case["index_scale"])
    if not torch.equal(alone[: b - a], got[a:b]):
        problems.append("a request alone: not its rows of the batch's output, bit for bit")
    if bool(alone[b - a:].any()):
        problems.append("padding rows: not zero")
    # 4. a shared layer reusing them over its own [c | k_pe] cache
    got2 = dsa_attention_triton(case["q_latent2"], case["q_pe2"], None, None, case["shared_cache"], qsl_d,
                                seq_d, case["tables"], s_max, case["scale"], s.index_topk,
                                case["index_scale"], reuse=rec_t)
    ref2 = dsa_attention_ref(case["q_latent2"].float(), case["q_pe2"].float(), None, None,
                             case["shared_cache"],
                             case["qsl"], case["seq_lens"], case["tables"], case["scale"], s.index_topk,
                             case["index_scale"], reuse=rec_r)
    if case["exact"]:
        differ("shared layer output", got2, ref2)
    return problems


# (GLM-5's greedy test by default, ~25 s in the interpreter: full and shared layers, contexts past index_topk;
#  `models all` adds V3.2's, both chunked-prefill / preemption / prefix-caching tests and V3.2's steps through
#  the graphs' static buffers per context bound, ~3 min more)
MODEL_TESTS = ["test_glm5.py::test_greedy_tokens_match_transformers"]
MORE_MODEL_TESTS = [
    "test_dsa.py::test_greedy_tokens_match_transformers",
    "test_dsa.py::test_chunking_mixed_batches_preemption_and_prefix_caching_do_not_change_outputs",
    "test_glm5.py::test_chunked_prefill_preemption_and_prefix_caching_do_not_change_outputs",
    "test_dsa.py::test_steps_through_the_cuda_graphs_static_inputs_per_context_bound"]


def run_model_tests(tests: list[str]) -> int:
    """Tiny V3.2 / GLM-5 checkpoints' model tests (greedy tokens against transformers, chunked prefill,
    preemption, prefix caching) with kernels/dsa_attention.py's Triton predicate forced on: the layer wiring
    (device step tensors, the index records a GLM-5 shared layer reuses) on the CPU, where the interpreter
    runs the kernels. -> exit code (1 also when the Triton path was not taken by full and shared layers
    both)."""
    import pytest

    import atlas.kernels.dsa_attention as dispatch
    import atlas.kernels.dsa_attention_triton as kernels

    calls = {"full": 0, "shared": 0}
    real = kernels.dsa_attention_triton

    def counted(*args, reuse=None, **kw):
        calls["shared" if reuse is not None else "full"] += 1
        return real(*args, reuse=reuse, **kw)

    dispatch.use_triton = lambda q_latent: True
    kernels.dsa_attention_triton = counted
    here = Path(__file__).parent
    args = ["-q", "-p", "no:cacheprovider", "--durations=0", *(str(here / t) for t in tests)]
    code = int(pytest.main(args))
    print(f"Triton DSA calls: {calls['full']} full-layer, {calls['shared']} shared-layer")
    return code if calls["full"] and calls["shared"] else 1


def main() -> None:
    """No argument: the tiny steps (CPU float32 under the interpreter, bf16 on CUDA); `v32`: DeepSeek-V3.2's
    shapes (on the CPU at shorter contexts); `models [all]`: run_model_tests. Prints one line a step and exits
    1 on any problem."""
    sys.path.insert(0, str(Path(__file__).parent))
    if sys.argv[1:2] == ["models"]:
        sys.exit(run_model_tests(MODEL_TESTS + (MORE_MODEL_TESTS if sys.argv[2:] == ["all"] else [])))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False  # (the reference's float32 products in full precision)
    if sys.argv[1:] == ["v32"]:
        steps = v32_steps() if device == "cuda" else v32_interpreter_steps()
    else:
        steps = tiny_steps()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    failures = 0
    for seed, shape, exact, reqs, fp8, zero_keys in steps:
        start = time.perf_counter()
        case = random_step(seed, shape, device, dtype, exact, reqs, fp8=fp8, zero_keys=zero_keys)
        # (odd seeds: 5-row score chunks; the interpreter checks the split attention on its three smallest steps)
        splits = (2, 4) if device == "cuda" or len(reqs) == 2 and sum(q for _, q in reqs) <= 7 else ()
        problems = run_step(case, tol, chunk_rows=5 if seed % 2 else None, splits=splits)
        failures += bool(problems)
        print(f"seed {seed} {'exact' if exact else 'float'}{' fp8' if fp8 else ''} reqs {reqs}: "
              f"{'; '.join(problems) or 'ok'} ({time.perf_counter() - start:.1f}s)", flush=True)
    print(f"{len(steps)} steps ({device}, {dtype}), {failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
