#!/usr/bin/env bash
# Session 60, call 1: the tensor-core W8A8 rows kernel (fp8_w8a8_rows_triton, "tc" configs) against the shipped FP8
# small-M table and bf16, 36 Qwen3-8B-shaped layers in one CUDA graph (benchmarks/s60/fp8_rows_probe.py); the FP8 CUDA tests
# (the rows kernel against w8a8_ref on the 8B shapes); the speculation policy's CUDA tests (owed for 6a36e39).
mkdir -p $OUT
# (run on a tree with the rows kernel, since reverted: benchmarks/s60/rows_kernel.patch is call 2's form of it, a
#  superset: the "tq" kind came in call 2; the probe ran from tools/ then, with call 1's grid of "tc" configs)
git apply benchmarks/s60/rows_kernel.patch || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout 330 python3 benchmarks/s60/fp8_rows_probe.py --out $OUT/probe.json --budget-s 280 > $OUT/probe.log 2>&1
echo "probe exit $?"; tail -n 40 $OUT/probe.log
cuda_tests fp8 150 2 tests/test_fp8_cuda.py
cuda_tests policy 100 1 tests/test_speculation_policy.py
