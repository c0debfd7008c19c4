"""The Triton kernels, run by Triton's CPU interpreter against their PyTorch references, so that CI
(which has no GPU) checks the same kernel code the GPU runs. test_cuda.py runs them for real."""

from __future__ import annotations

import re

import pytest
from conftest import run_in_triton_interpreter

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")


def test_paged_attention_kernel_in_the_interpreter():
    """All step kinds unsplit (30 cases), then decode steps through split-KV and the combine kernel
    (12 cases: 2 to 32 splits, some of them empty; GQA groups, page sizes, windows)."""
    out = run_in_triton_interpreter("paged_attention_cases.py", "30", "12", timeout=900)
    assert "30 cases agree" in out
    assert "12 split-KV cases agree" in out


def test_split_attention_merged_by_its_last_split_in_the_interpreter():
    """The attention_fused_combine knob: split-KV decode cases (2 to 32 splits, some empty) whose last split of each
    program merges the partials itself, with and without sinks, against the reference; every count back at 0."""
    out = run_in_triton_interpreter("paged_attention_cases.py", "0", "0", "0", "8")
    assert "8 split-KV cases merged in the kernel agree, with and without sinks" in out


def test_gemv_kernel_in_the_interpreter():
    """y = x @ W^T for M = 1..8, N and K off the block sizes, with and without bias, every config."""
    out = run_in_triton_interpreter("gemv_cases.py", "16")  # (16 seeds: every config, row count, N and K)
    assert "16 GEMV cases agree" in out


def test_moe_kernels_in_the_interpreter():
    """The routed-expert matmuls in both modes (pairs: 1-4 tokens, up to 6 choices, gate|up and down
    inputs; grouped: experts without rows and with 17-40, int32 and int64 offsets), N and K off the
    blocks, against the float32 reference; then FusedExperts' Triton path against its grouped-GEMM path
    at 1-30 tokens (fp32 both modes, bf16 pairs, fp16 grouped: moe_cases.py says why); the fused pairs kernels
    (gate|up with the activation, down with the routing weights' sum and bias, pairs of weight 0 skipped) and the
    one-kernel router choice against their references, and the gate|up kernel that makes that choice itself against
    the two apart; the weights' sum of a token's rows and the one-program sort of the pairs by expert (exactly the
    stable argsort's order)."""
    out = run_in_triton_interpreter("moe_cases.py", "16", "6")
    assert ("16 MoE kernel cases, the fused pairs cases, 16 routing cases, 10 routed gate|up cases, 6 FusedExperts "
            "cases, the combine and the sort cases agree") in out


def test_pairs_tiles_knob_is_checked_when_the_kernels_take_it():
    """The moe_pairs_tiles knob ("gate_up:nNkKwWsS;down:nNkKwWsS", either part) parses to the pairs wrappers' tile
    arguments; a bad part is a ConfigError naming it when the kernels take the settings (at engine start), and the
    settings stay as they were. (That FusedExperts hands the knob's tiles to both kernels: moe_cases.py.)"""
    from atlas.config import ConfigError, TuningConfig
    from atlas.kernels import settings
    from atlas.kernels.moe_triton import parse_pairs_tiles

    assert parse_pairs_tiles("") == {}
    assert parse_pairs_tiles("gate_up:n8k1024w4s2; down:n2k512w8s1") == {
        "gate_up": dict(block_n=8, block_k=1024, num_warps=4, num_stages=2),
        "down": dict(block_n=2, block_k=512, num_warps=8, num_stages=1)}
    before = settings.tuning
    for bad, why in (("down:n4k256", "is not gate_up:nNkKwWsS"), ("up:n4k256w4s3", "is not gate_up:nNkKwWsS"),
                     ("down:n3k256w4s3", "powers of two"), ("down:n4k16w4s3", "k from 32"),
                     ("gate_up:n1k256w4s3", "gate_up's n from 2"), ("down:n4k256w4s0", "s at least 1")):
        with pytest.raises(ConfigError, match=re.escape(why)):
            settings.set_kernel_settings(TuningConfig(moe_pairs_tiles=bad))
        assert settings.tuning is before


