"""--kv-cache-dtype fp8 for MLA: the latent row [c | k_pe] kept as 8-bit floats (e4m3, unscaled, saturating at
+-448, as the GQA cache).

The oracle is the same model whose latent rows are rounded that way before they reach a full-width cache: an
8-bit cache must give its logits (the same arithmetic on the same values), and differ from the unrounded model's
by about one e4m3 rounding. The Triton kernel runs in the interpreter against the reference over an 8-bit cache;
the engine keeps its invariants with one: greedy tokens do not depend on prefix caching, chunking, preemption or
MTP speculation, every page comes back, and the same memory holds twice the pages of a bf16 cache. DeepSeek sparse
attention rounds its indexer key with the row. What has no 8-bit path (DeepSeek-V4's cache) is refused at start-up,
before the checkpoint is read.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    CUDA_KV,
    _build,
    _correction_bias,
    assert_pages_returned,
    assert_tight_pool_gives,
    build_deepseek_checkpoint,
    run_in_triton_interpreter,
)
from test_models import atlas_logits

from atlas import LLM, SamplingParams
from atlas.bench.common import release
from atlas.errors import ConfigError
from atlas.kernels import fused_ops
from atlas.kernels.mla_attention_ref import mla_attention_ref, write_latent_cache
from atlas.layers.attention_backend import attention_backend
from atlas.layers.mla import MLACacheSpec

FP8 = torch.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: a stored value is off by at most 2^-4 of itself (round to nearest).
E4M3_ROUNDING = 2.0 ** -4
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _round(x: torch.Tensor) -> torch.Tensor:
    """x as an 8-bit cache holds it, back in x's dtype."""
    return x.clamp(-448, 448).to(FP8).to(x.dtype)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw})


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------- the pieces
def _paged_problem(seed: int, latent: int = 32, rope: int = 8, heads: int = 4, bs: int = 4, outlier: bool = False):
    """Latent rows of three requests (a prefill chunk over a cached prefix, a decode, a verify) scattered over
    pages, and their queries; `outlier`: the first row's first rope value past e4m3's range."""
    g = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = [40, 1, 4], [53, 9, 20]
    num_pages = sum(-(-s // bs) for s in seq_lens) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, used = torch.zeros(len(q_lens), 16, dtype=torch.int32), 0
    slots = []
    for b, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[b, :n] = torch.tensor(perm[used: used + n])
        slots += [perm[used + p // bs] * bs + p % bs for p in range(s)]
        used += n
    rows = len(slots)
    # Latents of a normed row (~1) with a few large values, rope keys wider.
    c = torch.randn(rows, latent, generator=g) * (1 + 3 * (torch.rand(rows, latent, generator=g) < 0.05))
    k_pe = 4 * torch.randn(rows, rope, generator=g)
    if outlier:
        k_pe[0, 0] = 1000.0
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q_latent = torch.randn(qsl[-1], heads, latent, generator=g) / latent ** 0.5
    q_pe = torch.randn(qsl[-1], heads, rope, generator=g) / rope ** 0.5
    return dict(c=c, k_pe=k_pe, slots=torch.tensor(slots), num_pages=num_pages, bs=bs, q_latent=q_latent,
                q_pe=q_pe, qsl=qsl, seq_lens=seq_lens, tables=tables, scale=(latent + rope) ** -0.5)


def test_the_latent_row_is_stored_rounded_and_saturated():
    p = _paged_problem(0, outlier=True)
    width = p["c"].shape[1] + p["k_pe"].shape[1]
    cache = torch.zeros(p["num_pages"], p["bs"], width, dtype=FP8)
    slots = p["slots"].clone()
    slots[5] = -1  # a padding row: not written
    write_latent_cache(cache, p["c"], p["k_pe"], slots)
    flat = cache.view(-1, width).float()
    want = _round(torch.cat([p["c"], p["k_pe"]], dim=-1))
    keep = slots >= 0
    assert torch.equal(flat[slots[keep]], want[keep])
    assert flat[slots[0], p["c"].shape[1]] == 448.0  # (1000 saturates, never NaN)
    assert not flat.isnan().any()
    assert torch.equal(flat[p["slots"][5]], torch.zeros(width))


def test_reference_attention_over_an_8bit_cache_is_attention_over_rounded_rows():
    """Against a float32 cache of the rounded rows: the same arithmetic (tight); against the unrounded rows: off by
    about one e4m3 rounding of the values (each weighted latent is off by at most 2^-4 of itself, and the scores
    move with the keys), so within twice that, and really off."""
    p = _paged_problem(1)
    shape = (p["num_pages"], p["bs"], p["c"].shape[1] + p["k_pe"].shape[1])
    caches = {"fp8": torch.zeros(shape, dtype=FP8), "rounded": torch.zeros(shape), "exact": torch.zeros(shape)}
    write_latent_cache(caches["fp8"], p["c"], p["k_pe"], p["slots"])
    write_latent_cache(caches["rounded"], _round(p["c"]), _round(p["k_pe"]), p["slots"])
    write_latent_cache(caches["exact"], p["c"], p["k_pe"], p["slots"])
    out = {k: mla_attention_ref(p["q_latent"], p["q_pe"], cache, p["qsl"], p["seq_lens"], p["tables"], p["scale"])
           for k, cache in caches.items()}
    torch.testing.assert_close(out["fp8"], out["rounded"], rtol=1e-6, atol=1e-6)
    err = _rel(out["fp8"], out["exact"])
    assert 1e-3 < err < 2 * E4M3_ROUNDING, err


def test_the_spec_counts_one_byte_a_value_and_the_backend_chooses_fp8():
    spec = MLACacheSpec(kv_lora_rank=512, rope_dim=64, num_heads=16)
    assert spec.bytes_per_token(FP8) == 576 and spec.bytes_per_token(torch.bfloat16) == 2 * 576
    backend = attention_backend([spec, spec], 16)
    assert backend.kind == "mla"
    assert backend.cache_dtype("fp8", torch.bfloat16) == FP8
    assert backend.cache_dtype("fp8_e4m3", torch.bfloat16) == FP8
    assert backend.bytes_per_token(FP8) * 2 == backend.bytes_per_token(torch.bfloat16)
    layout = spec.layout(3, 16, FP8)
    assert layout.shape == (3, 16, 576) and not layout.v_transposed  # (the row as it is: no layout change)


def test_mla_kernel_over_an_8bit_cache_in_the_interpreter():
    """The Triton kernel reading an e4m3 latent cache (decode, verify and prefill chunks over cached prefixes, split
    and unsplit, DeepSeek's 512 + 64 row) against the reference over the same cache, in float32."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    out = run_in_triton_interpreter("mla_attention_cases.py", "0", "14")
    assert "14 fp8-cache cases agree (torch.float32)" in out, out


# --------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def v2(deepseek_checkpoints):
    return deepseek_checkpoints["v2"]


def _rounding_writes(monkeypatch) -> None:
    """MLA layers that round their latent rows as an 8-bit cache does before storing them (in a full-width
    cache): the oracle of an 8-bit cache. (MLA layers write through fused_ops.mla_prologue, whose reference runs
    on the CPU.)"""
    real = fused_ops.write_latent_cache

    def rounded(cache, latent, k_pe, slot_mapping):
        real(cache, _round(latent), _round(k_pe), slot_mapping)

    monkeypatch.setattr(fused_ops, "write_latent_cache", rounded)


def _check_logits(path, monkeypatch) -> None:
    """Chunked prefill then decode steps, every one reading its prefix back from the 8-bit pages."""
    ids, chunks = _ids(60, 3), [17, 20, 9] + [1] * 14
    fp8 = _llm(path, kv_cache_dtype="fp8")
    assert all(c.dtype == FP8 for c in fp8.engine.runner.kv_caches if c.dim() == 3)
    got = atlas_logits(fp8, ids, chunks)
    exact = atlas_logits(_llm(path), ids, chunks)
    with monkeypatch.context() as m:
        _rounding_writes(m)
        rounded = atlas_logits(_llm(path), ids, chunks)
    torch.testing.assert_close(got, rounded, rtol=1e-5, atol=1e-5)
    # About one e4m3 rounding away from the unrounded model (measured 0.046 for v2), and really away.
    err = _rel(got, exact)
    assert 1e-3 < err < 2 * E4M3_ROUNDING, err


def test_fp8_cache_logits_are_the_model_over_rounded_latents(v2, monkeypatch):
    _check_logits(v2, monkeypatch)


def test_fp8_cache_plans_twice_the_pages_of_bf16(v2):
    bf16 = _llm(v2, dtype="bfloat16").engine
    fp8 = _llm(v2, dtype="bfloat16", kv_cache_dtype="fp8").engine
    assert all(c.dtype == FP8 for c in fp8.runner.kv_caches)
    assert all(c.dtype == torch.bfloat16 for c in bf16.runner.kv_caches)
    assert fp8.runner.page_bytes * 2 == bf16.runner.page_bytes
    assert 2 * bf16.kv.num_pages - 2 <= fp8.kv.num_pages <= 2 * bf16.kv.num_pages + 2  # twice the pages...
    wide, narrow = (sum(c.nbytes for c in e.runner.kv_caches) for e in (bf16, fp8))
    assert abs(wide - narrow) <= 2 * bf16.runner.page_bytes  # ...in the same bytes


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 384, (40,), generator=g).tolist()
    return [shared + torch.randint(1, 384, (int(k),), generator=g).tolist() for k in torch.randint(1, 30, (n,), generator=g)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def test_fp8_cache_greedy_is_unchanged_by_prefix_caching_chunking_and_preemption(v2):
    prompts = _prompts(8)
    # Alone: no prefix cache, whole prefills, room for everything.
    alone = _llm(v2, kv_cache_dtype="fp8", enable_prefix_caching=False, kv_cache_memory="16MiB")
    expected = _greedy(alone, prompts)
    assert_pages_returned(alone)
    # Prefix caching on: after the first request, the shared 40-token prefix is read from cached 8-bit pages.
    cached = _llm(v2, kv_cache_dtype="fp8", kv_cache_memory="16MiB")
    assert _greedy(cached, prompts[:1]) + _greedy(cached, prompts[1:]) == expected
    assert cached.engine.kv.stats.hits >= 7
    again = cached.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
    assert again.num_cached_tokens >= 40 and again.outputs[0].token_ids == expected[3]
    assert_pages_returned(cached)
    # Chunked prefills (32-token steps) beside decodes, without a prefix cache.
    chunked = _llm(v2, kv_cache_dtype="fp8", enable_prefix_caching=False, max_num_batched_tokens=32, max_num_seqs=6)
    assert _greedy(chunked, prompts) == expected
    assert_pages_returned(chunked)
    # All of it at once: 20 pages of 8 tokens for 8 requests of up to 93 tokens force preemption.
    tight = _llm(v2, kv_cache_dtype="fp8", num_gpu_blocks_override=20, max_num_batched_tokens=32, max_model_len=96,
                 max_num_seqs=6)
    assert _greedy(tight, prompts) == expected
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.kv.stats.hits > 0
    assert_pages_returned(tight)


def test_mtp_speculation_over_an_fp8_cache_is_lossless(tmp_path_factory):
    """DeepSeek-V3's MTP module (a 5-token vocabulary: its drafts are often right) drafts over its own latent cache
    (the model dtype, as every drafter's) beside the target's 8-bit one: greedy tokens equal plain decoding over the
    same 8-bit cache, under chunked prefill, prefix-cache hits and forced preemption."""
    from spec_stats import TINY_VOCAB

    path = build_deepseek_checkpoint(tmp_path_factory.mktemp("mtp-fp8"), "v3", seed=4, vocab_size=TINY_VOCAB)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, TINY_VOCAB, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(0, TINY_VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 20, (8,), generator=g)]
    expected = _greedy(_llm(path, kv_cache_dtype="fp8", enable_prefix_caching=False), prompts)
    spec = _llm(path, kv_cache_dtype="fp8", speculative="mtp", speculative_policy="always", num_draft_tokens=3,
                num_gpu_blocks_override=22, max_num_batched_tokens=32, max_model_len=72, max_num_seqs=6)
    assert _greedy(spec, prompts) == expected
    stats = spec.engine.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.kv.stats.hits > 0
    assert all(c.dtype == FP8 for c in spec.engine.runner.kv_caches)
    assert all(c.dtype == torch.float32 for c in spec.engine.proposer.kv_caches)  # (the drafter's: the model dtype)
    assert_pages_returned(spec)


def test_longcat_latent_caches_in_8_bits_beside_its_token_history(tmp_path_factory, monkeypatch):
    """LongCat-Flash (two MLA sublayers a layer) with n-gram embeddings: its latent caches in 8 bits, its token-id
    history (no attention reads it) int32 as always; logits those of the model over rounded latents."""
    from test_longcat import LONGCAT
    from test_longcat_ngram import _ngram_checkpoint

    root = tmp_path_factory.mktemp("longcat-fp8")
    path = _ngram_checkpoint(_build(root, "longcat", LONGCAT, None, 0, {}, randomize=_correction_bias),
                             root / "ngram")
    caches = _llm(path, kv_cache_dtype="fp8").engine.runner.kv_caches
    assert [c.dtype for c in caches] == [FP8] * (len(caches) - 1) + [torch.int32]
    _check_logits(path, monkeypatch)


# --------------------------------------------------------------------------- DeepSeek sparse attention
def test_dsa_reference_over_an_8bit_cache_is_dsa_over_rounded_rows():
    """A DSA row [c | k_pe | indexer key] rounded whole: the indexer selects over the rounded keys and attention
    reads the rounded latents, exactly as over a float32 cache of the rounded rows."""
    from atlas.kernels.dsa_attention_ref import dsa_attention_ref

    p = _paged_problem(3)
    g = torch.Generator().manual_seed(3)
    k_idx = torch.randn(p["c"].shape[0], 8, generator=g)
    q_idx = torch.randn(p["q_latent"].shape[0], 5, 8, generator=g)
    w_idx = torch.randn(p["q_latent"].shape[0], 5, generator=g)
    shape = (p["num_pages"], p["bs"], p["c"].shape[1] + p["k_pe"].shape[1] + 8)
    fp8, rounded = torch.zeros(shape, dtype=FP8), torch.zeros(shape)
    write_latent_cache(fp8, p["c"], torch.cat([p["k_pe"], k_idx], dim=-1), p["slots"])
    write_latent_cache(rounded, _round(p["c"]), _round(torch.cat([p["k_pe"], k_idx], dim=-1)), p["slots"])
    args = (p["q_latent"], p["q_pe"], q_idx, w_idx)
    rest = (p["qsl"], p["seq_lens"], p["tables"], p["scale"], 6, 8 ** -0.5)
    record_fp8, record_rounded = [], []
    got = dsa_attention_ref(*args, fp8, *rest, record=record_fp8)
    want = dsa_attention_ref(*args, rounded, *rest, record=record_rounded)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(record_fp8, record_rounded, strict=True))  # the same selections
    assert sum(int((~sel).sum()) for sel in record_fp8) > 0  # (and the top-k left rows out)


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    from test_dsa import V32

    return _build(tmp_path_factory.mktemp("dsa-fp8"), "v32", V32, None, 0, {}, randomize=_correction_bias)


def test_dsa_fp8_cache_logits_are_the_model_over_rounded_rows(v32, monkeypatch):
    """DeepSeek-V3.2 (every layer sparse): logits over chunks and decode steps are the model's with its latent rows
    and indexer keys rounded before a full-width cache (the DSA layer writes through its own import)."""
    from atlas.layers import dsa

    ids, chunks = _ids(60, 3), [17, 20, 9] + [1] * 14
    fp8 = _llm(v32, kv_cache_dtype="fp8")
    assert all(c.dtype == FP8 for c in fp8.engine.runner.kv_caches)
    got = atlas_logits(fp8, ids, chunks)
    with monkeypatch.context() as m:
        real = dsa.write_latent_cache
        m.setattr(dsa, "write_latent_cache", lambda cache, c, k, slots: real(cache, _round(c), _round(k), slots))
        rounded = atlas_logits(_llm(v32), ids, chunks)
    torch.testing.assert_close(got, rounded, rtol=1e-5, atol=1e-5)
    assert (got - atlas_logits(_llm(v32), ids, chunks)).abs().max() > 1e-3  # (the rounding is real)


def test_dsa_fp8_cache_greedy_is_unchanged_by_chunking_preemption_and_prefix_caching(v32):
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 384, (16,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 384, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 24, (6,), generator=g)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    roomy = _llm(v32, kv_cache_dtype="fp8", enable_prefix_caching=False, kv_cache_memory="16MiB")
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params)]
    tight = _llm(v32, kv_cache_dtype="fp8", num_gpu_blocks_override=12, max_num_batched_tokens=12, max_model_len=56,
                 max_num_seqs=4)
    assert_tight_pool_gives(tight, prompts, params, expected)
    assert_pages_returned(roomy)


# --------------------------------------------------------------------------- refusals
def _no_reading(monkeypatch) -> None:
    from atlas.models import loader

    def no_reading(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the refusal")

    monkeypatch.setattr(loader, "iterate_weights", no_reading)


def test_deepseek_v4_is_refused_naming_its_cache(tmp_path_factory, monkeypatch):
    from test_deepseek_v4 import V4, _randomize_buffers

    path = _build(tmp_path_factory.mktemp("v4-fp8"), "v4", V4, None, 0, {}, randomize=_randomize_buffers)
    _no_reading(monkeypatch)
    with pytest.raises(ConfigError, match=r"kv-cache-dtype fp8 .*DSV4CacheSpec \(DeepSeek-V4: .*not implemented in 8 "
                                          r"bits\).*drop the flag"):
        _llm(path, kv_cache_dtype="fp8")


# ---------------------------------------------------------------------------------------------------
# On a CUDA GPU (run through the device tool; CI has none)
# ---------------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_over_an_fp8_cache_matches_the_reference_on_cuda(dtype, no_tf32):
    """The kernel over an e4m3 cache (random steps, split and unsplit), then (bf16, the served dtype) DeepSeek-V3's
    128 heads over a 576-wide row in decode steps of 1 and 8 requests, against the float32 reference over the same
    8-bit cache."""
    from mla_attention_cases import fp8_case, run_case
    from paged_attention_cases import check, random_page_tables

    assert check("cuda", dtype, range(40), fp8_case, run_case) == []
    for num_reqs, splits in ((1, 1), (1, 32), (8, 1), (8, 4)) if dtype == torch.bfloat16 else ():
        g = torch.Generator().manual_seed(num_reqs)
        page, heads, latent, rope = 16, 128, 512, 64
        seq_lens = torch.randint(1, 3000, (num_reqs,), generator=g).tolist()
        tables = random_page_tables(seq_lens, page, g)
        pages_per = [-(-s // page) for s in seq_lens]
        cache = (2 * torch.randn(sum(pages_per), page, latent + rope, generator=g)).to(FP8)
        case = dict(q_latent=(torch.randn(num_reqs, heads, latent, generator=g) / latent ** 0.25).to("cuda", dtype),
                    q_pe=torch.randn(num_reqs, heads, rope, generator=g).to("cuda", dtype), cache=cache.cuda(),
                    qsl=list(range(num_reqs + 1)), seq_lens=seq_lens, page_tables=tables.cuda(),
                    scale=(128 + rope) ** -0.5, splits=splits)
        got, ref = run_case(case)
        assert (got - ref).abs().max().item() < 2e-2, (num_reqs, splits)


@pytest.mark.cuda
@needs_cuda
def test_latent_rows_stored_on_cuda_as_on_the_cpu():
    """write_latent_cache's CUDA path (no host sync: padding rows re-write the first valid row) stores what the CPU
    path stores, bit for bit, saturating included."""
    p = _paged_problem(2, outlier=True)
    width = p["c"].shape[1] + p["k_pe"].shape[1]
    slots = p["slots"].clone()
    slots[[3, 7]] = -1  # (padding rows; row 0, past e4m3's range, is stored)
    cpu = torch.zeros(p["num_pages"], p["bs"], width, dtype=FP8)
    write_latent_cache(cpu, p["c"], p["k_pe"], slots)
    gpu = torch.zeros_like(cpu, device="cuda")
    write_latent_cache(gpu, p["c"].cuda(), p["k_pe"].cuda(), slots.cuda())
    assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))
    assert not gpu.float().isnan().any() and gpu.float().max() == 448.0


@pytest.mark.cuda
@needs_cuda
def test_fp8_cache_on_cuda_equals_the_cpu_reference_with_graphs_and_mtp(deepseek_checkpoints, tmp_path_factory,
                                                                       no_tf32):
    """float32 DeepSeek-V2 over an 8-bit latent cache: greedy tokens on CUDA (the Triton kernel, eager and in CUDA
    graphs) equal the CPU's (the reference over the same 8-bit cache); DeepSeek-V3's MTP speculation on CUDA gives
    plain decoding's tokens over the same 8-bit cache."""
    from spec_stats import TINY_VOCAB

    common = dict(dtype="float32", device="cuda", kv_cache_dtype="fp8", kv_cache_memory=CUDA_KV,
                  max_model_len=256, skip_tokenizer_init=True)
    path = deepseek_checkpoints["v2"]
    prompts = _prompts(6)
    expected = _greedy(_llm(path, device="cpu", dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="16MiB"),
                       prompts)
    for eager in (True, False):
        llm = LLM(str(path), enforce_eager=eager, **common)
        assert all(c.dtype == FP8 for c in llm.engine.runner.kv_caches)
        assert _greedy(llm, prompts) == expected, f"enforce_eager={eager}"
        assert_pages_returned(llm)
        del llm
        release()  # (its pool given back before the next engine plans its own)
    path = build_deepseek_checkpoint(tmp_path_factory.mktemp("mtp-fp8-cuda"), "v3", seed=4, vocab_size=TINY_VOCAB)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TINY_VOCAB, (int(n),), generator=g).tolist() for n in (5, 17, 30, 9)]
    plain = LLM(str(path), **common)
    expected = _greedy(plain, prompts)
    del plain
    release()
    spec = LLM(str(path), speculative="mtp", speculative_policy="always", num_draft_tokens=3, **common)
    assert _greedy(spec, prompts) == expected
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(spec)
