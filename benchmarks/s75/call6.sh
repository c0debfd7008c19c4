#!/usr/bin/env bash
# Session 75 call 6 (carry [".whl"]; ~4.5 min): the FP8 CUDA files after fp8_fused_quant became the default (every FP8
# model test then takes the fused quantizers from 2 rows; the knob's own test compares against it off).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
git rev-parse HEAD 2>/dev/null
cuda_tests fp8 280 4 tests/test_fp8_cuda.py
cuda_tests moe_fp8 80 1 tests/test_moe_fp8.py
echo "done at ${SECONDS}s"
