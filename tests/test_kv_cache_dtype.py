"""--kv-cache-dtype fp8: K and V kept as 8-bit floats (e4m3, unscaled, saturating).

The oracle is transformers with its attention fed K and V rounded the same way (a registered attention
function), in float32 on the CPU: Atlas's logits with an 8-bit cache must match those, and differ from
the unrounded model's. The Triton kernels run in the interpreter against the references (the prologue's
8-bit stores, attention over an 8-bit cache); the engine keeps its invariants with such a cache: greedy
tokens do not depend on batching, preemption, prefix caching or speculation, and every page comes back.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_KV, assert_pages_returned, run_in_triton_interpreter
from test_models import atlas_logits

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
ARCHS = ["Qwen3ForCausalLM", "LlamaForCausalLM"]


def _round_to_cache(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(FP8).to(x.dtype)


def _attention_over_rounded_kv(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, _round_to_cache(key), _round_to_cache(value), attention_mask,
                                  **kwargs)


def hf_logits(path, token_ids: list[int], rounded_kv: bool) -> torch.Tensor:
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("rounded_kv_fp8", _attention_over_rounded_kv)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="rounded_kv_fp8" if rounded_kv else "sdpa").eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def fp8_llms(checkpoints):
    return {arch: LLM(str(checkpoints[arch]), kv_cache_memory="8MiB", block_size=8, kv_cache_dtype="fp8")
            for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_cache_logits_match_transformers_over_rounded_kv(arch, checkpoints, fp8_llms):
    """Chunked prefill then decode steps, all reading K/V back from the 8-bit pages."""
    ids = torch.randint(0, 384, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    got = atlas_logits(fp8_llms[arch], ids, [17, 20, 9] + [1] * 14)
    torch.testing.assert_close(got, hf_logits(checkpoints[arch], ids, rounded_kv=True), rtol=1e-4, atol=1e-4)
    # ...and the rounding is real: the model over unrounded K/V scores otherwise.
    assert (got - hf_logits(checkpoints[arch], ids, rounded_kv=False)).abs().max() > 1e-3


def test_fp8_cache_is_8_bit_and_holds_more_tokens(qwen3_dir, fp8_llms):
    fp8 = fp8_llms["Qwen3ForCausalLM"].engine
    wide = LLM(str(qwen3_dir), kv_cache_memory="8MiB", block_size=8).engine
    assert all(c.dtype == FP8 for c in fp8.runner.kv_caches)
    assert all(c.dtype == torch.float32 for c in wide.runner.kv_caches)  # (float32 on the CPU)
    assert fp8.runner.page_bytes * 4 == wide.runner.page_bytes
    assert fp8.kv.num_pages >= 4 * wide.kv.num_pages - 4  # the same bytes hold four times the pages


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    base = torch.randint(1, 384, (30,), generator=g).tolist()
    # Shared prefixes (prefix-cache hits) and repeats (n-gram drafts that get accepted).
    return [(base[: 8 + 3 * i] + torch.randint(1, 384, (5 + 4 * i,), generator=g).tolist()) * (1 + i % 2)
            for i in range(n)]


def test_fp8_cache_greedy_is_unchanged_by_batching_preemption_prefix_caching_and_speculation(qwen3_dir):
    prompts = _prompts(8)
    alone = LLM(str(qwen3_dir), kv_cache_memory="16MiB", kv_cache_dtype="fp8", enable_prefix_caching=False)
    expected = [alone.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts]
    # Few pages (preemption), a small token budget (chunked prefill beside decodes), prefix caching on.
    tight = LLM(str(qwen3_dir), num_gpu_blocks_override=22, block_size=8, max_num_batched_tokens=40,
                max_model_len=160, max_num_seqs=6, kv_cache_dtype="fp8")
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.stats.hits > 0  # (the shared prefixes were read from cached 8-bit pages)
    assert_pages_returned(tight)
    spec = LLM(str(qwen3_dir), kv_cache_memory="16MiB", kv_cache_dtype="fp8", speculative="ngram", speculative_policy="always",
               num_draft_tokens=3)
    outs = spec.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(spec)


def test_fp8_cache_refuses_an_unknown_dtype():
    # (caches without an 8-bit path, DSA's and DeepSeek-V4's, are refused in test_mla_kv_cache_dtype.py)
    with pytest.raises(ConfigError, match="kv-cache-dtype must be one of"):
        LLM(kv_cache_dtype="int8")


def test_fp8_cache_keeps_v_transposed_within_each_page():
    """The 8-bit layout the kernels read: K rows as in any cache, V as [pages, kv heads, dim, page] (keys
    contiguous, for the attention kernel's P.V), written by the reference at the places the kernel reads."""
    from atlas.kernels.paged_attention_ref import load_rows, write_kv_cache

    pages, page, heads, dim = 3, 16, 2, 8
    cache = torch.zeros(2, pages, page, heads, dim, dtype=FP8)
    key, value = torch.randn(2, 5, heads, dim).unbind(0)
    slots = torch.tensor([0, 17, 31, 40, 5])
    write_kv_cache(cache, key, value, slots)
    k_rows = cache[0].reshape(pages * page, heads, dim)[slots]
    v_rows = cache[1].view(torch.uint8).view(pages, heads, dim, page)[slots // page, :, :, slots % page]
    assert torch.equal(k_rows.float(), _round_to_cache(key))
    assert torch.equal(v_rows.view(FP8).float(), _round_to_cache(value))
    assert torch.equal(load_rows(cache, 1, slots).float(), _round_to_cache(value))


def test_fp8_cache_kernels_in_the_interpreter():
    """Attention over an 8-bit cache (unsplit and split-KV; float32 and bf16 queries) in Triton's
    interpreter against the reference. (The prologue's 8-bit stores run in test_fused_ops's interpreter
    cases.)"""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    # (7 cases: unsplit prefill and decode rows, split decode (seed 3); the 8th, a 32-way split of 128-wide
    #  heads, took 8 s of the interpreter's 13)
    out = run_in_triton_interpreter("paged_attention_cases.py", "0", "0", "7")
    assert "7 fp8-cache cases agree (torch.float32)" in out, out
    assert "7 fp8-cache cases agree (torch.bfloat16)" in out, out  # (bf16 queries: the fp16 products)


# ---------------------------------------------------------------------------------------------------
# On a CUDA GPU (run through the device tool; CI has none)
# ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
def test_fp8_cache_kernels_on_cuda_match_the_references():
    from fused_ops_cases import qk_case, run_qk_fp8_cache
    from paged_attention_cases import check, fp8_case

    assert check("cuda", torch.bfloat16, range(40), fp8_case) == []
    for seed in range(24):
        assert run_qk_fp8_cache(qk_case(seed, "cuda", torch.bfloat16)) == [None], seed


@pytest.mark.cuda
@needs_cuda
def test_fp8_cache_on_cuda_equals_transformers_over_rounded_kv_and_keeps_speculation_lossless(qwen3_dir):
    """float32: greedy tokens equal transformers' over rounded K/V, graphs on and off; n-gram
    speculation (verify rows beside decode rows) gives plain decoding's tokens over the same 8-bit cache."""
    from conftest import hf_greedy
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("rounded_kv_fp8", _attention_over_rounded_kv)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, attn_implementation="rounded_kv_fp8")
    prompts = _prompts(6)
    expected = [hf_greedy(hf.eval(), p, 20) for p in prompts]
    for eager in (True, False):
        llm = LLM(str(qwen3_dir), dtype="float32", device="cuda", kv_cache_dtype="fp8", enforce_eager=eager,
                  kv_cache_memory=CUDA_KV, max_model_len=256)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"enforce_eager={eager}"
        assert all(c.dtype == FP8 for c in llm.engine.runner.kv_caches)
        assert_pages_returned(llm)
        del llm
    common = dict(dtype="float32", device="cuda", kv_cache_dtype="fp8", kv_cache_memory=CUDA_KV,
                  max_model_len=256)
    plain = LLM(str(qwen3_dir), **common)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    del plain
    spec = LLM(str(qwen3_dir), speculative="ngram", speculative_policy="always", num_draft_tokens=3, **common)
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert got == want
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(spec)
