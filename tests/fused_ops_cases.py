"""Random problems for the fused elementwise kernels (kernels/fused_ops_triton.py), shared by the tests
(Triton's CPU interpreter in CI, the real GPU in test_cuda-style runs).

Run as a script it checks every Triton kernel against its PyTorch reference (kernels/fused_ops.py) on
the default device and exits non-zero on a mismatch:

    TRITON_INTERPRET=1 python tests/fused_ops_cases.py 6 --max-tokens 40   # CPU, in Triton's interpreter
    python tests/fused_ops_cases.py 60                                     # GPU

(The interpreter truncates float32 -> bfloat16 casts where the GPU rounds to nearest even; under
TRITON_INTERPRET=1 the script patches the interpreter to round, see `interpreter_rounds_bf16`.)

Tolerance (see `compare`): fp32 within ~1e-6 relative; bf16/fp16 at most 1% of the elements not
bit-equal and each within an ulp or two (the few that differ come from a float32 reduction order, rsqrt
or exp differing in the last bit next to a rounding boundary). The script prints, per op and dtype, how
many elements are not bit-equal and how many are more than one ulp off.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ACT_KINDS = ["silu", "gelu_pytorch_tanh", "gelu", "relu", "clamped_swiglu", "limited_silu"]
CLAMPS = dict(alpha=1.702, limit=7.0)  # (gpt-oss's; the cases' values reach about 10, so both clamps bite)
MLA_SEEDS = 24  # (MLA's prologue on the first seeds only: its 16 compiled variants a dtype are covered by then)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randint(g: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi, (1,), generator=g))


def norm_case(seed: int, device: str, dtype: torch.dtype, max_tokens: int = 300) -> dict:
    g = _gen(1000 + seed)
    hidden = [72, 200, 128, 1000, 64, 4096][seed % 6]
    rows = _randint(g, 1, max_tokens + 1)
    if hidden <= 128:  # narrow rows share a program (up to 16 each): enough rows for several programs
        rows = 3 * rows + 1
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    if seed % 3 == 1:  # a row stride wider than the row (a slice of a bigger buffer)
        wide = torch.randn(rows, hidden + 24, generator=g).to(dtype)
        wide[:, :hidden] = x
        x = wide[:, :hidden]
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    return dict(x=x.to(device), residual=residual.to(device), weight=weight.to(device),
                eps=[1e-6, 1e-5][seed % 2])


def rope_tables(rotary_dim: int, max_pos: int, theta: float = 10000.0, mscale: float = 1.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return freqs.cos() * mscale, freqs.sin() * mscale


def qk_case(seed: int, device: str, dtype: torch.dtype, max_tokens: int = 300) -> dict:
    g = _gen(2000 + seed)
    num_kv_heads = [1, 2, 4, 8][seed % 4]
    group = [1, 2, 3, 4][(seed // 4) % 4]
    head_dim = [16, 24, 32, 64, 80, 128][seed % 6]
    partial = [1.0, 0.5][(seed // 2) % 2]
    rotary_dim = int(head_dim * partial)
    is_neox = seed % 3 != 2
    has_norm = seed % 2 == 0
    # Now and then no query heads: a drafter's context K/V (norm, RoPE and the cache write only).
    num_heads = 0 if seed % 7 == 5 else num_kv_heads * group
    tokens = _randint(g, 1, max_tokens + 1)
    page = [8, 16][seed % 2]
    num_pages = -(-tokens // page) + 3
    # Scattered slots; some rows are padding (slot -1); now and then every row is.
    slots = torch.randperm(num_pages * page, generator=g)[:tokens]
    pad = torch.rand(tokens, generator=g) < (1.0 if seed % 11 == 10 else 0.15)
    pad[_randint(g, 0, tokens)] |= seed % 2 == 1  # at least one padding row in every other case
    slots[pad] = -1
    max_pos = 4096
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    cos, sin = rope_tables(rotary_dim, max_pos, mscale=[1.0, 1.1386][seed % 2])
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(tokens, width, generator=g) * 2 + 0.3).to(dtype)
    if seed % 4 == 3:  # a row stride wider than the row
        wide = torch.randn(tokens, width + 16, generator=g).to(dtype)
        wide[:, :width] = qkv
        qkv = wide[:, :width]
    weights = [(1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2)] if has_norm else [None] * 2
    kv_cache = torch.randn(2, num_pages, page, num_kv_heads, head_dim, generator=g).to(dtype)
    return dict(qkv=qkv.to(device), positions=positions.to(device), cos_cache=cos.to(device),
                sin_cache=sin.to(device), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                q_norm_weight=None if weights[0] is None else weights[0].to(device),
                k_norm_weight=None if weights[1] is None else weights[1].to(device),
                eps=1e-6, rotary_dim=rotary_dim, is_neox=is_neox, kv_cache=kv_cache.to(device),
                slot_mapping=slots.to(device))


def mla_case(seed: int, device: str, dtype: torch.dtype, max_tokens: int = 300) -> dict:
    """MLA's prologue (fused_ops.mla_prologue_ref): q heads of nope | rope dims, the latent and rope key of kv_a
    (now and then a slice of a wider row, as q_a | kv_a of one projection), a paged latent cache with padding rows."""
    g = _gen(4000 + seed)
    # (four head layouts, each a compiled variant per dtype and cache: DeepSeek-V2-Lite's, V3's, two small odd ones)
    # (V3's 128 heads on the GPU only: the interpreter takes seconds over them)
    layouts = [(16, 128, 64, 512), (3, 16, 8, 32), (20, 32, 16, 200), (128 if device != "cpu" else 2, 128, 64, 512)]
    num_heads, nope, rope, latent = layouts[seed % 4]
    tokens = _randint(g, 1, max_tokens + 1)
    page = [8, 16][seed % 2]
    num_pages = -(-tokens // page) + 3
    slots = torch.randperm(num_pages * page, generator=g)[:tokens]
    pad = torch.rand(tokens, generator=g) < (1.0 if seed % 11 == 10 else 0.15)
    pad[_randint(g, 0, tokens)] |= seed % 2 == 1
    slots[pad] = -1
    max_pos = 4096
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    cos, sin = rope_tables(rope, max_pos, mscale=[1.0, 1.1386][seed % 2])
    q = (torch.randn(tokens, num_heads * (nope + rope), generator=g) * 2 + 0.3).to(dtype)
    kv = (torch.randn(tokens, 40 + latent + rope, generator=g) * 3).to(dtype)
    kv_a = kv[:, 40:] if seed % 3 == 1 else kv[:, 40:].contiguous()
    weight = (1 + 0.2 * torch.randn(latent, generator=g)).to(dtype)
    cache = torch.randn(num_pages, page, latent + rope, generator=g).to(dtype)
    return dict(q=q.to(device), kv_a=kv_a.to(device), positions=positions.to(device), cos_cache=cos.to(device),
                sin_cache=sin.to(device), norm_weight=weight.to(device), eps=[1e-6, 1e-5][seed % 2],
                num_heads=num_heads, nope_dim=nope, is_neox=(seed // 4) % 2 == 1, cache=cache.to(device),
                slot_mapping=slots.to(device))


def act_case(seed: int, device: str, dtype: torch.dtype, max_tokens: int = 300) -> dict:
    g = _gen(3000 + seed)
    inter = [72, 200, 1000, 128, 3000, 12288][seed % 6]
    tokens = _randint(g, 1, max_tokens + 1)
    x = (torch.randn(tokens, 2 * inter, generator=g) * 3).to(dtype)
    return dict(x=x.to(device), kind=ACT_KINDS[seed % len(ACT_KINDS)])


def layer_inputs(tokens: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """The elementwise inputs of one Qwen3-8B-shaped decoder layer (H 4096, 32 q heads, 8 kv heads,
    head_dim 128, intermediate 12288, qk norm, neox rope), every 7th row a padding row (slot -1)."""
    g = _gen(4000 + seed)
    hidden, heads, kv_heads, head_dim, inter, page = 4096, 32, 8, 128, 12288, 16
    pages = -(-tokens // page) + 1
    slots = torch.randperm(pages * page, generator=g)[:tokens]
    slots[::7] = -1
    cos, sin = rope_tables(head_dim, 40960, theta=1e6)
    t = dict(
        x=torch.randn(tokens, hidden, generator=g), residual=torch.randn(tokens, hidden, generator=g) * 4,
        w=1 + 0.1 * torch.randn(hidden, generator=g), qkv=torch.randn(tokens, (heads + 2 * kv_heads) * head_dim,
                                                                        generator=g) * 2,
        positions=torch.randint(0, 40960, (tokens,), generator=g), qw=1 + 0.1 * torch.randn(head_dim, generator=g),
        kw=1 + 0.1 * torch.randn(head_dim, generator=g), kv=torch.zeros(2, pages, page, kv_heads, head_dim),
        gate_up=torch.randn(tokens, 2 * inter, generator=g) * 2)
    t = {k: v.to(dtype) if k not in ("positions",) else v for k, v in t.items()}
    t.update(slots=slots, cos=cos, sin=sin)
    t = {k: v.to(device) for k, v in t.items()}
    t.update(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    return t


def run_layer(t: dict, stats: dict) -> list[str | None]:
    """The layer's ops, Triton against the references."""
    from atlas.kernels.fused_ops import (
        act_and_mul_ref,
        add_rms_norm_ref,
        qk_norm_rope_kv_write_ref,
        rms_norm_ref,
    )
    from atlas.kernels.fused_ops_triton import (
        ACT_SILU,
        act_and_mul_triton,
        qk_norm_rope_kv_write_triton,
        rms_norm_triton,
    )

    out = [compare("layer rms_norm", rms_norm_triton(t["x"], t["w"], 1e-6), rms_norm_ref(t["x"], t["w"], 1e-6), stats)]
    got = rms_norm_triton(t["x"], t["w"], 1e-6, residual=t["residual"])
    ref = add_rms_norm_ref(t["x"], t["residual"], t["w"], 1e-6)
    out += [compare("layer add_rms_norm", got[0], ref[0], stats),
            compare("layer add_rms_norm residual", got[1], ref[1], stats)]
    args = (t["qkv"], t["positions"], t["cos"], t["sin"], t["heads"], t["kv_heads"], t["head_dim"], t["qw"], t["kw"],
            1e-6, t["head_dim"], True)
    cache_got, cache_ref = t["kv"].clone(), t["kv"].clone()
    q_got = qk_norm_rope_kv_write_triton(*args, cache_got, t["slots"])
    q_ref = qk_norm_rope_kv_write_ref(*args, cache_ref, t["slots"])
    q_max = q_ref.float().abs().amax(-1, keepdim=True).expand(q_ref.shape)
    k_max = cache_ref[0].float().abs().amax(-1, keepdim=True).expand(cache_ref[0].shape)
    out += [compare("layer qk_norm_rope q", q_got, q_ref, stats, noise=q_max, carry=q_max),
            compare("layer qk_norm_rope k cache", cache_got[0], cache_ref[0], stats, noise=k_max, carry=k_max),
            compare("layer qk_norm_rope v cache", cache_got[1], cache_ref[1], stats)]
    gate, up = t["gate_up"].float().chunk(2, dim=-1)
    out.append(compare("layer silu_and_mul", act_and_mul_triton(t["gate_up"], ACT_SILU),
                       act_and_mul_ref(t["gate_up"], "silu"), stats, noise=(gate * up).abs()))
    return out


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of |v| (float32 values) in `dtype` (bf16 or fp16; subnormals included)."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).smallest_normal
    _, exp = torch.frexp(v.abs().clamp(min=tiny))
    return torch.ldexp(torch.ones_like(v), exp - 1 - mantissa)


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, stats: dict, noise: torch.Tensor | None = None,
            carry: torch.Tensor | None = None) -> str | None:
    """None if `got` matches `ref`, else what is wrong.

    fp32: |got - ref| <= 2e-6 (|ref| + noise). bf16/fp16: at most 1% of the elements differ by more than
    2e-6 noise (the float32 rounding noise of a formula that cancels, e.g. the tail of 1 + tanh(u)), and
    none by more than 2 ulps of the value (a last-bit difference before the final rounding can carry
    through it) + 2e-6 noise + one ulp of `carry` (a last-bit difference before a cancelling sum, e.g.
    RoPE's x cos - y sin, measured at the size of the operands).
    """
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{name}: got {tuple(got.shape)} {got.dtype}, expected {tuple(ref.shape)} {ref.dtype}"
    got32, ref32 = got.float(), ref.float()
    diff = (got32 - ref32).abs()
    s = stats.setdefault(name.split(" [")[0], {"elements": 0, "unequal": 0, "over_1ulp": 0})
    s["elements"] += diff.numel()
    s["unequal"] += int((diff != 0).sum())
    if not torch.isfinite(got32).all():
        return f"{name}: non-finite values"
    noise = torch.zeros_like(ref32) if noise is None else noise.float()
    if ref.dtype == torch.float32:
        bound = 2e-6 * (ref32.abs() + noise)
    else:
        ulp = _ulp(torch.maximum(got32.abs(), ref32.abs()), ref.dtype)
        s["over_1ulp"] += int((diff > ulp).sum())
        bound = 2 * ulp + 2e-6 * noise
        if carry is not None:
            bound = bound + _ulp(carry.float(), ref.dtype)
    bad = diff > bound
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        return (f"{name}: {int(bad.sum())} of {diff.numel()} elements off (first: got {float(got32.flatten()[i])!r}, "
                f"expected {float(ref32.flatten()[i])!r})")
    unequal = float((diff > 2e-6 * noise).float().mean()) if diff.numel() else 0.0
    if ref.dtype != torch.float32 and unequal > 0.01:
        return f"{name}: {unequal:.2%} of elements not bit-equal"
    return None


