"""The fused elementwise ops (kernels/fused_ops.py, kernels/fused_ops_triton.py).

- CPU: each `*_ref` against the unfused formulas it replaces, bit for bit in fp32, bf16 and fp16:
  Hugging Face transformers' own modules where it has them (LlamaRMSNorm, apply_rotary_pos_emb,
  ACT2FN), the pre-fusion Atlas formulas otherwise (interleaved and partial RoPE, which HF's Llama does
  not have), and paged_attention_ref.write_kv_cache for the cache. (The atlas/layers modules now call
  the fused ops, so they are no longer an independent oracle.)
- CPU: the Triton kernels in Triton's interpreter (a subprocess, TRITON_INTERPRET=1) against the
  references, on random cases from fused_ops_cases.py.
- CUDA (marked `cuda`, skipped without a GPU): the same cases on the GPU in fp32, bf16 and fp16, the
  public functions inside a CUDA graph, and no recompilation when the number of tokens changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import compiled_variants, run_in_triton_interpreter
from fused_ops_cases import rope_tables

from atlas.kernels import fused_ops
from atlas.kernels.fused_ops import (
    act_and_mul,
    act_and_mul_ref,
    add_rms_norm,
    add_rms_norm_ref,
    qk_norm_rope_kv_write,
    qk_norm_rope_kv_write_ref,
    rms_norm,
    rms_norm_ref,
)
from atlas.kernels.paged_attention_ref import write_kv_cache

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------------------------------
# The oracle: the unfused formulas
# ---------------------------------------------------------------------------------------------------

def _hf_rms_norm(weight: torch.Tensor, eps: float):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = LlamaRMSNorm(weight.shape[0], eps).to(weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    return m


def _rotate_unfused(x, cos, sin, rotary_dim: int, is_neox: bool):
    """RoPE as atlas/layers/rotary.py computed it before the fusion (cos/sin already in x.dtype)."""
    rot, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        rotated = rot * cos2 + torch.cat([-x2, x1], dim=-1) * sin2
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, passthrough], dim=-1)


def _unfused_attention_prologue(qkv, positions, cos_cache, sin_cache, q_norm, k_norm, num_heads, num_kv_heads,
                                head_dim, rotary_dim, is_neox, kv_cache, slot_mapping):
    """LlamaAttention.forward from qkv_proj's output to the cache write, as it was before the fusion."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    if is_neox and rotary_dim == head_dim:  # Hugging Face's own rope
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = torch.cat([cos, cos], -1).squeeze(1), torch.cat([sin, sin], -1).squeeze(1)  # [T, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    else:
        q, k = _rotate_unfused(q, cos, sin, rotary_dim, is_neox), _rotate_unfused(k, cos, sin, rotary_dim, is_neox)
    write_kv_cache(kv_cache, k, v, slot_mapping)
    return q


def _act_unfused(name: str):
    """Gated activations: HF's ACT2FN, except gelu_new, which Atlas computes as PyTorch's tanh gelu."""
    from transformers.activations import ACT2FN

    act = (lambda x: F.gelu(x, approximate="tanh")) if name == "gelu_new" else ACT2FN[name]

    def gated(x):
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return gated


# ---------------------------------------------------------------------------------------------------
# The references against the oracle (CPU); on CPU the public functions are the references
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [72, 200, 256])
def test_rms_norm_refs_equal_the_unfused_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(3, 5, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(3, 5, hidden, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    norm = _hf_rms_norm(weight, 1e-6)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, weight, 1e-6), norm(x))
        out, new_residual = add_rms_norm_ref(x, residual, weight, 1e-6)
        assert torch.equal(new_residual, residual + x)  # the decoder layer's `x = x + attn(...)`
        assert torch.equal(out, norm(residual + x))
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    for a, b in zip(add_rms_norm(x, residual, weight, 1e-6), (out, new_residual), strict=True):
        assert torch.equal(a, b)


