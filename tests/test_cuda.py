"""The same comparisons on a CUDA GPU: the Triton attention kernel, bf16 models against transformers,
CUDA-graph decode against eager, batching / prefix caching / speculation invariance, and the memory
plan. Skipped without a GPU; run on the GPU machine with `python -m pytest -m cuda tests/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, CUDA_KV, assert_pages_returned, compiled_variants, hf_model
from paged_attention_cases import captured_decode_step, check

from atlas import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_tf32")]

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_paged_attention_matches_reference(dtype):
    assert check("cuda", dtype, range(60)) == []


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 384, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_and_greedy_tokens_against_transformers(arch, checkpoints):
    path = checkpoints[arch]
    llm = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    prompts = _prompts(6, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 32
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1: -1].float()
        # Teacher-forced on Atlas's tokens: each one is the fp32 reference's argmax, up to bf16 noise.
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)
        gap = logits.max(-1).values - chosen
        assert float(gap.max()) < 0.05 * float(logits.std()), gap
    assert_pages_returned(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_on_cuda_equals_transformers_generate(arch, checkpoints):
    path = checkpoints[arch]
    llm = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    prompt = _prompts(1, seed=2)[0]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids == expected


def test_graphs_batching_preemption_prefix_caching_and_speculation_never_change_fp32_greedy(qwen3_dir):
    prompts = _prompts(12, seed=3) + [[5, 6, 7, 8] * 6, [9, 10, 11] * 9]
    common = dict(dtype="float32", device="cuda", max_model_len=160)
    reference = LLM(str(qwen3_dir), enforce_eager=True, enable_prefix_caching=False, kv_cache_memory=CUDA_KV,
                    **common)
    expected = [reference.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts]
    variants = [
        dict(kv_cache_memory=CUDA_KV),  # CUDA graphs, batched
        dict(num_gpu_blocks_override=30, block_size=8, max_num_batched_tokens=48, max_num_seqs=6),
        dict(kv_cache_memory=CUDA_KV, speculative="ngram", speculative_policy="always", num_draft_tokens=4, ngram_min=1),
    ]
    for kwargs in variants:
        llm = LLM(str(qwen3_dir), **common, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs
        again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
        assert again.outputs[0].token_ids == expected[0]
        assert_pages_returned(llm)
    assert llm.engine.stats.spec_num_accepted_tokens > 0


def test_memory_plan_holds_under_load(qwen3_dir):
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(str(qwen3_dir), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.25, max_model_len=512,
              max_num_seqs=64)
    plan = llm.engine.plan
    assert plan.device == "cuda" and plan.num_pages > 0
    torch.cuda.reset_peak_memory_stats()
    prompts = _prompts(100, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=64, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    assert torch.cuda.max_memory_reserved() <= 0.25 * total * 1.02
    assert_pages_returned(llm)


def test_kv_cache_memory_sets_the_pool_whatever_the_utilization(qwen3_dir):
    """--kv-cache-memory on a GPU: exactly that many bytes of pages, even where --gpu-memory-utilization's share
    (here 0.01 of the GPU, less than the weights and activations) would leave none; the engine serves."""
    llm = LLM(str(qwen3_dir), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.01, kv_cache_memory="64MiB",
              max_model_len=512, max_num_seqs=8)
    plan = llm.engine.plan
    assert plan.num_pages == (64 << 20) // plan.page_bytes and plan.source.startswith("--kv-cache-memory")
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(4, seed=5)], GREEDY)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert_pages_returned(llm)


def test_no_kernel_compiles_once_serving(qwen3_dir):
    """After one warm-up request (a prefill, then decodes), steps of every other shape (chunked prompts mixed
    with decode rows, batches of 1-16) reuse the compiled attention and layer kernels: the per-step tensors
    are 16-byte aligned and page-table rows a multiple of 16, so no Triton variant (a ~0.6 s compile that
    stalls every request) first appears mid-serve."""
    from atlas.kernels import fused_ops_triton as fused
    from atlas.kernels import gemv_triton
    from atlas.kernels import paged_attention_triton as attention

    kernels = [attention._paged_attention_kernel, fused._rms_norm_kernel, fused._qk_norm_rope_kv_kernel,
               fused._act_and_mul_kernel, gemv_triton._gemv_sum_kernel]
    llm = LLM(str(qwen3_dir), dtype="bfloat16", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=512,
              max_num_batched_tokens=96, max_num_seqs=16)
    llm.generate({"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    before = [compiled_variants(k) for k in kernels]
    if None in before:
        pytest.skip("this Triton does not expose its kernel cache")
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(24, seed=7)], GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert [compiled_variants(k) for k in kernels] == before
    assert_pages_returned(llm)


# --------------------------------------------------------------------------------------------------
# Split-KV decode attention and the small-M GEMV
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_kv_attention_matches_reference(dtype):
    from paged_attention_cases import split_case

    assert check("cuda", dtype, range(48), split_case) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_kv_attention_merged_by_its_last_split_matches_reference(dtype):
    """The attention_fused_combine knob's kernel: the last split of each program merges the partials (an atomic
    count a program and KV head, set back to 0), with and without sinks, against the reference."""
    from paged_attention_cases import fused_split_case
    from sink_attention_cases import run_sink_case, with_sinks

    assert check("cuda", dtype, range(48), fused_split_case) == []
    assert check("cuda", dtype, range(24), lambda seed, dev, dt: with_sinks(fused_split_case(seed, dev, dt), seed),
                 run_sink_case) == []


@pytest.mark.parametrize("fused_combine", [False, True])
@pytest.mark.parametrize("window", [None, 100])
def test_split_kv_attention_inside_a_cuda_graph(window, fused_combine):
    """A captured decode step (as StepGraphs captures them: static buffers, program map preset) replayed
    for sequence lengths the capture never saw, short ones leaving splits empty (split-KV: the default); with
    the attention_fused_combine knob the replays share one set of counts, which a replay that left them other than
    0 would leave unmerged (the next replay's outputs stale)."""
    from atlas.config import TuningConfig
    from atlas.kernels import settings
    from atlas.kernels.paged_attention import num_kv_splits, paged_attention, sm_count
    from atlas.kernels.paged_attention_ref import paged_attention_ref

    dev, dtype = "cuda", torch.bfloat16
    B, kv_heads, group, D, page, max_len = 2, 8, 4, 128, 16, 1200
    assert num_kv_splits(B, kv_heads, sm_count(torch.cuda.current_device())) > 1
    g = torch.Generator().manual_seed(0)
    per_seq = -(-max_len // page)
    num_pages = B * per_seq + 3
    kv = torch.randn(2, num_pages, page, kv_heads, D, generator=g).to(dev, dtype)
    tables = torch.randperm(num_pages, generator=g)[: B * per_seq].view(B, per_seq).to(dev, torch.int32)
    q = torch.zeros(B, kv_heads * group, D, dtype=dtype, device=dev)
    scale = D ** -0.5
    settings.set_kernel_settings(TuningConfig(attention_fused_combine=fused_combine))
    try:
        step = captured_decode_step(lambda meta: paged_attention(q, kv, meta, scale, True, window), B, tables, page,
                                    dev)
        for lens in ([1, 7], [33, 300], [max_len, 515], [64, 1]):
            step.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
            q.copy_(torch.randn(q.shape, generator=g).to(dtype))
            step.graph.replay()
            torch.cuda.synchronize()
            ref = paged_attention_ref(q.float(), kv.float(), list(range(B + 1)), lens, tables, scale, True, window)
            err = (step.out.float() - ref).abs().max().item()
            assert err < 2e-2, (lens, err)
    finally:
        settings.set_kernel_settings(TuningConfig())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_matches_reference(dtype):
    from gemv_cases import check as check_gemv

    assert check_gemv("cuda", dtype, range(60)) == []


def test_gemv_on_model_shapes_tuned_and_forced():
    """Decode-sized projections (Qwen3-8B's), bf16, M = 1..8 against float32 F.linear; the load-time
    measurement records a choice per shape, and mode 1 (--tuning gemv=1) routes every shape through the GEMV."""
    import torch.nn.functional as F

    from atlas.kernels import gemv
    from atlas.kernels.gemv_triton import gemv_triton
    from atlas.layers.embedding import linear_weights
    from atlas.layers.linear import Linear

    g = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList([Linear(4096, 6144), Linear(4096, 4096, bias=True), Linear(12288, 4096)])
    for p in model.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.02).to("cuda", torch.bfloat16)
    try:
        results = gemv.tune_shapes(linear_weights(model), "auto")
        assert set(results) == {(6144, 4096, torch.bfloat16), (4096, 4096, torch.bfloat16),
                                (4096, 12288, torch.bfloat16)}
        assert all(t > 0 for _, times in results.values() for t in times.values())
        # The default on an H100/H200: one fixed config for every shape, nothing timed.
        assert torch.cuda.get_device_capability() < gemv.DEFAULT_MIN_CAPABILITY or (
            gemv.tune_shapes(linear_weights(model), "default") == {}
            and all(gemv.choice(*shape) == gemv.DEFAULT_CONFIG for shape in results))
        gemv.tune_shapes(linear_weights(model), "1")
        assert all(gemv.choice(*shape) is not None for shape in results)
        model.requires_grad_(False)  # (autograd-tracked calls stay with F.linear)
        for layer in model:
            for m in range(1, 9):
                x = torch.randn(m, layer.in_features, generator=g).to("cuda", torch.bfloat16)
                ref = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
                got = layer(x)
                cfg = gemv.choice(layer.out_features, layer.in_features, torch.bfloat16)
                if cfg.kind == "sum" and m > gemv.SUM_MAX_ROWS:  # (cuBLAS takes those rows)
                    assert torch.equal(got, F.linear(x, layer.weight, layer.bias))
                else:
                    assert torch.equal(got, gemv_triton(x, layer.weight, layer.bias, cfg.block_n, cfg.block_k,
                                                        cfg.num_warps, cfg.num_stages, cfg.kind))  # the GEMV ran
                assert got.dtype == torch.bfloat16
                assert (got.float() - ref).abs().max().item() < 2e-2 * (1 + ref.abs().max().item())
    finally:
        gemv.reset()


def test_token_mask_kernel_matches_the_pytorch_path():
    """The Triton grammar-mask kernel against the sampler's PyTorch path on the device (bit-equal), and
    the sampler really dispatches to it (the default; --tuning mask_kernel=0 keeps the PyTorch path): the
    caller's logits untouched, in place when asked."""
    from token_mask_cases import case, check

    from atlas.runtime import sampler

    assert check("cuda", range(60)) == []
    t = case(5, "cuda")
    before = t["logits"].clone()
    expected = sampler._apply_token_bitmask_torch(t["logits"], t["bitmask"], t["rows"])
    assert torch.equal(sampler.apply_token_bitmask(t["logits"], t["bitmask"], t["rows"]), expected)
    assert torch.equal(t["logits"], before)
    assert sampler.apply_token_bitmask(t["logits"], t["bitmask"], t["rows"], inplace=True) is t["logits"]
    assert torch.equal(t["logits"], expected)
    assert not sampler._MASK_KERNEL_BROKEN  # it ran, with no fallback to PyTorch


GEMV_FP32 = dict(dtype="float32", device="cuda", max_model_len=160, kv_cache_memory=CUDA_KV)


def _cublas_eager_fp32_greedy(qwen3_dir, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of the prompts decoded together, cuBLAS everywhere, eager, float32: the GEMV tests'
    reference."""
    reference = LLM(str(qwen3_dir), enforce_eager=True, tuning={"gemv": "0"}, **GEMV_FP32)
    return [o.outputs[0].token_ids for o in reference.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def test_gemv_rows_knob_keeps_fp32_greedy_tokens(qwen3_dir):
    """The tensor-core GEMV on 2-16 rows (the gemv_rows knob: the prompts decoded together, n-gram verify steps),
    under CUDA graphs, gives the greedy tokens of cuBLAS eager (fp32)."""
    from atlas.kernels import gemv

    prompts = _prompts(4, seed=6)
    try:
        expected = _cublas_eager_fp32_greedy(qwen3_dir, prompts)
        llm = LLM(str(qwen3_dir), tuning={"gemv_rows": "4:dot-n16k256w4s4;16:dot-n32k128w4s6"},
                  speculative="ngram", speculative_policy="always", **GEMV_FP32)  # (verify steps wherever n-grams match)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
        assert got == expected  # (decode steps of 2-4 rows: the first tile)
        # one at a time: n-gram verify steps of K + 1 = 5 rows (the second tile)
        assert [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts] == expected
        assert llm.engine.stats.spec_num_verify_steps > 0
    finally:
        gemv.reset()


def test_gemv_forced_keeps_fp32_greedy_tokens(qwen3_dir):
    """The GEMV on every shape, under CUDA graphs, gives the greedy tokens of cuBLAS eager (fp32)."""
    from atlas.kernels import gemv
    from atlas.layers.embedding import linear_weights

    prompts = _prompts(4, seed=5)
    try:
        expected = _cublas_eager_fp32_greedy(qwen3_dir, prompts)
        llm = LLM(str(qwen3_dir), tuning={"gemv": "1"}, **GEMV_FP32)
        assert gemv.choice(*next(iter(linear_weights(llm.engine.runner.model)))) is not None
        got = [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts]
        assert got == expected
    finally:
        gemv.reset()


def test_gemv_prefetch_keeps_bf16_greedy_tokens_bit_for_bit(qwen3_dir):
    """The gemv_prefetch knob (the one-row GEMV's first weight tile loaded before the PDL wait) sums the same
    products in the same order: in bf16, one request at a time (every decode step through the one-row GEMV), under
    CUDA graphs with PDL, the greedy tokens equal the knob off's."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=9)]
    common = dict(dtype="bfloat16", device="cuda", kv_cache_memory=CUDA_KV, max_model_len=512)

    def one_at_a_time(llm):
        return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]

    want = one_at_a_time(LLM(str(qwen3_dir), **common))
    assert one_at_a_time(LLM(str(qwen3_dir), tuning={"gemv_prefetch": True}, **common)) == want