def run_norm(case: dict) -> list[str | None]:
    from atlas.kernels.fused_ops import add_rms_norm_ref, rms_norm_ref
    from atlas.kernels.fused_ops_triton import rms_norm_triton

    stats = case["stats"]
    x, r, w, eps = case["x"], case["residual"], case["weight"], case["eps"]
    out = [compare("rms_norm", rms_norm_triton(x, w, eps), rms_norm_ref(x, w, eps), stats)]
    got, got_res = rms_norm_triton(x, w, eps, residual=r)
    ref, ref_res = add_rms_norm_ref(x, r, w, eps)
    out += [compare("add_rms_norm residual", got_res, ref_res, stats), compare("add_rms_norm", got, ref, stats)]
    return out


def run_qk(case: dict) -> list[str | None]:
    from atlas.kernels.fused_ops import qk_norm_rope_kv_write_ref
    from atlas.kernels.fused_ops_triton import qk_norm_rope_kv_write_triton

    stats = case["stats"]
    args = {k: v for k, v in case.items() if k != "stats"}
    cache_ref, cache_got = args["kv_cache"].clone(), args["kv_cache"].clone()
    q_ref = qk_norm_rope_kv_write_ref(**{**args, "kv_cache": cache_ref})
    q_got = qk_norm_rope_kv_write_triton(**{**args, "kv_cache": cache_got})

    def head_max(t):  # the size of the operands of each head's rotation
        return t.float().abs().amax(-1, keepdim=True).expand(t.shape)

    q_max, k_max = head_max(q_ref), head_max(cache_ref[0])
    return [compare("qk_norm_rope q", q_got, q_ref, stats, noise=q_max, carry=q_max),
            compare("qk_norm_rope k cache", cache_got[0], cache_ref[0], stats, noise=k_max, carry=k_max),
            compare("qk_norm_rope v cache", cache_got[1], cache_ref[1], stats)]


