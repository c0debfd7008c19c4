#!/usr/bin/env bash
# Session 62 call 1 (written without a GPU: run it in a later session; carry [".whl"]; ~5 min): the FP8 CUDA tests
# after session 62's kernels: every FP8 linear kernel against its reference at the 8B shapes (the row-tiles GEMV "rt"
# at 1, 2 and 4 rows among them), tiny FP8 models greedy under graphs = eager with rt configs (the gate|up epilogue at
# one row, 4 rows together), and the FP8 experts at DeepSeek-V3's shapes (moe_fp8_cases.py v3: the down rows kernel
# summing float32 weights, the gate|up row tiles). Calls 2 and 3 time them.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fp8 220 4 tests/test_fp8_cuda.py
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider -rfE tests/test_moe_fp8.py > $OUT/tests_moe_fp8.log 2>&1
echo "moe fp8 tests exit $?; $(tail -n 1 $OUT/tests_moe_fp8.log)"
