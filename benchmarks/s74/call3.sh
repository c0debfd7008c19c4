#!/usr/bin/env bash
# Session 74 call 3 (carry [".whl"]; ~4 min; call 2 found no machine): the hybrids' CUDA test alone (every
# configuration; its CPU reference on the CPU and the near-tie comparison, as call2.sh says), no benchmark (the device
# time left would not cover issue 34's batch-1 row).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests hybrids 200 3 tests/test_ssm_hybrids.py -k test_on_cuda_the_graphs
echo "done at ${SECONDS}s"
