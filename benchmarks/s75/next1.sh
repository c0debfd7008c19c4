#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~8 min on a cold machine): tests/test_fp8_cuda.py whole on the
# fp8_fused_quant default (call 6 here was cut by its 280 s limit after 11 of 12 passed); Arcee AFM's, the first GLM-4's and Helium's core CUDA
# tests (added after the calls: tests/test_cuda.py's two per-architecture tests each) and Solar Open's router test.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests fp8 360 4 tests/test_fp8_cuda.py
cuda_tests new_families 150 2 tests/test_cuda.py -k "ArceeForCausalLM or GlmForCausalLM or HeliumForCausalLM"
cuda_tests solar_open 60 1 "tests/test_moe_families.py::test_single_row_routers_run_the_gemv_on_cuda_and_give_transformers_tokens[solar_open]"
echo "done at ${SECONDS}s"
