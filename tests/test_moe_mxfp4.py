"""The routed-expert kernels (kernels/moe_triton.py) reading MXFP4 weights, gpt-oss's format (packed FP4 E2M1 codes,
uint8 [E, N, K / 2], with E8M0 scales uint8 [E, N, K / 32], `scale=`), against the dequantizing reference
(quantization.dequantize_mxfp4, then kernels/moe.py's references): moe_mxfp4_cases.py in Triton's CPU interpreter
here, on CUDA at gpt-oss-20b's expert shapes in the cuda test; and every kernel compiled for sm90 in MXFP4 mode.

Wired into layers/moe.py (FusedExperts' MXFP4 form, chosen by models/gpt_oss.py for an MXFP4 checkpoint where
layers/moe.mxfp4_unusable finds nothing against it):
- w13 / w2 as uint8 [E, N, K / 2] with uint8 E8M0 scales [E, N, K / 32] (w13_scales, w2_scales) beside them,
  on CUDA with Triton (the kernels) and on the CPU (forward_grouped dequantizes per call with dequantize_mxfp4
  itself: the dequantized model's numbers); dequantized as they load, with a warning naming why, where the
  hidden size or this rank's intermediate size is not a multiple of 32 (scales would not slice whole), or CUDA
  has no Triton; a float16 model checks at load that every value fits exactly, as the dequantizing load does.
  --load-format dummy draws MXFP4 codes (random bytes, scales 2^-13);
- the loader keeps the checkpoint's gate/up interleaving apart in whole packed rows and slices rows for tensor
  parallelism (N of w13; K of w2 in whole runs of 32, so scales slice with their bytes), experts for expert
  parallelism;
- forward_triton passes scale= to the wrappers: at up to 4 tokens the fused gate|up kernel with the gate|up
  bias and the clamped SwiGLU as its epilogue (ACT_CLAMPED_SWIGLU), then down+combine with the down bias (the
  unfused pairs with the moe_fused_pairs knob off), above that the grouped kernel with _activate between;
- checks: moe_mxfp4_cases.py's check_forward (forward_triton against forward_grouped, biases and clamped
  SwiGLU, in the interpreter here); tests/test_gpt_oss.py: the tiny MXFP4 checkpoint on the CPU against its
  dequantized float32 / bf16 checkpoint (tokens and logprobs), two ranks on gloo against one device, and on
  CUDA eager and in CUDA graphs against the dequantized model.
"""

from __future__ import annotations

import pytest
import torch


def test_mxfp4_expert_kernels_in_the_interpreter_match_the_dequantizing_reference():
    """kernels/moe_triton.py reading MXFP4 experts (pairs, fused gate|up+act, down+combine with and without biases,
    grouped) in Triton's CPU interpreter, float32, at 1 and 11 tokens with partial N and K tiles, then
    FusedExperts' MXFP4 form with biases and clamped SwiGLU, forward_triton against forward_grouped:
    moe_mxfp4_cases.py."""
    from conftest import run_in_triton_interpreter

    assert run_in_triton_interpreter("moe_mxfp4_cases.py").strip().endswith(" 0 failure(s)")


def test_the_row_tiles_step_pads_the_experts_columns_least():
    """The MXFP4 row tiles' step (runs of 32 columns, warps = runs / 16): the moe_mxfp4_row_runs knob's value, or for
    0 the step that pads K's runs least, the larger on a tie: gpt-oss's 2,880 columns (90 runs) take 32 (96 issued,
    not 64's 128), whole multiples of 2,048 keep 64; the knob refuses other step sizes by name."""
    from atlas.config import ConfigError, TuningConfig
    from atlas.kernels.moe_triton import mxfp4_row_runs

    assert mxfp4_row_runs(2880, 0) == (32, 2)
    assert mxfp4_row_runs(4096, 0) == mxfp4_row_runs(2048, 0) == mxfp4_row_runs(5760, 0) == (64, 4)
    assert mxfp4_row_runs(1408, 0) == (16, 1)  # (44 runs: 48 issued)
    assert mxfp4_row_runs(2880, 64) == (64, 4) and mxfp4_row_runs(2880, 16) == (16, 1)
    assert TuningConfig().moe_mxfp4_row_runs == 0  # (the default: 1.10x at gpt-oss-20b's batch 1, BENCHMARKS.md 7.3)
    with pytest.raises(ConfigError, match="moe_mxfp4_row_runs"):
        TuningConfig.parse("moe_mxfp4_row_runs=48")