def _prologue_problem(dtype, head_dim, partial, mscale, qk_norm, tokens=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, page = 6, 2, 8
    rotary_dim = int(head_dim * partial)
    cos, sin = rope_tables(rotary_dim, 512, mscale=mscale)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(tokens, width, generator=g) * 2 + 0.3).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    num_pages = -(-tokens // page) + 2
    slots = torch.randperm(num_pages * page, generator=g)[:tokens]
    kv_cache = torch.randn(2, num_pages, page, num_kv_heads, head_dim, generator=g).to(dtype)
    weights = [(1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2)] if qk_norm else None
    return dict(qkv=qkv, positions=positions, cos=cos, sin=sin, weights=weights, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, kv_cache=kv_cache,
                slots=slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,partial,mscale,qk_norm", [
    (32, 1.0, 1.0, True),  # Qwen3
    (16, 1.0, 1.1386, True),  # Qwen3 with YaRN (cos/sin scaled)
    (24, 0.5, 1.0, False),  # partial rotary
    (64, 1.0, 1.0, False),  # Llama
])
def test_attention_prologue_ref_equals_the_unfused_layers(dtype, is_neox, head_dim, partial, mscale, qk_norm):
    p = _prologue_problem(dtype, head_dim, partial, mscale, qk_norm)
    norms = [_hf_rms_norm(w, 1e-6) for w in p["weights"]] if qk_norm else [None, None]
    expected_cache = p["kv_cache"].clone()
    with torch.no_grad():
        expected = _unfused_attention_prologue(p["qkv"], p["positions"], p["cos"], p["sin"], *norms, p["num_heads"],
                                               p["num_kv_heads"], head_dim, p["rotary_dim"], is_neox,
                                               expected_cache, p["slots"])
    args = (p["qkv"], p["positions"], p["cos"], p["sin"], p["num_heads"], p["num_kv_heads"], head_dim,
            *(p["weights"] or [None, None]), 1e-6, p["rotary_dim"], is_neox)
    for fn in (qk_norm_rope_kv_write_ref, qk_norm_rope_kv_write):
        cache = p["kv_cache"].clone()
        q = fn(*args, cache, p["slots"])
        assert q.shape == (p["qkv"].shape[0], p["num_heads"], head_dim) and q.is_contiguous()
        assert torch.equal(q, expected)
        assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_embedding_is_the_prologues_rope(dtype, is_neox, partial):
    """layers/rotary.RotaryEmbedding (forward and the batched `rotate`) and the attention prologue's reference
    rotate through one function (fused_ops.apply_rope): bit for bit the unfused formula (HF's rotate_half where
    it applies), and a batch of no rows or no heads keeps its head_dim."""
    from transformers.models.llama.modeling_llama import rotate_half

    from atlas.config import RopeConfig
    from atlas.layers.rotary import RotaryEmbedding

    head_dim = 32
    emb = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0, partial_rotary_factor=partial), 64, 64,
                          is_neox_style=is_neox)
    g = torch.Generator().manual_seed(int(partial * 10) + is_neox)
    for rows, heads in ((7, 3), (0, 3), (7, 0)):
        positions = torch.randint(0, 64, (rows,), generator=g)
        q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
        k = torch.randn(rows, 2, head_dim, generator=g).to(dtype)
        cos = emb.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = emb.sin_cache[positions].unsqueeze(1).to(dtype)
        got_q, got_k = emb(positions, q, k)
        for got, x in ((got_q, q), (got_k, k), (emb.rotate(positions, q), q)):
            want = _rotate_unfused(x, cos, sin, emb.rotary_dim, is_neox)
            assert got.shape == x.shape and got.dtype == dtype and torch.equal(got, want)
        if is_neox and partial == 1.0:
            assert torch.equal(got_q, q * torch.cat([cos, cos], -1) + rotate_half(q) * torch.cat([sin, sin], -1))
        batched = emb.rotate(positions.expand(2, -1), q.expand(2, -1, -1, -1))
        assert torch.equal(batched, torch.stack([got_q, got_q]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("pad", ["some", "all"])
def test_mla_prologue_ref_equals_the_unfused_layer(dtype, is_neox, pad):
    """MLA's prologue reference against the layer's unfused ops (HF's RMSNorm on the latent, the rope dims rotated,
    the row [c | k_pe] stored at each valid slot and no other): bit for bit, q_pe contiguous."""
    from fused_ops_cases import mla_case

    from atlas.kernels.fused_ops import mla_prologue, mla_prologue_ref

    case = mla_case(5 if is_neox else 1, "cpu", dtype, max_tokens=19)
    slots = case["slot_mapping"].clone()
    if pad == "all":
        slots[:] = -1
    heads, nope, latent = case["num_heads"], case["nope_dim"], case["norm_weight"].shape[0]
    rope = case["kv_a"].shape[1] - latent
    t = case["q"].shape[0]
    cos = case["cos_cache"][case["positions"]].unsqueeze(1).to(dtype)
    sin = case["sin_cache"][case["positions"]].unsqueeze(1).to(dtype)
    want_q = _rotate_unfused(case["q"].view(t, heads, nope + rope)[..., nope:], cos, sin, rope, case["is_neox"])
    with torch.no_grad():
        c = _hf_rms_norm(case["norm_weight"], case["eps"])(case["kv_a"][:, :latent])
    k_pe = _rotate_unfused(case["kv_a"][:, None, latent:], cos, sin, rope, case["is_neox"])[:, 0]
    want_cache = case["cache"].clone()
    valid = slots >= 0
    want_cache.view(-1, latent + rope)[slots[valid]] = torch.cat([c, k_pe], dim=-1)[valid]
    args = {**case, "slot_mapping": slots, "rotary_dim": rope}
    for fn in (mla_prologue_ref, mla_prologue):
        cache = case["cache"].clone()
        got = fn(**{**args, "cache": cache})
        assert got.shape == (t, heads, rope) and got.is_contiguous()
        assert torch.equal(got, want_q)
        assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("pad", ["some", "all", "none"])
def test_attention_prologue_ref_skips_negative_slots(pad):
    p = _prologue_problem(torch.bfloat16, 32, 1.0, 1.0, True, tokens=17, seed=1)
    slots = p["slots"].clone()
    valid = {"some": torch.rand(17, generator=torch.Generator().manual_seed(2)) > 0.3,
             "all": torch.zeros(17, dtype=torch.bool), "none": torch.ones(17, dtype=torch.bool)}[pad]
    slots[~valid] = -1
    args = (p["qkv"], p["positions"], p["cos"], p["sin"], 6, 2, 32, *p["weights"], 1e-6, 32, True)
    cache = p["kv_cache"].clone()
    q = qk_norm_rope_kv_write_ref(*args, cache, slots)
    # Expected: every row's q; only the valid rows' K/V, every other slot untouched.
    full = qk_norm_rope_kv_write_ref(*args, p["kv_cache"].clone(), p["slots"])
    expected_cache = p["kv_cache"].clone()
    rows = torch.arange(17)[valid]
    qk_norm_rope_kv_write_ref(p["qkv"][rows], p["positions"][rows], *args[2:], expected_cache, slots[rows])
    assert torch.equal(q, full)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(fused_ops.ACT_KINDS))
def test_act_and_mul_ref_equals_the_unfused_activation(dtype, name):
    g = torch.Generator().manual_seed(len(name))
    x = (torch.randn(4, 3, 2 * 200, generator=g) * 3).to(dtype)
    if name == "gelu_tanh":  # our own name for it
        expected = _act_unfused("gelu_pytorch_tanh")(x)
    else:
        expected = _act_unfused(name)(x)
    assert torch.equal(act_and_mul_ref(x, name), expected)
    assert torch.equal(act_and_mul(x, name), expected)
    if name == "silu":
        assert torch.equal(fused_ops.silu_and_mul(x), expected)
    if name == "gelu_pytorch_tanh":
        assert torch.equal(fused_ops.gelu_tanh_and_mul(x), expected)


def test_unknown_activation_is_a_clear_error():
    with pytest.raises(ValueError, match="relu2.*not supported"):
        act_and_mul(torch.zeros(2, 4), "relu2")


# ---------------------------------------------------------------------------------------------------
# The Triton kernels against the references
# ---------------------------------------------------------------------------------------------------

def test_fused_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    out = run_in_triton_interpreter("fused_ops_cases.py", "6", "--max-tokens", "6", "--layer-tokens", "1,4", "--qk-large-tile-tokens", "4")
    assert "6 cases agree" in out, out


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels_on_cuda_match_references(dtype):
    from fused_ops_cases import check

    stats: dict = {}
    problems = check("cuda", dtype, range(60), stats=stats, layer_tokens=(1, 7, 64, 512, 8200))
    assert problems == [], "\n".join(problems[:20])


def _layer_ops(t: dict) -> tuple[torch.Tensor, ...]:
    h = rms_norm(t["x"], t["w"], 1e-6)
    q = qk_norm_rope_kv_write(t["qkv"], t["positions"], t["cos"], t["sin"], t["heads"], t["kv_heads"],
                              t["head_dim"], t["qw"], t["kw"], 1e-6, t["head_dim"], True, t["kv"], t["slots"])
    out, res = add_rms_norm(t["x"], t["residual"], t["w"], 1e-6)
    act = act_and_mul(t["gate_up"], "silu")
    return h, q, out, res, act


@pytest.mark.cuda
@needs_cuda
def test_fused_ops_replay_in_a_cuda_graph():
    from fused_ops_cases import layer_inputs

    static = layer_inputs(24, "cuda", torch.bfloat16)
    _layer_ops(static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _layer_ops(static)
    fresh = layer_inputs(24, "cuda", torch.bfloat16, seed=1)
    for k, v in fresh.items():
        if isinstance(v, torch.Tensor):
            static[k].copy_(v)
    graph.replay()
    expected = _layer_ops(fresh)
    for got, want in zip(outs, expected, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(static["kv"], fresh["kv"])


@pytest.mark.cuda
@needs_cuda
def test_no_recompilation_when_the_batch_changes():
    from fused_ops_cases import layer_inputs

    from atlas.kernels import fused_ops_triton as k

    kernels = [k._rms_norm_kernel, k._qk_norm_rope_kv_kernel, k._act_and_mul_kernel]
    # Warm-up: one small and one large step (the prologue has a decode tile and a prefill tile).
    _layer_ops(layer_inputs(5, "cuda", torch.bfloat16))
    _layer_ops(layer_inputs(k.QK_LARGE_TILE_TOKENS + 3, "cuda", torch.bfloat16))
    before = [compiled_variants(f) for f in kernels]
    if None in before:
        pytest.skip("this Triton does not expose its kernel cache")
    for tokens in (1, 2, 3, 8, 16, 33, 64, 128, 255, 256, 257, 512, 1000):
        _layer_ops(layer_inputs(tokens, "cuda", torch.bfloat16))
    assert [compiled_variants(f) for f in kernels] == before


@pytest.mark.cuda
@needs_cuda
def test_mla_prologue_replays_in_a_cuda_graph_without_recompiling():
    """The MLA prologue captured in a CUDA graph writes what an eager call writes for new inputs, and one compiled
    variant serves every token count."""
    from fused_ops_cases import mla_case

    from atlas.kernels import fused_ops_triton as k
    from atlas.kernels.fused_ops import mla_prologue

    def call(c):
        return mla_prologue(c["q"], c["kv_a"], c["positions"], c["cos_cache"], c["sin_cache"], c["norm_weight"],
                            c["eps"], c["num_heads"], c["nope_dim"], c["kv_a"].shape[1] - c["norm_weight"].shape[0],
                            c["is_neox"], c["cache"], c["slot_mapping"])

    static, fresh = (mla_case(0, "cuda", torch.bfloat16, max_tokens=24) for _ in range(2))
    for key in ("q", "kv_a", "positions", "slot_mapping"):  # (the same shapes; new values)
        fresh[key] = fresh[key][torch.randperm(fresh[key].shape[0], device="cuda")]
    fresh["q"] = fresh["q"] * 1.5
    call(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(static)
    for key in ("q", "kv_a", "positions", "slot_mapping", "cache"):
        static[key].copy_(fresh[key])
    graph.replay()
    expected_cache = fresh["cache"].clone()
    expected = call({**fresh, "cache": expected_cache})
    assert torch.equal(out, expected) and torch.equal(static["cache"], expected_cache)
    before = compiled_variants(k._mla_prologue_kernel)
    if before is None:
        pytest.skip("this Triton does not expose its kernel cache")
    for seed in range(120, 1000, 120):  # (seed 0's layout: 16 heads, P 128, R 64, L 512; 1-300 tokens)
        call(mla_case(seed, "cuda", torch.bfloat16, max_tokens=300))
    assert compiled_variants(k._mla_prologue_kernel) == before
