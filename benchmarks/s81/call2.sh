#!/usr/bin/env bash
# Session 81 call 2 (carry [".whl"]; ~8 min): the CUDA tests of the session's kernels: the MLA prologue's cases, CUDA
# graph and recompilation test (tests/test_fused_ops.py), the DeepSeek file (the absorbed products' cases and the
# bf16 models with the mla_absorb_gemv knob included: fp32 against transformers, bf16 argmax, graphs, prefix hits,
# MTP), then those owed on 2007627 (the MXFP4 row tiles' scale helper) in the time left.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests fused_ops 100 2 tests/test_fused_ops.py
cuda_tests deepseek 240 1 tests/test_deepseek_cuda.py
left=$(( 560 - SECONDS )); [ $left -gt 60 ] && cuda_tests mxfp4 $left 1 tests/test_moe_mxfp4.py tests/test_gpt_oss_cuda.py
echo "done at ${SECONDS}s"