def run_act(case: dict) -> list[str | None]:
    from atlas.kernels.fused_ops import ACT_KINDS as KINDS
    from atlas.kernels.fused_ops import act_and_mul_ref, triton_act_code
    from atlas.kernels.fused_ops_triton import act_and_mul_triton

    x = case["x"]
    gate, up = x.float().chunk(2, dim=-1)
    if case["kind"] in ("clamped_swiglu", "limited_silu"):  # (against kernels/moe.py's PyTorch ops)
        from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU
        from atlas.kernels.moe import clamped_swiglu, limited_silu_and_mul

        swiglu = case["kind"] == "clamped_swiglu"
        got = act_and_mul_triton(x, ACT_CLAMPED_SWIGLU if swiglu else ACT_LIMITED_SILU, **CLAMPS)
        ref = clamped_swiglu(x, **CLAMPS) if swiglu else limited_silu_and_mul(x, CLAMPS["limit"])
        return [compare(f"act_and_mul {case['kind']}", got, ref, case["stats"], noise=(gate * up).abs())]
    code = triton_act_code(KINDS[case["kind"]])
    return [compare(f"act_and_mul {case['kind']}", act_and_mul_triton(x, code), act_and_mul_ref(x, case["kind"]),
                    case["stats"], noise=(gate * up).abs())]


