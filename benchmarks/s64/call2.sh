#!/usr/bin/env bash
# Session 64 call 2 (carry [".whl"]): the FP8 models greedy under graphs = eager with the row-tiles GEMV the batch-1
# default (GEMV_CONFIGS[1] = rt-n4k2048w4s1, after call 1's sweep): every FP8 layout's one-row steps now take it.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fp8_models_rt_default 100 3 tests/test_fp8_cuda.py -k greedy_under_cuda_graphs
