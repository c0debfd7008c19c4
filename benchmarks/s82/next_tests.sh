#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~9 min): the CUDA tests owed since sessions 79-82's changes, one
# pytest session at a time: the GEMV cases (the float32 routers' widening load, 80f0fd3), the whole DeepSeek file
# (MLA's prologue, the fused q | kv_a projection, the shared experts onto the routed sum, in bf16 models, CUDA graphs,
# MTP and prefix hits), the prologue's own case tests, then the MXFP4 files owed since 2007627.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests gemv 60 1 tests/test_cuda.py -k gemv
cuda_tests deepseek 240 1 tests/test_deepseek_cuda.py
cuda_tests fused_ops 100 2 tests/test_fused_ops.py
left=$(( 560 - SECONDS )); [ $left -gt 60 ] && cuda_tests mxfp4 $left 1 tests/test_moe_mxfp4.py tests/test_gpt_oss_cuda.py
echo "done at ${SECONDS}s"