def run_qk_fp8_cache(case: dict) -> list[str | None]:
    """The prologue into an 8-bit cache (--kv-cache-dtype fp8): each path (reference, kernel) stores
    exactly what it stores into a cache of the activations' dtype, cast to 8 bits and saturated
    (paged_attention_ref.to_cache_dtype), and leaves padding rows' slots as they were. Every other case
    scales its rows past the 8-bit range, to reach the saturation."""
    from atlas.kernels.fused_ops import qk_norm_rope_kv_write_ref
    from atlas.kernels.fused_ops_triton import qk_norm_rope_kv_write_triton
    from atlas.kernels.paged_attention_ref import load_rows, store_rows, to_cache_dtype

    args = {k: v for k, v in case.items() if k != "stats"}
    if args["slot_mapping"].numel() % 2:
        args["qkv"] = args["qkv"] * 300
    fp8 = torch.float8_e4m3fn
    # Compared row by row (an 8-bit cache keeps its V plane transposed within each page: paged_attention_ref).
    cache = args["kv_cache"]
    slots = torch.arange(cache.shape[1] * cache.shape[2], device=cache.device)

    def rows(kv: torch.Tensor) -> torch.Tensor:
        return torch.stack([to_cache_dtype(load_rows(kv, plane, slots), fp8).view(torch.uint8) for plane in (0, 1)])

    problems = []
    for name, fn in (("reference", qk_norm_rope_kv_write_ref), ("kernel", qk_norm_rope_kv_write_triton)):
        wide, narrow = cache.clone(), torch.zeros(cache.shape, dtype=fp8, device=cache.device)
        for plane in (0, 1):
            store_rows(narrow, plane, slots, load_rows(cache, plane, slots))
        q_wide = fn(**{**args, "kv_cache": wide})
        q_narrow = fn(**{**args, "kv_cache": narrow})
        got, want = rows(narrow), rows(wide)
        if not torch.equal(got, want):
            bad = int((got != want).sum())
            problems.append(f"qk_norm_rope fp8 cache ({name}): {bad} of {narrow.numel()} bytes differ")
        if not torch.equal(q_narrow, q_wide):
            problems.append(f"qk_norm_rope fp8 cache ({name}): q depends on the cache's dtype")
    return problems or [None]


