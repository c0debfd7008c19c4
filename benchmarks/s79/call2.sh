#!/usr/bin/env bash
# Session 79, the call after call 1 (carry [".whl"]; ~8 min): the CUDA tests whose case files now set their kernel
# knobs through kernels.settings.tuned (39020aa): the kernels' CUDA cases of test_fp8_cuda.py, test_moe_fp8.py,
# test_deepseek_cuda.py and test_hybrid_cuda.py (the model-level tests of those files left out for time); then issue
# 38's n-gram row at 256 streams with 8 interleaved passes (session 78: 0.961 from 4).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests gpt_oss 150 1 tests/test_gpt_oss_cuda.py
cuda_tests knobs 230 1 tests/test_fp8_cuda.py tests/test_moe_fp8.py tests/test_deepseek_cuda.py \
  tests/test_hybrid_cuda.py -k "kernels or routing or experts or snapshot or recurrent or convolution"
POLICIES=adaptive METHODS=ngram CONC=256 EXTRA="--interleave --repeats 8 --num-gpu-blocks-override 6200" \
  timeout $(( 560 - SECONDS )) bash tools/gpu_spec_policy.sh
echo "done at ${SECONDS}s"
