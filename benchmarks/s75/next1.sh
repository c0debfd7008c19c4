#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~8 min on a cold machine): tests/test_fp8_cuda.py whole on the
# fp8_fused_quant default (call 6 here was cut by its 280 s limit after 11 of 12 passed); Solar Open's router test
# (added after the calls; the new dense families' core tests are in next4.sh).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests fp8 420 4 tests/test_fp8_cuda.py
cuda_tests solar_open 60 1 "tests/test_moe_families.py::test_single_row_routers_run_the_gemv_on_cuda_and_give_transformers_tokens[solar_open]"
echo "done at ${SECONDS}s"