def test_the_row_steps_knob_sets_each_kernels_step_stages_and_decode():
    """moe_mxfp4_row_steps gives gate|up and down each their own step (128 runs on 8 warps too), stages and decode
    form in place of moe_mxfp4_row_runs / one stage / moe_mxfp4_decode; a kernel it leaves out keeps those; a
    malformed entry is refused by name when the settings take effect."""
    from atlas.config import ConfigError, TuningConfig
    from atlas.kernels import settings
    from atlas.kernels.moe_triton import mxfp4_program_warps, mxfp4_row_config

    assert mxfp4_row_config("gate_up", 2880) == mxfp4_row_config("down", 2880) == (32, 2, 1, "pairs")
    with settings.tuned(moe_mxfp4_row_steps="down:128:2:e4m3", moe_mxfp4_decode="words", moe_mxfp4_row_runs=64):
        assert mxfp4_row_config("down", 2880) == (128, 8, 2, "e4m3")
        assert mxfp4_row_config("gate_up", 2880) == (64, 4, 1, "words")
    with settings.tuned(moe_mxfp4_row_steps=" gate_up:0:3:bits ; down:16:1:words"):
        assert mxfp4_row_config("gate_up", 2880) == (32, 2, 3, "bits")
        assert mxfp4_row_config("down", 2880) == (16, 1, 1, "words")
    with settings.tuned(moe_mxfp4_row_steps="down:0:1:words-fma:4"):  # (a program's warps, the fifth field)
        assert mxfp4_row_config("down", 2880) == (32, 2, 1, "words-fma")
        assert mxfp4_program_warps("down", 8) == 4 and mxfp4_program_warps("gate_up", 4) == 4
    assert mxfp4_program_warps("down", 8) == 8
    for bad in ("down:48:1:bits", "down:64:4:bits", "down:64:1:fp4", "up:64:1:bits", "down:64:1", "down:0:1:bits:3",
                "down:0:1:bits:4:1"):
        with pytest.raises(ConfigError, match="moe_mxfp4_row_steps"):
            settings.set_kernel_settings(TuningConfig.parse(f"moe_mxfp4_row_steps={bad}"))
    assert settings.tuning.moe_mxfp4_row_steps == ""  # (a refused setting leaves the ones in effect)


