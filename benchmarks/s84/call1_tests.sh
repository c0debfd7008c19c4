#!/usr/bin/env bash
# Session 84, call 1 (carry [".whl"]; ~7 min): the CUDA tests after the two mends of session 83 (7e4fbab: the shared
# experts' add onto the routed sum decided by Linear.forward_onto; 8b5d098: MLA's fused q | kv_a path chosen from the
# config): the whole DeepSeek file (bf16 and float32 models, CUDA graphs, MTP, prefix hits, tokens against
# transformers), then the FP8 MoE file's CUDA cases (FP8 DeepSeek: the shared experts add after, not onto).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null
cuda_tests deepseek 280 1 tests/test_deepseek_cuda.py
left=$(( 560 - SECONDS )); [ $left -gt 60 ] && cuda_tests moe_fp8 $left 2 tests/test_moe_fp8.py
echo "done at ${SECONDS}s"
