#!/usr/bin/env bash
# Session 78 call 1 (carry [".whl"]; ~8 min): the speculation policy's CUDA tests after session 77's onset rate
# (tests/test_speculation_policy.py -m cuda: the DFlash context and the draft-length ladder on the GPU), then issue
# 38's n-gram rows at 64 and 256 streams (benchmarks/s77/next_policy_rows.sh, PART=ngram).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests policy 200 1 tests/test_speculation_policy.py
PART=ngram bash benchmarks/s77/next_policy_rows.sh
echo "call done at ${SECONDS}s"