def test_grouped_expert_kernel_row_chunks_follow_the_rows_per_expert():
    """The grouped expert kernel's BLOCK_M: the moe_grouped_block_m knob; at 0 (the default), 16 at decode sizes,
    growing with the mean rows per expert to 128 at prefill sizes (each chunk reads the expert's weights once), for
    MXFP4 weights with 8x the mean rows; a bad knob is a ConfigError. At 128 it compiles for sm90 within a program's
    shared memory, for bf16, FP8 and MXFP4 weights (MXFP4 in both decodes, the bf16 pairs also with the scales'
    fold); so do its form that reads and writes
    rows by index and the one-kernel sum of a token's rows (moe_grouped_gather), with the activation as gate|up's
    epilogue (moe_grouped_act), and the one-program sort of the pairs by expert (moe_expert_sort)."""
    pytest.importorskip("triton")
    from triton_compile import compile_for_sm90, compiled_for_sm90

    from atlas.config import ConfigError, TuningConfig
    from atlas.kernels import moe_triton, settings
    from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU
    from atlas.kernels.moe_triton import grouped_block_m

    before = settings.tuning
    try:
        assert TuningConfig().moe_grouped_block_m == 0  # (the default, measured: by the rows per expert)
        settings.set_kernel_settings(TuningConfig(moe_grouped_block_m=0))
        assert [grouped_block_m(rows, 128) for rows in (1, 64 * 8, 128 * 17, 128 * 40, 8192 * 8)] == [
            16, 16, 32, 64, 128]
        # MXFP4 weights (each chunk decodes them again): 8x the mean rows, within 16..128; gpt-oss-20b's 32 experts,
        # top-4, at 1, 4, 64 and 256 tokens and a 2,048-token prefill
        assert [grouped_block_m(t * 4, 32, mxfp4=True) for t in (1, 4, 64, 256, 2048)] == [16, 16, 64, 128, 128]
        settings.set_kernel_settings(TuningConfig(moe_grouped_block_m=16))
        assert grouped_block_m(8192 * 8, 128) == 16 == grouped_block_m(256 * 4, 32, mxfp4=True)
        settings.set_kernel_settings(TuningConfig(moe_grouped_block_m=32))
        assert grouped_block_m(8192 * 8, 128) == 32
    finally:
        settings.set_kernel_settings(before)
    with pytest.raises(ConfigError, match="moe_grouped_block_m"):
        TuningConfig(moe_grouped_block_m=48)
    with pytest.raises(ConfigError, match="moe_pairs_max_tokens"):  # (the unsorted-pairs kernels: up to 4 tokens)
        TuningConfig(moe_pairs_max_tokens=5)
    for w, s, fmt in (("*bf16", "*bf16", dict(FP8=False, GROUP_N=1, GROUP_K=1, MXFP4=False)),
                      ("*fp8e4nv", "*fp32", dict(FP8=True, GROUP_N=128, GROUP_K=128, MXFP4=False)),
                      ("*u8", "*u8", dict(FP8=False, GROUP_N=1, GROUP_K=32, MXFP4=True)),
                      ("*u8", "*u8", dict(FP8=False, GROUP_N=1, GROUP_K=32, MXFP4=True, PAIRS=moe_triton.PAIRS_ON)),
                      ("*u8", "*u8", dict(FP8=False, GROUP_N=1, GROUP_K=32, MXFP4=True, PAIRS=moe_triton.PAIRS_ON,
                                          FOLD=True))):
        kernel = compiled_for_sm90(moe_triton._moe_matmul_grouped_kernel,
                                   {"x_ptr": "*bf16", "w_ptr": w, "y_ptr": "*bf16", "s_ptr": s},
                                   dict(BLOCK_M=128, BLOCK_N=moe_triton.GROUPED_BLOCK_N, BLOCK_K=moe_triton.GROUPED_BLOCK_K,
                                        NUM_STAGES=moe_triton.GROUPED_NUM_STAGES, EVEN_N=True, EVEN_K=True,
                                        IEEE=False, **fmt),
                                   num_warps=moe_triton.GROUPED_NUM_WARPS)
        assert 0 < kernel.metadata.shared <= 227 * 1024, (w, kernel.metadata.shared)
        # (the scales' fold, FusedExperts.mxfp4_fold: each pair scaled by one bf16x2 fused multiply-add)
        assert ("fma.rn.bf16x2" in kernel.asm["ptx"]) == fmt.get("FOLD", False), fmt
    # (reading x's rows and writing y's by index, the moe_grouped_gather knob: bf16 and MXFP4 weights in bf16 pairs)
    for w, s, fmt in (("*bf16", "*bf16", dict(FP8=False, GROUP_N=1, GROUP_K=1, MXFP4=False)),
                      ("*u8", "*u8", dict(FP8=False, GROUP_N=1, GROUP_K=32, MXFP4=True, PAIRS=moe_triton.PAIRS_ON))):
        kernel = compiled_for_sm90(moe_triton._moe_matmul_grouped_kernel,
                                   {"x_ptr": "*bf16", "w_ptr": w, "y_ptr": "*bf16", "s_ptr": s, "rows_ptr": "*i64",
                                    "out_rows_ptr": "*i64"},
                                   dict(BLOCK_M=64, BLOCK_N=moe_triton.GROUPED_BLOCK_N, BLOCK_K=moe_triton.GROUPED_BLOCK_K,
                                        NUM_STAGES=moe_triton.GROUPED_NUM_STAGES, EVEN_N=True, EVEN_K=True,
                                        IEEE=False, GATHER=True, SCATTER=True, **fmt),
                                   num_warps=moe_triton.GROUPED_NUM_WARPS)
        assert "ld.global" in kernel.asm["ptx"] and 0 < kernel.metadata.shared <= 227 * 1024, w
        # (gate|up with gpt-oss's clamped SwiGLU and a bias as its epilogue, the moe_grouped_act knob)
        kernel = compiled_for_sm90(moe_triton._moe_matmul_grouped_kernel,
                                   {"x_ptr": "*bf16", "w_ptr": w, "y_ptr": "*bf16", "s_ptr": s, "rows_ptr": "*i64",
                                    "b_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"},
                                   dict(BLOCK_M=64, BLOCK_N=moe_triton.GROUPED_BLOCK_N, BLOCK_K=moe_triton.GROUPED_BLOCK_K,
                                        NUM_STAGES=moe_triton.GROUPED_NUM_STAGES, EVEN_N=True, EVEN_K=True,
                                        IEEE=False, GATHER=True, HAS_BIAS=True, ACT=ACT_CLAMPED_SWIGLU, LIBDEVICE=True,
                                        **fmt),
                                   num_warps=moe_triton.GROUPED_NUM_WARPS)
        assert "ex2" in kernel.asm["ptx"] and 0 < kernel.metadata.shared <= 227 * 1024, w
    # (and the routing weights' sum of a token's rows that follows it, without FMA contraction)
    ptx = compile_for_sm90(moe_triton._moe_combine_kernel, {"y_ptr": "*bf16", "rw_ptr": "*fp32", "out_ptr": "*bf16"},
                           dict(TOPK=4, BLOCK_D=1024, PDL=0), enable_fp_fusion=False)
    assert "fma.rn.f32" not in ptx and "mul.rn.f32" in ptx and "add.rn.f32" in ptx
    # (and the one-program sort of the pairs by expert, the moe_expert_sort knob, at gpt-oss's and DeepSeek's experts)
    for experts in (32, 256):
        sort = compiled_for_sm90(moe_triton._expert_sort_kernel, {"ids_ptr": "*i64", "order_ptr": "*i64",
                                                                  "rows_ptr": "*i64", "offsets_ptr": "*i64"},
                                 dict(TOPK=4, BLOCK_E=experts, BLOCK=16384 // experts, PDL=1), num_warps=8)
        assert "st.global" in sort.asm["ptx"] and sort.metadata.shared <= 227 * 1024, experts


def test_fused_expert_gate_up_compiles_with_the_clamped_activations_and_a_bias():
    """The fused gate|up+activation expert kernel compiled for sm90 (bf16, libdevice) with gpt-oss's clamped SwiGLU,
    DeepSeek-V4's clamped SiLU and ReLU (Nemotron-H's non-gated experts) and a gate|up bias: the interpreter runs
    them in moe_cases.py; the compiler types the float arguments and the constexpr branches."""
    pytest.importorskip("triton")
    from triton_compile import compile_for_sm90

    from atlas.kernels import moe_triton
    from atlas.kernels.fused_ops_triton import ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU, ACT_RELU

    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "s_ptr": "*bf16", "b_ptr": "*bf16",
            "rw_ptr": "*fp32", "alpha": "fp32", "limit": "fp32", "lg_ptr": "*bf16", "rb_ptr": "*bf16",
            "r_scale": "fp32", "r_floor": "fp32", "r_eps": "fp32"}
    not_routed = dict(ROUTE=False, ROUTE_E=1, SCORING=0, ROUTE_BIAS=False, NORM=False, ROUND=False)
    for act in (ACT_CLAMPED_SWIGLU, ACT_LIMITED_SILU, ACT_RELU):
        consts = dict(TOPK=4, BLOCK_N=2 * moe_triton.PAIRS_BLOCK_N, BLOCK_K=moe_triton.PAIRS_BLOCK_K, NUM_STAGES=2,
                      EVEN_N=True, EVEN_K=True, ACT=act, LIBDEVICE=True, PDL=True, FP8=False, GROUP_N=1, GROUP_K=1,
                      MXFP4=False, HAS_BIAS=True, **not_routed)
        assert ".entry" in compile_for_sm90(moe_triton._moe_gate_up_act_kernel, ptrs, consts), act
    # (choosing its own experts: sigmoid scores with a float32 correction bias, and gpt-oss's softmax over the chosen
    #  bf16 logits rounded to bf16)
    for scoring, bias, logits in ((1, True, "*fp32"), (2, False, "*bf16")):
        consts = dict(TOPK=6, BLOCK_N=2 * moe_triton.PAIRS_BLOCK_N, BLOCK_K=moe_triton.PAIRS_BLOCK_K, NUM_STAGES=3,
                      EVEN_N=True, EVEN_K=True, ACT=ACT_RELU, LIBDEVICE=True, PDL=True, FP8=False, GROUP_N=1,
                      GROUP_K=1, MXFP4=False, HAS_BIAS=False, ROUTE=True, ROUTE_E=64, SCORING=scoring,
                      ROUTE_BIAS=bias, NORM=True, ROUND=logits == "*bf16")
        routed = {**ptrs, "lg_ptr": logits, "rb_ptr": "*fp32" if bias else logits, "ids_ptr": "*i64"}
        assert ".entry" in compile_for_sm90(moe_triton._moe_gate_up_act_kernel, routed, consts), scoring


def test_mla_attention_kernel_in_the_interpreter():
    """Absorbed MLA over the paged latent cache (decode, verify and prefill chunks over cached prefixes;
    head counts that are not powers of two; DeepSeek's 512 + 64 row)."""
    out = run_in_triton_interpreter("mla_attention_cases.py", "12")
    assert "12 cases agree" in out


def test_token_mask_kernel_in_the_interpreter():
    """Grammar bitmasks on float32 logits, against the sampler's PyTorch path: vocabularies off 32 and off
    the block, bitmasks narrower than the vocabulary, every row or a subset in any order, rows with every
    token masked and rows whose allowed tokens are all -inf already (the fallback)."""
    out = run_in_triton_interpreter("token_mask_cases.py", "24")
    assert "24 cases agree" in out


def test_split_count_depends_on_the_program_count_only():
    from atlas.kernels.paged_attention import MAX_KV_SPLITS, num_kv_splits

    # batch 1 of a model with 8 KV heads on 132 SMs: 8 programs -> 32 splits (256 programs)
    assert num_kv_splits(1, 8, 132) == MAX_KV_SPLITS == 32
    assert [num_kv_splits(b, 8, 132) for b in (2, 4, 8, 16, 17, 32, 256)] == [16, 8, 4, 2, 1, 1, 1]
    assert num_kv_splits(3, 8, 132) == 8  # powers of two (the combine kernel reads them as one tile)
    assert num_kv_splits(1, 1, 4) == 8


def test_split_kv_is_on_unless_turned_off():
    """EngineConfig.split_kv (default on; --no-split-kv): split-KV decode for the GQA and MLA kernels or
    neither, as the engine hands it to the kernels at start-up (kernels/settings.py)."""
    from atlas.config import EngineConfig
    from atlas.kernels import settings
    from atlas.kernels.paged_attention import split_kv_enabled

    assert EngineConfig().split_kv and split_kv_enabled()
    try:
        settings.configure(EngineConfig(split_kv=False))
        assert not split_kv_enabled()
        settings.configure(EngineConfig(split_kv=True))
        assert split_kv_enabled()
    finally:
        settings.set_kernel_settings(settings.TuningConfig())


@pytest.mark.parametrize("mode", ["chunk", "softcap"])
def test_paged_attention_kernel_compiles_for_sm90_in_each_mode(mode):
    """The paged-attention kernel compiled to PTX for the H200 on this CPU (triton_compile.py) with Llama 4's chunk
    mask or Gemma 2's score soft-capping, over a bf16 cache and an 8-bit one (V planes transposed), unsplit and
    split: the interpreter runs these branches' Python (chunked_attention_cases.py,
    softcap_attention_cases.py); the compiler types them."""
    pytest.importorskip("triton")
    from triton_compile import compile_for_sm90

    from atlas.kernels.paged_attention_triton import _paged_attention_kernel

    flags = dict(USE_CHUNK=mode == "chunk", SOFTCAP=mode == "softcap", USE_WINDOW=False, FUSED_COMBINE=False)
    for cache, v_t, dot_f16 in (("*bf16", False, False), ("*fp8e4nv", True, True)):
        for splits in (1, 4):
            ptx = compile_for_sm90(
                _paged_attention_kernel,
                {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "out_ptr": "*bf16", "part_m_ptr": "*fp32",
                 "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "sinks_ptr": "*bf16", "scale": "fp32",
                 "softcap": "fp32"},
                dict(PAGE=16, GROUP=4, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128, CAUSAL=True,
                     IEEE=False, NUM_SPLITS=splits, NUM_STAGES=2, DOT_F16=dot_f16, V_T=v_t, PDL=False,
                     HAS_SINKS=False, **flags))
            assert ".entry" in ptx, (mode, cache, splits)


def test_split_attention_merged_by_its_last_split_compiles_for_sm90():
    """The attention_fused_combine knob's kernel compiled for the H200 on this CPU, with sinks, at 4 and 32 splits:
    the count is one gpu-scope acquire-release atomic add (the partials every thread stored are ordered before it,
    the merging split's loads after), and the other splits' partials are read past L1 (ld.global.cg)."""
    pytest.importorskip("triton")
    from triton_compile import compile_for_sm90

    from atlas.kernels.paged_attention_triton import _paged_attention_kernel

    for splits in (4, 32):
        ptx = compile_for_sm90(
            _paged_attention_kernel,
            {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "part_m_ptr": "*fp32",
             "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "counts_ptr": "*i32", "sinks_ptr": "*bf16",
             "scale": "fp32", "softcap": "fp32"},
            dict(PAGE=16, GROUP=4, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=32, HEAD_DIM=128, BLOCK_D=128, CAUSAL=True,
                 IEEE=False, NUM_SPLITS=splits, NUM_STAGES=3, DOT_F16=False, V_T=False, PDL=False, HAS_SINKS=True,
                 USE_CHUNK=False, SOFTCAP=False, USE_WINDOW=False, FUSED_COMBINE=True))
        atomics = re.findall(r"atom\.global\.[a-z_.0-9]+", ptx)
        assert atomics and all(all(p in a for p in (".gpu", ".acq_rel", ".add")) for a in atomics), (splits, atomics)
        assert "ld.global.cg" in ptx, splits
