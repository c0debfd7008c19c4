#!/usr/bin/env bash
# Session 60, call 2: the rows kernel with the activations quantized by a launch before it ("tq") against the
# in-kernel quantization ("tc", call 1's best), the shipped FP8 table and bf16 (benchmarks/s60/fp8_rows_probe.py);
# the FP8 CUDA tests (cut at 150 s in call 1), with both forms of the rows kernel against w8a8_ref on the 8B shapes.
mkdir -p $OUT
# (run on a tree with the rows kernel, since reverted: its code is benchmarks/s60/rows_kernel.patch)
git apply benchmarks/s60/rows_kernel.patch || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 300 python3 benchmarks/s60/fp8_rows_probe.py --out $OUT/probe.json --budget-s 250 --kinds tq \
    --extra tc-n64k256w4s4 > $OUT/probe.log 2>&1
echo "probe exit $?"; cat $OUT/probe.log
cuda_tests fp8 250 2 tests/test_fp8_cuda.py