def _mla_args(case: dict) -> dict:
    args = {k: v for k, v in case.items() if k != "stats"}
    return {**args, "rotary_dim": args["kv_a"].shape[1] - args["norm_weight"].shape[0]}


def _mla_triton(args: dict):
    from atlas.kernels.fused_ops_triton import mla_prologue_triton

    return mla_prologue_triton(**{k: v for k, v in args.items() if k != "rotary_dim"})


def run_mla(case: dict) -> list[str | None]:
    from atlas.kernels.fused_ops import mla_prologue_ref

    stats, args = case["stats"], _mla_args(case)
    latent = args["norm_weight"].shape[0]
    cache_ref, cache_got = args["cache"].clone(), args["cache"].clone()
    q_ref = mla_prologue_ref(**{**args, "cache": cache_ref})
    q_got = _mla_triton({**args, "cache": cache_got})

    def head_max(t):  # the size of the operands of each head's rotation
        return t.float().abs().amax(-1, keepdim=True).expand(t.shape)

    k_max = head_max(cache_ref[..., latent:])
    return [compare("mla_prologue q_pe", q_got, q_ref, stats, noise=head_max(q_ref), carry=head_max(q_ref)),
            compare("mla_prologue latent", cache_got[..., :latent], cache_ref[..., :latent], stats),
            compare("mla_prologue k_pe", cache_got[..., latent:], cache_ref[..., latent:], stats, noise=k_max,
                    carry=k_max)]


