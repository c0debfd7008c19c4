#!/usr/bin/env bash
# Session 64 call 1 (carry [".whl"]): the FP8 models greedy under graphs = eager again, after the test took a fixed KV
# cache (s62/call1's fp8-block case was refused a memory plan beside the other workers' engines), then s62/call2's
# batch-1 sweep, trimmed to the device time left (the row-tiles GEMV against the shipped table; 2, 4, 16 and 64
# rows left for later).
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fp8_models 150 3 tests/test_fp8_cuda.py -k greedy_under_cuda_graphs
OUT=$OUT CONFIGS="sum-n4k2048w4s3 rt-n4k2048w4s1 rt-n4k2048w4s2 rt-n2k2048w4s1 \
rt-n4k1024w4s1" timeout 150 bash tools/gpu_fp8_model_sweep.sh > $OUT/sweep.out 2>&1
cat $OUT/fp8_sweep.txt