def test_the_fma_decodes_are_refused_outside_their_kernels():
    """pairs-fma and words-fma run in the gate|up columns kernel and the down choices kernel only: with either turned
    off the launch is refused by name (not run in another form)."""
    from atlas.config import ConfigError
    from atlas.kernels import settings
    from atlas.kernels.fused_ops_triton import ACT_SILU
    from atlas.kernels.moe_triton import moe_pairs_down_combine, moe_pairs_gate_up_act

    e, hid, inter = 2, 64, 32
    w13 = torch.zeros(e, 2 * inter, hid // 2, dtype=torch.uint8)
    s13 = torch.full((e, 2 * inter, hid // 32), 127, dtype=torch.uint8)
    w2 = torch.zeros(e, hid, inter // 2, dtype=torch.uint8)
    s2 = torch.full((e, hid, inter // 32), 127, dtype=torch.uint8)
    x, h = torch.zeros(1, hid, dtype=torch.bfloat16), torch.zeros(2, inter, dtype=torch.bfloat16)
    ids, weights = torch.tensor([[0, 1]]), torch.full((1, 2), 0.5)
    for decode in ("pairs-fma", "words-fma"):
        with settings.tuned(moe_mxfp4_decode=decode, moe_mxfp4_gate_up_cols=0), pytest.raises(
                ConfigError, match=f"{decode}.*moe_mxfp4_gate_up_cols"):
            moe_pairs_gate_up_act(x, w13, ids, weights, ACT_SILU, scale=s13, row_tiles=True)
        with settings.tuned(moe_mxfp4_decode=decode, moe_mxfp4_down_choices=False), pytest.raises(
                ConfigError, match=f"{decode}.*moe_mxfp4_down_choices"):
            moe_pairs_down_combine(h, w2, ids, weights, scale=s2, row_tiles=True)


def test_the_e4m3_decode_gives_each_e2m1_code_times_2_to_the_minus_6():
    """The whole-word operations of the row tiles' "e4m3" decode (moe_triton._E2M1_AS_E4M3, in PyTorch here on
    every byte value, in the words' byte order) turn each E2M1 code into the E4M3 byte of its value times 2^-6 exactly,
    sign and the subnormal 0.5 included; the kernel's interpreted form computes the same values from float32 bits.
    The moe_mxfp4_decode knob refuses other forms by name."""
    from atlas.config import ConfigError, TuningConfig
    from atlas.kernels.moe_triton import _E2M1_AS_E4M3
    from atlas.kernels.mxfp4 import FP4_E2M1_VALUES

    words = torch.arange(256, dtype=torch.int32).repeat_interleave(4).view(-1, 4)  # (each byte value in 4 lanes)
    w = (words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24)  # (int32, lanes wrap as the GPU's)
    lo = ((w & 0x07070707) << 2) | ((w & 0x08080808) << 4)  # (as the PTX: the low nibbles' codes)
    hi = ((w >> 2) & 0x1C1C1C1C) | (w & -0x7F7F7F80)  # (0x80808080 as an int32; >> on int32 is arithmetic, and the
    # mask drops what it shifts in, as the PTX's logical shift leaves nothing there)
    value = torch.tensor(FP4_E2M1_VALUES)
    for name, reg, nibble in (("low", lo, 0), ("high", hi, 4)):
        got = reg.contiguous().view(torch.uint8).view(torch.float8_e4m3fn).float().view(-1, 4)
        want = value[(torch.arange(256) >> nibble) & 15][:, None].expand(-1, 4) / 64
        assert torch.equal(got, want), name
    assert "0x07070707" in _E2M1_AS_E4M3.value and "cvt.rn.f16x2.e4m3x2" in _E2M1_AS_E4M3.value
    # (pairs timed fastest on an H100, the word forms slower than bits: BENCHMARKS.md 7.3)
    assert TuningConfig().moe_mxfp4_decode == "pairs"
    with pytest.raises(ConfigError, match="moe_mxfp4_decode"):
        TuningConfig.parse("moe_mxfp4_decode=fp4")


def test_the_mxfp4_expert_kernels_compile_for_sm90():
    """Every expert kernel compiled to PTX for the H200 on this CPU (triton_compile.py) in MXFP4 mode with bf16
    activations: the compiler types what the interpreter only runs (the nibble split into even and odd halves, the
    scales' bitcast, the constexpr branches of _accumulate)."""
    from triton_compile import compile_for_sm90

    from atlas.kernels import moe_triton

    rows_kernel = moe_triton._moe_down_combine_rows_kernel  # (its tile is TOPK_P2 x BLOCK_N rows: compiled apart)
    kernels = [getattr(moe_triton, n) for n in dir(moe_triton) if n.startswith("_moe") and n.endswith("_kernel")
               and getattr(moe_triton, n) is not rows_kernel]
    assert len(kernels) >= 4
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*u8", "y_ptr": "*bf16", "s_ptr": "*u8", "h_ptr": "*bf16", "rw_ptr": "*fp32",
            "b_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"}
    # (partial tiles, as gpt-oss's 2,880-wide rows take: the masked loads; the unmasked ones compile in the FP8
    #  test and run in the CUDA tests)
    consts = dict(TOPK=4, BLOCK_N=64, BLOCK_K=128, BLOCK_M=16, NUM_STAGES=2, EVEN_N=False, EVEN_K=False, FP8=False,
                  GROUP_N=1, GROUP_K=32, MXFP4=True, ACT=0)
    for kernel in kernels:
        assert ".entry" in compile_for_sm90(kernel, ptrs, consts), kernel.__name__
    consts = dict(TOPK=4, TOPK_P2=4, BLOCK_N=4, BLOCK_K=512, NUM_STAGES=3, EVEN_K=False, FP8=False, GROUP_N=1,
                  GROUP_K=32, MXFP4=True, HAS_BIAS=True)
    assert ".entry" in compile_for_sm90(rows_kernel, ptrs, consts)
    # the row tiles' down with a token's choices side by side (moe_mxfp4_down_choices), gpt-oss's 2,880 columns
    for decode in moe_triton.TILE_DECODES:  # (bits, pairs and the two fused multiply-add forms)
        consts = dict(TOPK=4, TOPK_P2=4, RUNS=32, NUM_STAGES=1, EVEN_K=False, HAS_BIAS=True, DECODE=decode)
        assert ".entry" in compile_for_sm90(moe_triton._mxfp4_down_choices_kernel, {**ptrs, "h_ptr": "*i32"}, consts)
        if decode in (0, 4):  # with each program asking the L2 for a part of another weight first (moe_l2_prefetch):
            # sm_90's bulk prefetch, from one thread a program
            ptx = compile_for_sm90(moe_triton._mxfp4_down_choices_kernel, {**ptrs, "h_ptr": "*i32", "pf_ptr": "*u8"},
                                   dict(consts, PREFETCH=True))
            assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1 and "setp.eq.and.u32" in ptx
        # the gate|up of 8 output columns a program (moe_mxfp4_gate_up_cols)
        consts = dict(TOPK=4, COLS=8, RUNS=32, NUM_STAGES=1, EVEN_K=False, ACT=3, LIBDEVICE=True, HAS_BIAS=True,
                      DECODE=decode)
        assert ".entry" in compile_for_sm90(moe_triton._mxfp4_gate_up_cols_kernel, {**ptrs, "x_ptr": "*i32"}, consts)
    # the grouped kernel's bf16 pairs decode (moe_mxfp4_dot_pairs: integer bits, bf16 products, scales a step ahead),
    # with and without the expert biases added in its epilogue
    for has_bias in (False, True):
        consts = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=3, EVEN_N=False, EVEN_K=False, IEEE=False,
                      FP8=False, GROUP_N=1, GROUP_K=32, MXFP4=True, PAIRS=moe_triton.PAIRS_ON, HAS_BIAS=has_bias)
        assert ".entry" in compile_for_sm90(moe_triton._moe_matmul_grouped_kernel, ptrs, consts)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxfp4_expert_kernels_on_cuda_match_the_dequantizing_reference():
    """Each MXFP4 expert kernel on CUDA, bf16 activations, gpt-oss-20b's expert shapes (32 experts, hidden 2880,
    intermediate 2880, top-4), 1, 4 and 11 tokens, against the dequantizing reference, and FusedExperts' MXFP4
    form (biases, clamped SwiGLU) at that shape, forward_triton against forward_grouped: moe_mxfp4_cases.py
    gpt-oss-20b."""
    from conftest import run_cases_script

    assert run_cases_script("moe_mxfp4_cases.py", "gpt-oss-20b").strip().endswith(" 0 failure(s)")