def run_mla_fp8_cache(case: dict) -> list[str | None]:
    """MLA's prologue into an 8-bit latent cache: each path stores what it stores into a cache of the activations'
    dtype, cast to 8 bits and saturated (paged_attention_ref.to_cache_dtype), padding rows' slots untouched, and
    its q_pe does not depend on the cache. Every other case scales its rows past the 8-bit range."""
    from atlas.kernels.fused_ops import mla_prologue_ref
    from atlas.kernels.paged_attention_ref import to_cache_dtype

    args = _mla_args(case)
    if args["slot_mapping"].numel() % 2:
        args["kv_a"], args["q"] = args["kv_a"] * 300, args["q"] * 300
    fp8 = torch.float8_e4m3fn
    problems = []
    for name, fn in (("reference", mla_prologue_ref), ("kernel", _mla_triton)):
        wide, narrow = args["cache"].clone(), to_cache_dtype(args["cache"], fp8)
        q_wide = fn({**args, "cache": wide}) if fn is _mla_triton else fn(**{**args, "cache": wide})
        q_narrow = fn({**args, "cache": narrow}) if fn is _mla_triton else fn(**{**args, "cache": narrow})
        got, want = narrow.view(torch.uint8), to_cache_dtype(wide, fp8).view(torch.uint8)
        if not torch.equal(got, want):
            problems.append(f"mla_prologue fp8 cache ({name}): {int((got != want).sum())} of {got.numel()} bytes "
                            "differ")
        if not torch.equal(q_narrow, q_wide):
            problems.append(f"mla_prologue fp8 cache ({name}): q_pe depends on the cache's dtype")
    return problems or [None]


