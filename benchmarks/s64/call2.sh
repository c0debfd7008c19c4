#!/usr/bin/env bash
# Session 64 call 2 (not run: the device time ran out; carry [".whl"], ~4 min): the FP8 CUDA tests with the row-tiles
# GEMV the batch-1 default (GEMV_CONFIGS[1] = rt-n4k2048w4s1, after call 1's sweep), the model tests on the fixed KV
# cache: every FP8 kernel against its reference at the 8B shapes, the tiny FP8 models of every layout under graphs
# against eager (their one-row steps now take the row tiles), and the FP8 experts at DeepSeek-V3's shapes.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fp8 220 4 tests/test_fp8_cuda.py
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider -rfE tests/test_moe_fp8.py > $OUT/tests_moe_fp8.log 2>&1
echo "moe fp8 tests exit $?; $(tail -n 1 $OUT/tests_moe_fp8.log)"
