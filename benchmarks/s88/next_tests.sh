#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~6 min, any card): the CUDA tests owed since moe_grouped_gather
# became the default in session 88 (2058fc6): the gpt-oss model's (MXFP4 experts through the grouped kernel with rows
# by index) and the MoE ones of tests/test_cuda.py and tests/test_moe_mxfp4.py.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests gpt_oss 300 2 tests/test_gpt_oss_cuda.py
cuda_tests moe 200 2 tests/test_cuda.py tests/test_moe_mxfp4.py tests/test_moe_fp8.py -k "moe or expert or mxfp4"
echo "done at ${SECONDS}s"