def interpreter_rounds_bf16() -> bool:
    """Make Triton's CPU interpreter round float32 -> bfloat16 (and -> float8 e4m3) casts to nearest even,
    as the GPU does (the interpreter truncates), so that bf16 cases can be checked on CPU. False if it
    cannot."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        convert_float = interpreter._convert_float
    except (ImportError, AttributeError):
        return False
    if getattr(convert_float, "rounds_bf16", False):
        return True

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:  # (the 8-bit KV cache: also truncated)
            t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert_float(data, input_dtype, output_dtype, rounding_mode)

    convert.rounds_bf16 = True
    interpreter._convert_float = convert
    return True


def _describe(kind: str, case: dict) -> str:
    if kind == "qk":
        return (f"T={case['qkv'].shape[0]} Hq={case['num_heads']} Hkv={case['num_kv_heads']} D={case['head_dim']} "
                f"rot={case['rotary_dim']} neox={case['is_neox']} norm={case['q_norm_weight'] is not None} "
                f"pad={int((case['slot_mapping'] < 0).sum())}")
    if kind == "norm":
        return f"T={case['x'].shape[0]} H={case['x'].shape[1]} row_stride={case['x'].stride(0)}"
    if kind == "mla":
        return (f"T={case['q'].shape[0]} H={case['num_heads']} P={case['nope_dim']} "
                f"L={case['norm_weight'].shape[0]} R={case['kv_a'].shape[1] - case['norm_weight'].shape[0]} "
                f"neox={case['is_neox']} kv_stride={case['kv_a'].stride(0)} "
                f"pad={int((case['slot_mapping'] < 0).sum())}")
    return f"T={case['x'].shape[0]} I={case['x'].shape[1] // 2} {case['kind']}"


def check(device: str, dtype: torch.dtype, seeds, max_tokens: int = 300, stats: dict | None = None,
          layer_tokens: tuple[int, ...] = ()) -> list[str]:
    """Failures (empty when every case agrees) of each kernel on each seed, and of a Qwen3-8B-shaped
    layer at each of `layer_tokens` tokens."""
    stats = {} if stats is None else stats
    failures = []
    for tokens in layer_tokens:
        for problem in run_layer(layer_inputs(tokens, device, dtype), stats):
            if problem:
                failures.append(f"{dtype} Qwen3-8B layer, T={tokens}: {problem}")
    for seed in seeds:
        for kind, make, run in (("norm", norm_case, run_norm), ("qk", qk_case, run_qk), ("act", act_case, run_act),
                                ("qk", qk_case, run_qk_fp8_cache), ("mla", mla_case, run_mla),
                                ("mla", mla_case, run_mla_fp8_cache)):
            if kind == "mla" and seed >= MLA_SEEDS:
                continue
            case = make(seed, device, dtype, max_tokens)
            case["stats"] = stats
            for problem in run(case):
                if problem:
                    failures.append(f"{dtype} seed {seed} [{_describe(kind, case)}] {problem}")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n", type=int, nargs="?", default=24, help="number of seeds")
    p.add_argument("--dtypes", default=None, help="comma-separated (default: float32,bfloat16,float16)")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--layer-tokens", default=None,
                   help="token counts of the Qwen3-8B-shaped layer check (default: 1,7,64,512,8200 on CUDA, 2 on CPU)")
    p.add_argument("--qk-large-tile-tokens", type=int, default=None,
                   help="use the prologue's prefill tile from this many tokens on (to test it on small cases)")
    args = p.parse_args(argv)
    if args.qk_large_tile_tokens is not None:
        from atlas.kernels import fused_ops_triton

        fused_ops_triton.QK_LARGE_TILE_TOKENS = args.qk_large_tile_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.dtypes or "float32,bfloat16,float16"
    # (called whatever the dtypes: it also makes the interpreter round float8 casts, for the 8-bit cache cases)
    if os.environ.get("TRITON_INTERPRET") == "1" and not interpreter_rounds_bf16() and "bfloat16" in names:
        print("this Triton's interpreter truncates bf16 casts: bfloat16 skipped")
        names = ",".join(n for n in names.split(",") if n != "bfloat16")
    layer = args.layer_tokens or ("1,7,64,512,8200" if device == "cuda" else "2")
    layer_tokens = tuple(int(n) for n in layer.split(",") if n)
    problems = []
    for name in names.split(","):
        dtype = getattr(torch, name)
        stats: dict = {}
        problems += check(device, dtype, range(args.n), args.max_tokens, stats, layer_tokens)
        for op, s in stats.items():
            print(f"{name} {op}: {s['unequal']} of {s['elements']} elements not bit-equal"
                  + ("" if dtype == torch.float32 else f", {s['over_1ulp']} more than one ulp off"))
    print("\n".join(problems) or f"{args.n} cases agree ({device}, {names})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
