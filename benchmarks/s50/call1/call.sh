#!/usr/bin/env bash
# Device call 1 (prepared in session 49 for session 50): every CUDA test (pytest -m cuda) on session 49's final tree
# (the fused expert epilogue with biases and clamped activations, the FP8 scale loads, MXFP4 experts in the MoE
# layer, the DSA kernels), three pytest-xdist workers on the one H200, one line a test (-v) so that a run cut by the
# limit still says what passed. Tests refused by the memory plan under three workers run again alone after it.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $OUT/machine.txt 2>&1
timeout -k 10 ${LIMIT:-560} python3 -m pytest -v -m cuda ${TESTS:-tests/} -n ${WORKERS:-3} -p no:cacheprovider -rfE \
  --durations=20 > $OUT/cuda_tests.log 2>&1
echo "exit $?" >> $OUT/cuda_tests.log
grep -E "FAILED|ERROR|passed|failed|exit" $OUT/cuda_tests.log | sed -E 's/^\[gw[0-9]\] \[ *[0-9]+%\] //' | tail -n 60
