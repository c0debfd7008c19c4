"""Random routed-expert matmuls (kernels/moe_triton.py, both modes, against kernels/moe.py's float32
reference) and FusedExperts forwards (its Triton path against its grouped-GEMM path, same weights),
shared by the interpreter test on CPU and the CUDA tests.

Run as a script it checks them on the default device (CUDA, else CPU through Triton's interpreter when
TRITON_INTERPRET=1) and exits non-zero on a mismatch:

    TRITON_INTERPRET=1 python tests/moe_cases.py 16 6

The interpreter's tl.dot multiplies bfloat16 tiles as their integer bit patterns, so on CPU the
grouped mode (tensor cores) is checked in float32 and float16, and bfloat16 in pairs mode only.
"""

from __future__ import annotations

import sys

import torch

MODES = ("pairs", "grouped")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # the output's own rounding


def random_case(seed: int, device: str, dtype: torch.dtype) -> dict:
    """Even seeds pairs mode, odd seeds grouped; N and K off the blocks, every other case with small
    blocks (several K tiles), experts without rows, and in grouped mode often one with 17+ rows, in row chunks
    (BLOCK_M) of 32, 64 or the kernel's own choice."""
    g = torch.Generator().manual_seed(9000 + seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    mode = MODES[seed % 2]
    e = [4, 8, 16][seed % 3]
    n = [5, 37, 24, 40][(seed // 2 + 1) % 4]
    k = [40, 96, 200, 16, 130][seed % 5]
    small = (seed // 2) % 2 == 1
    case = dict(mode=mode, seed=seed)
    w = torch.randn(e, n, k, generator=g) / k ** 0.5
    if mode == "pairs":
        t, topk = 1 + (seed // 2) % 4, min([6, 2, 1, 2][(seed // 2) % 4], e - 1)
        # (expert e - 1 is never chosen)
        ids = torch.stack([torch.randperm(e - 1, generator=g)[:topk] for _ in range(t)])
        down = seed % 3 == 0  # the down projection: one x row per pair
        rows, per_row = (t * topk, 1) if down else (t, topk)
        case.update(ids=ids.to(device), topk=per_row,
                    blocks=dict(block_n=8, block_k=64) if small else {})
    else:
        counts = torch.randint(0, 6, (e,), generator=g)
        counts[randint(0, e)] = 0
        if seed % 4 != 3:
            counts[randint(0, e)] = randint(17, 40)  # two or three chunks of 16
        rows = int(counts.sum())
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        blocks = dict(block_n=16, block_k=32) if small else {}
        block_m = [None, 32, 64][(seed // 2) % 3]  # (None: grouped_block_m's choice by the rows per expert)
        case.update(offsets=offsets.to(device, torch.int32 if seed % 3 else torch.int64),
                    blocks=blocks if block_m is None else {**blocks, "block_m": block_m})
    x = torch.randn(rows, k, generator=g)
    if seed % 5 == 2:  # rows of a wider buffer
        x = torch.randn(rows, k + 9, generator=g)[:, :k]
    case.update(x=x.to(device, dtype), w=w.to(device, dtype))
    return case


def run_case(case) -> tuple[torch.Tensor, torch.Tensor]:
    from atlas.kernels.moe import grouped_ref, pairs_ref
    from atlas.kernels.moe_triton import moe_grouped_matmul, moe_pairs_matmul

    x, w = case["x"], case["w"]
    if case["mode"] == "pairs":
        got = moe_pairs_matmul(x, w, case["ids"], case["topk"], **case["blocks"])
        ref = pairs_ref(x, w, case["ids"], case["topk"])
    else:
        got = moe_grouped_matmul(x, w, case["offsets"], **case["blocks"])
        ref = grouped_ref(x, w, case["offsets"])
        # the same rows read from a larger buffer by index and written back by index (moe_grouped_gather): the
        # same numbers, bit for bit
        m = x.shape[0]
        g = torch.Generator().manual_seed(case["seed"])
        src, dst = torch.randperm(m + 3, generator=g)[:m].to(x.device), torch.randperm(m, generator=g).to(x.device)
        wide = torch.zeros(m + 3, x.shape[1], device=x.device, dtype=x.dtype).index_copy_(0, src, x)
        indexed = moe_grouped_matmul(wide, w, case["offsets"], rows=src, out_rows=dst, **case["blocks"])
        assert torch.equal(indexed.index_select(0, dst), got), f"seed {case['seed']}: rows read or written by index"
    assert got.shape == ref.shape and got.dtype == x.dtype, (got.shape, ref.shape, got.dtype)
    return got.float(), ref


def check(device: str, dtype: torch.dtype, seeds, modes=MODES) -> list[str]:
    """The kernel cases of `seeds` whose mode is in `modes` against the reference -> failures."""
    tol = TOLERANCE[dtype]
    failures = []
    for seed in seeds:
        if MODES[seed % 2] not in modes:
            continue
        got, ref = run_case(random_case(seed, device, dtype))
        err = ((got - ref).abs() / (1 + ref.abs())).max().item() if ref.numel() else 0.0
        if not err <= tol:
            failures.append(f"{dtype} seed {seed} ({MODES[seed % 2]}): max error {err:.3g} > {tol}")
    return failures


def experts_case(seed: int, device: str, dtype: torch.dtype, num_experts: int = 8, hidden: int = 16,
                 intermediate: int = 8, top_k: int = 2, tokens: int | None = None) -> dict:
    """A FusedExperts with random weights and a routing of `tokens` tokens (by default 1, 3, 4, 5, 9, 30
    by seed: both modes) in which the last expert gets no token and, from 9 tokens, every token chooses
    expert 0 (two chunks of 16 rows at 30 tokens). Its activation by seed: silu, gpt-oss's clamped SwiGLU with
    gate|up and down biases, DeepSeek-V4's clamped SiLU (limits of 0.8, so that the clamps bite)."""
    from atlas.layers.moe import FusedExperts

    g = torch.Generator(device=device).manual_seed(500 + seed)
    t = [1, 3, 4, 5, 9, 30][seed % 6] if tokens is None else tokens
    kind = [{}, dict(bias=True, swiglu=(1.702, 0.8)), dict(silu_limit=0.8)][seed % 3]
    with torch.device(device):  # (V2-Lite's experts are allocated where they run)
        experts = FusedExperts(num_experts, hidden, intermediate, "silu", **kind).to(dtype).requires_grad_(False)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=g, device=device) / hidden ** 0.5)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g, device=device) / intermediate ** 0.5)
        if experts.b13 is not None:
            experts.b13.copy_(torch.randn(experts.b13.shape, generator=g, device=device) * 0.5)
            experts.b2.copy_(torch.randn(experts.b2.shape, generator=g, device=device) * 0.5)
    scores = torch.rand(t, num_experts - 1, generator=g, device=device)
    if t >= 9:
        scores[:, 0] += 1.0
    weights, ids = scores.topk(top_k, dim=-1)
    x = torch.randn(t, hidden, generator=g, device=device).to(dtype)
    return dict(experts=experts, x=x, weights=weights.softmax(-1), ids=ids)


def check_experts(device: str, dtype: torch.dtype, seeds, max_tokens: int = 64, **shape) -> list[str]:
    """FusedExperts.forward_triton against forward_grouped (tokens up to max_tokens) -> failures. On CUDA
    also that forward dispatches to the Triton path (the same output, bit for bit); above MOE_PAIRS_MAX_TOKENS, the
    same with the moe_grouped_gather knob's other setting (on, the default: rows read and written by index, the
    weights' sum in one kernel; off: the rows copied into expert order and back)."""
    from atlas.kernels import settings
    from atlas.layers.moe import MOE_PAIRS_MAX_TOKENS

    tol = TOLERANCE[dtype]
    failures = []
    for seed in seeds:
        c = experts_case(seed, device, dtype, **shape)
        experts, x, weights, ids = c["experts"], c["x"], c["weights"], c["ids"]
        if x.shape[0] > max_tokens:
            continue
        got = experts.forward_triton(x, weights, ids)
        ref = experts.forward_grouped(x, weights, ids).float()
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        name = f"{dtype} experts seed {seed} ({x.shape[0]} tokens, swiglu {experts.swiglu}, limit {experts.silu_limit})"
        if got.dtype != dtype or got.shape != x.shape or not err <= tol:
            failures.append(f"{name}: {got.dtype} {tuple(got.shape)}, max error {err:.3g} (of the largest) "
                            f"> {tol}")
        dispatched = x.is_cuda and x.shape[0] <= settings.tuning.moe_triton_max_tokens
        if dispatched and not torch.equal(experts(x, weights, ids), got):
            failures.append(f"{name}: forward did not take the Triton path")
        # (moe_pairs_max_tokens=0: the grouped kernel at these tokens too; the interpreter has no bf16 tl.dot)
        if x.shape[0] <= MOE_PAIRS_MAX_TOKENS and (x.is_cuda or dtype == torch.float32):
            with settings.tuned(moe_pairs_max_tokens=0):
                grouped = experts.forward_triton(x, weights, ids)
            err = ((grouped.float() - ref).abs().max() / ref.abs().max()).item()
            if grouped.dtype != dtype or not err <= tol:
                failures.append(f"{name}, moe_pairs_max_tokens=0: max error {err:.3g} (of the largest) > {tol}")
        if x.shape[0] > MOE_PAIRS_MAX_TOKENS:  # (rows by index and the weights' sum in one kernel, or copied)
            other = not settings.tuning.moe_grouped_gather
            with settings.tuned(moe_grouped_gather=other):
                indexed = experts.forward_triton(x, weights, ids)
            err = ((indexed.float() - ref).abs().max() / ref.abs().max()).item()
            if indexed.dtype != dtype or not err <= tol:
                failures.append(f"{name}, moe_grouped_gather={other}: max error {err:.3g} (of the largest) > {tol}")
            with settings.tuned(moe_grouped_gather=True, moe_expert_sort=True):  # (the same order: the same bits)
                one_kernel = experts.forward_triton(x, weights, ids)
            with settings.tuned(moe_grouped_gather=True, moe_expert_sort=False):
                apart = experts.forward_triton(x, weights, ids)
                if not torch.equal(one_kernel, apart):
                    failures.append(f"{name}: moe_expert_sort changes the output")
            # (the activation as gate|up's epilogue: the activation kernel's roundings; on the CPU the interpreter's
            #  exp is not libdevice's, so there within the tolerance)
            with settings.tuned(moe_grouped_gather=True, moe_grouped_act=True):
                epilogue = experts.forward_triton(x, weights, ids)
            err = ((epilogue.float() - ref).abs().max() / ref.abs().max()).item()
            if epilogue.dtype != dtype or not err <= tol or (x.is_cuda and not torch.equal(epilogue, apart)):
                failures.append(f"{name}, moe_grouped_act: max error {err:.3g} (of the largest) > {tol}, or on CUDA "
                                f"not the activation kernel's bits")
    return failures


def check_expert_sort(device: str) -> list[str]:
    """expert_sort (the moe_expert_sort knob's one-program sort of the (token, choice) pairs by expert) against
    torch.argsort(stable=True), the division by k and the experts' counts, exactly: no pairs, one expert, experts
    without pairs, chunks off the block, up to 256 experts and 4,096 pairs -> failures."""
    from atlas.kernels.moe_triton import expert_sort

    failures = []
    g = torch.Generator().manual_seed(4200)
    for t, k, e in ((0, 4, 32), (1, 4, 32), (5, 1, 1), (37, 6, 60), (64, 2, 7), (256, 4, 32), (130, 8, 256),
                    (1024, 4, 32)):
        ids = torch.randint(0, e, (t, k), generator=g)
        if t > 4:
            ids[ids == e // 2] = 0  # (an expert without pairs in the middle)
        order, rows, offsets = expert_sort(ids.to(device), e)
        flat = ids.reshape(-1)
        want = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e)
        if not (torch.equal(order.cpu(), want) and torch.equal(rows.cpu(), want // k)
                and torch.equal(offsets.cpu(), torch.cat([counts.new_zeros(1), counts.cumsum(0)]))):
            failures.append(f"expert_sort of {t} tokens x {k} choices over {e} experts: not the stable argsort's")
    return failures


def check_combine(device: str) -> list[str]:
    """moe_combine (the moe_grouped_gather knob's sum of a token's rows by their routing weights) against
    moe_combine_ref bit for bit, and against FusedExperts._combine (PyTorch's sum) within float32 rounding:
    bf16, fp16 and float32 rows, 1-8 choices, widths off the block and over it -> failures."""
    from atlas.kernels.moe import moe_combine_ref
    from atlas.kernels.moe_triton import moe_combine
    from atlas.layers.moe import FusedExperts

    if device == "cpu":  # (the interpreter truncates float32 -> bf16 casts where the GPU rounds to nearest even)
        from fused_ops_cases import interpreter_rounds_bf16

        assert interpreter_rounds_bf16(), "cannot make the interpreter round bf16 like the GPU"
    failures = []
    g = torch.Generator().manual_seed(4100)
    for dtype, t, k, d in ((torch.bfloat16, 3, 4, 2880), (torch.float16, 5, 1, 40), (torch.float32, 2, 6, 1030),
                           (torch.bfloat16, 1, 8, 7)):
        y = (torch.randn(t * k, d, generator=g) * 4).to(device, dtype)
        weights = torch.rand(t, k, generator=g).softmax(-1).to(device)
        got, want = moe_combine(y, weights, dtype), moe_combine_ref(y, weights, dtype)
        name = f"moe_combine {dtype} {t} tokens x {k} choices x {d}"
        if got.dtype != dtype or not torch.equal(got, want):
            failures.append(f"{name}: not moe_combine_ref's numbers")
        pytorch = FusedExperts._combine(y, weights, dtype).float()
        # (the sum's rounding scales with its terms, not with the sum: rows that cancel round alike only to that)
        terms = (y.view(t, k, d).float().abs() * weights.unsqueeze(-1)).sum(dim=1)
        if not ((got.float() - pytorch).abs() <= TOLERANCE[dtype] * terms).all():
            failures.append(f"{name}: off PyTorch's sum by more than the rounding")
    if moe_combine(torch.empty(0, 64, device=device, dtype=torch.bfloat16), torch.empty(0, 4, device=device),
                   torch.bfloat16).shape != (0, 64):
        failures.append("moe_combine of no tokens")
    return failures


def fused_case(seed: int, device: str, dtype: torch.dtype) -> dict:
    """Expert weights, 1-4 tokens with up to 6 choices, routing weights of which every third case has zeros (a
    zero-computation expert's pair); N and K off the blocks; a down bias every other case, a gate|up bias every
    other case; the activations: silu, both gelus, gpt-oss's clamped SwiGLU and DeepSeek-V4's clamped SiLU (with a
    limit of 0.8, so that the clamps bite) and relu (non-gated squared-ReLU experts' form)."""
    g = torch.Generator().manual_seed(7000 + seed)
    e, topk, t = [4, 8, 16][seed % 3], [1, 2, 6, 3][seed % 4], 1 + seed % 4
    topk = min(topk, e - 1, 8 // t)  # (few pairs: each is many interpreted programs on the CPU)
    inter, hidden = [5, 12, 19, 8][seed % 4], [40, 24, 66, 16][(seed // 2) % 4]
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(e, hidden, inter, generator=g) / inter ** 0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
    weights = torch.rand(t, topk, generator=g).softmax(-1)
    if seed % 3 == 0:
        weights[0, -1] = 0.0
    bias = torch.randn(e, hidden, generator=g) if seed % 2 else None
    bias13 = torch.randn(e, 2 * inter, generator=g) if seed % 4 in (1, 3) else None
    case = dict(x=torch.randn(t, hidden, generator=g), w13=w13, w2=w2, ids=ids, weights=weights, bias=bias,
                bias13=bias13, act=["silu", "gelu_tanh", "gelu", "clamped_swiglu", "limited_silu", "relu"][seed % 6],
                blocks=dict(block_n=8, block_k=32) if (seed // 3) % 2 else {})
    return {k: v.to(device, dtype if v.is_floating_point() and k != "weights" else v.dtype)
            if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def check_fused(device: str, dtype: torch.dtype, seeds) -> list[str]:
    """The fused pairs kernels (gate|up with the activation; down with the weighted sum and bias) against the
    float32 reference -> failures. A pair of weight 0 must be skipped: its h row is zeros, and NaNs put in that
    row do not reach the sum."""
    from atlas.kernels.fused_ops import act_and_mul_ref, triton_act_code
    from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU
    from atlas.kernels.moe import clamped_swiglu, limited_silu_and_mul, pairs_ref
    from atlas.kernels.moe_triton import moe_pairs_down_combine, moe_pairs_gate_up_act

    alpha, limit = 1.702, 0.8
    acts = {"clamped_swiglu": (ACT_CLAMPED_SWIGLU, dict(alpha=alpha, limit=limit),
                               lambda h: clamped_swiglu(h, alpha, limit)),
            "limited_silu": (ACT_LIMITED_SILU, dict(limit=limit), lambda h: limited_silu_and_mul(h, limit))}

    tol = TOLERANCE[dtype]
    failures = []
    for seed in seeds:
        c = fused_case(seed, device, dtype)
        x, w13, w2, ids, weights, bias = c["x"], c["w13"], c["w2"], c["ids"], c["weights"], c["bias"]
        t, k = ids.shape
        bias13 = c["bias13"]
        name = (f"{dtype} fused seed {seed} ({t} tokens, top-{k}, {c['act']}, bias {bias is not None}, gate|up bias "
                f"{bias13 is not None})")
        code, extra, ref = acts.get(c["act"], (None, {}, None))
        h = moe_pairs_gate_up_act(x, w13, ids, weights, triton_act_code(c["act"]) if code is None else code,
                                  bias=bias13, **extra, **{key: 2 * v if key == "block_n" else v
                                                           for key, v in c["blocks"].items()})
        h13 = pairs_ref(x, w13, ids, k).to(dtype)  # (rounded to the dtype, bias added in it: the unfused path)
        if bias13 is not None:
            h13 = h13 + bias13[ids.reshape(-1)]
        # (the activation in the dtype, as the unfused path computes it: the kernel rounds after each operation too)
        h_ref = (act_and_mul_ref(h13, c["act"]) if ref is None else ref(h13)).float()
        live = (weights.reshape(-1) != 0)
        h_ref = h_ref * live[:, None]
        err = ((h.float() - h_ref).abs() / (1 + h_ref.abs())).max().item()
        # (Triton's interpreter truncates to bfloat16 where the GPU rounds to nearest: with the bias's rounding one
        #  more truncation in the chain, the errors add up in one direction)
        h_tol = 1.5 * tol if x.device.type == "cpu" and dtype == torch.bfloat16 and bias13 is not None else tol
        if h.dtype != dtype or h.shape != h_ref.shape or not err <= h_tol:
            failures.append(f"{name}: gate|up {h.dtype} {tuple(h.shape)}, max error {err:.3g} > {h_tol}")
        if not bool((h.float()[~live] == 0).all()):
            failures.append(f"{name}: a pair of weight 0 has a nonzero h row")
        h_in = h.clone()
        h_in[~live] = float("nan")
        y = moe_pairs_down_combine(h_in, w2, ids, weights, bias, rows=False, **c["blocks"])
        per_pair = pairs_ref(h, w2, ids, 1)
        if bias is not None:
            per_pair = per_pair + bias.float()[ids.reshape(-1)]
        y_ref = (per_pair * weights.reshape(-1, 1).float()).view(t, k, -1)
        y_ref = torch.where(live.view(t, k, 1), y_ref, 0.0).sum(dim=1)
        # (and the kernel that loads a token's choices in one tile: its own default K tile, the case's block_n; and
        #  the case's whole tile with other warps and stages, as the moe_pairs_tiles knob passes them)
        rows = moe_pairs_down_combine(h_in, w2, ids, weights, bias, rows=True,
                                      **{key: v for key, v in c["blocks"].items() if key == "block_n"})
        forms = [("down", y), ("down (rows)", rows)]
        if c["blocks"]:
            forms.append(("down (rows, the case's tile)", moe_pairs_down_combine(
                h_in, w2, ids, weights, bias, rows=True, num_warps=2, num_stages=1, **c["blocks"])))
        for form, got in forms:
            err = ((got.float() - y_ref).abs() / (1 + y_ref.abs())).max().item()
            if got.dtype != dtype or got.shape != y_ref.shape or not err <= tol:
                failures.append(f"{name}: {form} {got.dtype} {tuple(got.shape)}, max error {err:.3g} > {tol}")
    return failures


def check_routing(device: str, seeds) -> list[str]:
    """The one-kernel router choice against layers/moe.select_experts' PyTorch ops (softmax and sigmoid scores,
    with and without a correction bias, renormalized or not, with a floor under the sum, scaled; float32 or bf16
    logits) and gpt-oss's
    top-k-then-softmax in bf16 ->
    failures: the same experts in the same order, weights within float32 (bf16 for gpt-oss) rounding."""
    from atlas.kernels import settings
    from atlas.kernels.moe_routing_triton import select_topk
    from atlas.layers.moe import RouterConfig, select_experts

    failures = []
    for seed in seeds:
        g = torch.Generator().manual_seed(4000 + seed)
        # (Qwen3-MoE's 128 / 8, LongCat-Flash's 512 + 256 zero experts / 12, Qwen3-Next's 512 / 10, and odd sizes)
        e = [128, 72, 7, 256, 64, 768, 512][seed % 7]
        top_k = min([8, 6, 2, 1, 4, 12, 10][seed % 7], e)
        t = 1 + seed % 3
        scoring = ["softmax", "sigmoid"][seed % 2]
        # (a floor above every sum, as ERNIE's moe_norm_min would be for tiny scores: the renormalization divides by
        #  it instead)
        cfg = RouterConfig(num_experts=e, top_k=top_k, scoring_func=scoring, norm_topk_prob=seed % 3 != 1,
                           routed_scaling_factor=[1.0, 2.5][(seed // 2) % 2], topk_method="greedy",
                           norm_floor=50.0 if seed % 6 == 5 else 0.0, norm_eps=1e-6 if seed % 6 == 2 else 1e-20)
        logits = torch.randn(t, e, generator=g).to(device)
        if seed % 5 == 4 and e <= 256:  # (logits in the model dtype: Qwen3-MoE's, Mixtral's, Qwen3-Next's routers;
            # distinct in bf16, since the kernel and torch.topk may order equal ones differently)
            logits = ((torch.randperm(e, generator=g) - e / 2) * 0.05)[None].repeat(t, 1).to(device, torch.bfloat16)
        bias = (torch.randn(e, generator=g) * 0.1).to(device) if seed % 4 == 3 else None
        w, i = select_topk(logits, top_k, scoring, cfg.norm_topk_prob, cfg.routed_scaling_factor, bias, cfg.norm_floor,
                           cfg.norm_eps)
        with torch.no_grad(), settings.tuned(moe_fused_routing=False):
            w_ref, i_ref = select_experts(logits, cfg, bias)
        name = f"routing seed {seed} ({t} x {e}, top-{top_k}, {scoring}, bias {bias is not None})"
        if logits.is_cuda:
            with torch.no_grad(), settings.tuned(moe_fused_routing=True):
                taken = select_experts(logits, cfg, bias)
            if not (torch.equal(taken[0], w) and torch.equal(taken[1], i)):
                failures.append(f"{name}: select_experts did not take the kernel on CUDA")
        if not torch.equal(i.cpu(), i_ref.cpu()):
            failures.append(f"{name}: experts {i.tolist()} against {i_ref.tolist()}")
        elif not torch.allclose(w.cpu(), w_ref.float().cpu(), rtol=1e-5, atol=1e-7):
            failures.append(f"{name}: weights {w.tolist()} against {w_ref.tolist()}")
        # gpt-oss (32 or 128 experts): top-k of the bf16 logits, softmax over the chosen in bf16 (distinct logits:
        # equal ones may be chosen in either order, by torch.topk too)
        if e > 256:
            continue
        lb = torch.stack([(torch.randperm(e, generator=g) - e / 2) * 0.05 for _ in range(t)]).to(device, torch.bfloat16)
        w, i = select_topk(lb, top_k, "softmax_chosen")
        values, i_ref = lb.topk(top_k, dim=-1)
        w_ref = values.softmax(dim=-1).float()
        if not torch.equal(i.cpu(), i_ref.cpu()) or not torch.allclose(w.cpu(), w_ref.cpu(), rtol=8e-3, atol=0):
            failures.append(f"gpt-oss {name}: {i.tolist()} {w.tolist()} against {i_ref.tolist()} {w_ref.tolist()}")
    return failures


def check_routed_gate_up(device: str, seeds) -> list[str]:
    """The gate|up kernel that makes the router's choice itself (moe_pairs_routed_gate_up_act, route_pair's ranks)
    against select_topk then the gate|up kernel: the same experts in the same order, weights within float32
    rounding (its renormalizing sum adds in another order), h bit for bit what the unrouted kernel makes of those
    experts and weights; 1-3 tokens, 5-128 experts, every scoring (sigmoid with a correction bias, softmax, bf16
    logits softmaxed over the chosen), norm and its floor, a routing scale -> failures."""
    from atlas.kernels.fused_ops import triton_act_code
    from atlas.kernels.moe_routing_triton import Routing, select_topk
    from atlas.kernels.moe_triton import moe_pairs_gate_up_act, moe_pairs_routed_gate_up_act

    failures = []
    for seed in seeds:
        g = torch.Generator().manual_seed(5000 + seed)
        e = [64, 5, 128, 24, 32][seed % 5]
        top_k = min([6, 2, 8, 1, 4][seed % 5], e)
        t = 1 + seed % 3
        scoring = ["softmax", "sigmoid", "softmax_chosen"][seed % 3]
        logits = torch.randn(t, e, generator=g)
        if scoring == "softmax_chosen":  # (gpt-oss: bf16 logits, distinct: torch.topk may order equal ones otherwise)
            logits = torch.stack([(torch.randperm(e, generator=g) - e / 2) * 0.05 for _ in range(t)]).bfloat16()
        elif seed % 4 == 1:  # (ties: the lower expert index first, as select_topk's rounds take them)
            logits[:, 1::2] = logits[:, 0::2][:, :logits[:, 1::2].shape[1]]
        bias = (torch.randn(e, generator=g) * 0.1).to(device) if scoring == "sigmoid" else None
        routing = Routing(logits.to(device), top_k, scoring, norm=seed % 4 != 3, scale=[1.0, 2.5][seed % 2],
                          bias=bias, norm_floor=50.0 if seed % 5 == 4 else 0.0)
        inter, hidden = [3, 6][seed % 2], [40, 16][(seed // 2) % 2]
        w13 = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(device)
        x = torch.randn(t, hidden, generator=g).to(device)
        act = triton_act_code("silu")
        h, weights, ids = moe_pairs_routed_gate_up_act(x, w13, routing, act)
        w_ref, i_ref = select_topk(routing.logits, top_k, scoring, routing.norm, routing.scale, bias,
                                   routing.norm_floor)
        name = f"routed gate|up seed {seed} ({t} x {e}, top-{top_k}, {scoring}, bias {bias is not None})"
        if not torch.equal(ids.cpu(), i_ref.cpu()):
            failures.append(f"{name}: experts {ids.tolist()} against {i_ref.tolist()}")
            continue
        if not torch.allclose(weights.cpu(), w_ref.cpu(), rtol=2e-6, atol=0):
            failures.append(f"{name}: weights {weights.tolist()} against {w_ref.tolist()}")
        want = moe_pairs_gate_up_act(x, w13, ids, weights, act)
        if not torch.equal(h.cpu(), want.cpu()):
            failures.append(f"{name}: h differs from the unrouted kernel's by {(h - want).abs().max().item():.3g}")
    return failures


def check_pairs_tiles(device: str) -> list[str]:
    """The moe_pairs_tiles knob reaches the fused pairs kernels from FusedExperts.forward_triton (each wrapper gets
    the knob's tile), and the output at those tiles agrees with the grouped path -> failures."""
    from atlas.kernels import moe_triton, settings

    c = experts_case(0, device, torch.float32, tokens=2)
    experts, x, weights, ids = c["experts"], c["x"], c["weights"], c["ids"]
    knob = "gate_up:n2k32w2s1;down:n2k32w1s2"
    want = moe_triton.parse_pairs_tiles(knob)
    seen = {}
    real = moe_triton.moe_pairs_gate_up_act, moe_triton.moe_pairs_down_combine

    def recorder(name, fn):
        def call(*args, **kw):
            seen[name] = {key: kw.get(key) for key in ("block_n", "block_k", "num_warps", "num_stages")}
            return fn(*args, **kw)
        return call

    moe_triton.moe_pairs_gate_up_act = recorder("gate_up", real[0])
    moe_triton.moe_pairs_down_combine = recorder("down", real[1])
    try:
        with settings.tuned(moe_pairs_tiles=knob):
            got = experts.forward_triton(x, weights, ids)
    finally:
        moe_triton.moe_pairs_gate_up_act, moe_triton.moe_pairs_down_combine = real
    ref = experts.forward_grouped(x, weights, ids)
    failures = [f"moe_pairs_tiles: {name} got {seen.get(name)}, the knob says {tiles}"
                for name, tiles in want.items() if seen.get(name) != tiles]
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if not err <= TOLERANCE[torch.float32]:
        failures.append(f"moe_pairs_tiles: max error {err:.3g} against the grouped path")
    return failures


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    n_experts = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    if device == "cpu":  # (module docstring: no bf16 tl.dot in the interpreter)
        runs = [(torch.float32, MODES, 64), (torch.bfloat16, ("pairs",), 4), (torch.float16, ("grouped",), 0)]
    else:
        runs = [(torch.float32, MODES, 64), (torch.bfloat16, MODES, 64)]
    problems = []
    for dtype, modes, max_tokens in runs:  # (max_tokens: the FusedExperts cases' token counts, 0: none)
        problems += check(device, dtype, range(n), modes)
        problems += check_experts(device, dtype, range(n_experts), max_tokens)
        if dtype != torch.float16:  # (the CPU: six cases a dtype, each activation once, other seeds in bf16)
            problems += check_fused(device, dtype, range(n) if device != "cpu" else range(6) if dtype ==
                                    torch.float32 else range(6, 12))
    problems += check_routing(device, range(n))
    routed = n if device != "cpu" else min(n, 10)  # (each program chooses: the interpreter runs each in Python)
    problems += check_routed_gate_up(device, range(routed))
    problems += check_pairs_tiles(device)
    problems += check_combine(device)
    problems += check_expert_sort(device)
    print("\n".join(problems) or f"{n} MoE kernel cases, the fused pairs cases, {n} routing cases, {routed} routed "
          f"gate|up cases, {n_experts} FusedExperts cases, the combine and the sort cases agree ({device})")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
