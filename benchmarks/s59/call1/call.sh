#!/usr/bin/env bash
# Prepared in session 58. CUDA tests: (1) the speculation policy's file, with the draft-length ladder's DFlash test
# (steps of 1, 3 and K drafts from verify graphs of their own, tokens equal to plain decoding's) and the DFlash
# context through a plain stretch; (2) the hybrid files, the first run since the MoE routers compute their logits in
# the model dtype (97f6758: Qwen3-Next / Qwen3.5-MoE in bf16 now choose as transformers does).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests policy 200 1 tests/test_speculation_policy.py
cuda_tests hybrid 300 4 tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py
