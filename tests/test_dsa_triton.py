"""The Triton DeepSeek sparse attention kernels (kernels/dsa_attention_triton.py: indexer scores, device
top-k, sparse absorbed MLA) against the PyTorch reference (kernels/dsa_attention_ref.py):
dsa_attention_cases.py in Triton's CPU interpreter here, on CUDA at DeepSeek-V3.2's per-layer shapes in the
cuda tests; each kernel compiled for sm90."""

from __future__ import annotations

import pytest
import torch


def test_dsa_kernels_in_the_interpreter_match_the_reference():
    """Tiny steps mixing decodes, verifies and prefill chunks over a cached prefix, partial pages, contexts
    within and past index_topk, tied scores, a shared layer's reuse, an 8-bit cache: scores within float32
    rounding, selected sets exactly the reference's, outputs within rounding, and so over 2 and 4 splits of the
    selected rows (dsa_attention_cases.py)."""
    from conftest import run_in_triton_interpreter

    out = run_in_triton_interpreter("dsa_attention_cases.py", timeout=300)
    assert out.strip().endswith(", 0 failure(s)"), out


@pytest.mark.slow
def test_the_glm5_model_on_the_triton_path_in_the_interpreter_matches_transformers():
    """layers/dsa.py's Triton path (forced on, the kernels in the interpreter) in the tiny GLM-5 checkpoint:
    greedy tokens of three prompts past index_topk equal transformers', full layers recording index tensors
    that the shared layers reuse (dsa_attention_cases.py models)."""
    from conftest import run_in_triton_interpreter

    out = run_in_triton_interpreter("dsa_attention_cases.py", "models", timeout=600)
    assert " passed" in out and " failed" not in out, out


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv", "fp32"])
def test_the_dsa_kernels_compile_for_sm90(cache):
    """Both kernels compiled for the H200 on this CPU (triton_compile.py) at V3.2's shapes (64 indexer heads
    of 128, kv_lora_rank 512, rope 64, 16 and 128 heads, the attention unsplit, and in a decode step's 8 shares
    over a bf16 cache) with the wrappers' tiles and launch options: bf16
    queries over a bf16 and an 8-bit cache, and the fp32 (ieee) path; each within an SM's 227 KiB of shared
    memory."""
    from triton_compile import compiled_for_sm90

    from atlas.kernels import dsa_attention_triton as k

    fp32 = cache == "fp32"
    q = "*fp32" if fp32 else "*bf16"
    launches = [(k._dsa_index_scores_kernel, {"q_ptr": q, "w_ptr": "*fp32", "cache_ptr": f"*{cache}",
                                              "scores_ptr": "*fp32", "index_scale": "fp32"},
                 dict(KEY_OFFSET=576, PAGE=16, **k.index_scores_launch(64, 128, fp32)))]
    # (8 splits: a decode step's, writing float32 partials; compiled over the bf16 cache only, the others' loads
    #  being the unsplit kernel's: CI's cold Triton cache)
    for heads, splits in ((16, 1), (128, 1)) + (((128, 8),) if cache == "bf16" else ()):
        launches.append((k._dsa_sparse_mla_kernel,
                         {"ql_ptr": q, "qp_ptr": q, "cache_ptr": f"*{cache}", "out_ptr": q, "part_m_ptr": "*fp32",
                          "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "scale": "fp32"},
                         dict(PAGE=16, NUM_SPLITS=splits, **k.sparse_mla_launch(heads, 512, 64, fp32))))
    for kernel, ptrs, launch in launches:
        options = {key: launch.pop(key) for key in ("num_warps", "num_stages") if key in launch}
        compiled = compiled_for_sm90(kernel, ptrs, launch, **options)
        assert ".entry" in compiled.asm["ptx"], kernel.__name__
        assert compiled.metadata.shared <= 227 * 1024, (kernel.__name__, launch, compiled.metadata.shared)


def test_each_row_finds_its_request_and_position_on_the_device():
    """row_requests_and_positions from the step's device tensors: a request with no rows this step is skipped,
    and rows past the step's last (padding) see no key (position -1)."""
    pytest.importorskip("triton")
    from atlas.kernels.dsa_attention_triton import row_requests_and_positions

    qsl = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    req, pos = row_requests_and_positions(7, qsl, torch.tensor([10, 4, 2], dtype=torch.int32))
    assert req.tolist() == [0, 0, 0, 2, 2, 0, 0] and pos.tolist() == [7, 8, 9, 0, 1, -1, -1]


def test_the_dispatcher_takes_the_reference_off_cuda():
    """kernels/dsa_attention.py on CPU: the reference, from the step's host lists (and its masks as the
    record)."""
    from types import SimpleNamespace

    from atlas.kernels.dsa_attention import dsa_attention, use_triton
    from atlas.kernels.dsa_attention_ref import dsa_attention_ref

    g = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 4, 16 + 8 + 8, generator=g)
    tables = torch.tensor([[2, 0, 3], [1, 0, 0]], dtype=torch.int32)
    meta = SimpleNamespace(query_start_loc_cpu=[0, 3, 4], seq_lens_cpu=[10, 2], page_tables=tables)
    args = (torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 8, generator=g),
            torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, generator=g), cache)
    assert not use_triton(args[0])
    rec, rec_ref = [], []
    got = dsa_attention(*args, meta, 0.3, 4, 0.5, record=rec)
    want = dsa_attention_ref(*args, [0, 3, 4], [10, 2], tables, 0.3, 4, 0.5, record=rec_ref)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(rec, rec_ref, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dsa_kernels_on_cuda_match_the_reference():
    """The interpreter's tiny steps on CUDA in bf16 (dsa_attention_cases.py)."""
    from conftest import run_cases_script

    out = run_cases_script("dsa_attention_cases.py", timeout=600)
    assert out.strip().endswith(", 0 failure(s)"), out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dsa_kernels_on_cuda_at_deepseek_v32_shapes_match_the_reference():
    """DeepSeek-V3.2's per-layer shapes (kv_lora_rank 512, rope 64, index_head_dim 128, 64 indexer heads, 16
    of the 128 heads, index_topk 2048, pages of 16) in bf16: decodes at 1K-8K, a verify, a 96-row chunk over a
    2K prefix and a 300-row first chunk; exact-score steps (every selection the reference's), a random-score
    one, and an 8-bit cache (dsa_attention_cases.py v32)."""
    from conftest import run_cases_script

    out = run_cases_script("dsa_attention_cases.py", "v32", timeout=600)
    assert out.strip().endswith(", 0 failure(s)"), out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
def test_v32_on_cuda_replays_a_graph_per_context_bound(tmp_path):
    """The tiny V3.2 checkpoint with dense MLPs on the GPU, float32 (the routed experts' grouped matmul, which graphs
    need, takes bf16 only): decode steps replay CUDA graphs captured per batch size and bound on the step's context
    (the indexer's scores and top-k that wide, contexts across several bounds): transformers' greedy tokens;
    n-gram verify steps from graphs too, the plain tokens."""
    from conftest import CUDA_KV, _build, _correction_bias
    from test_dsa import GREEDY, V32, check_greedy_matches_transformers

    from atlas import LLM, SamplingParams

    dense = dict(V32, first_k_dense_replace=V32["num_hidden_layers"])
    path = _build(tmp_path, "v32", dense, None, 0, {}, randomize=_correction_bias)
    kw = dict(device="cuda", dtype="float32", kv_cache_memory=CUDA_KV, block_size=8, max_model_len=192,
              skip_tokenizer_init=True, max_num_seqs=8)
    llm = LLM(str(path), **kw)
    graphs = llm.engine.runner.step_graphs[1]
    assert graphs.graphs and graphs.context_buckets[0] == V32["index_topk"]
    check_greedy_matches_transformers(path, llm, GREEDY)
    assert graphs.steps_run > 0
    prompt = torch.randperm(383, generator=torch.Generator().manual_seed(7))[:160].add(1).tolist()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    spec = LLM(str(path), speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
               ngram_max=3, **kw)
    assert spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == plain
    assert spec.engine.runner.step_graphs[4].steps_run > 0
