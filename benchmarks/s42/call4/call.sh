#!/usr/bin/env bash
# Device call 4 (session 42): the CUDA test files of the hybrid models and the fused ops
# on the final sources (the server wheels carried: the engine imports msgspec).
set -u
OUT=${OUT:-/tmp/out}; W=/tmp/call4; rm -rf $W; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
WORK=$W/wa OUT=$W/ga FILES="hybrid_cuda:80 fused_ops:70" \
  timeout 185 bash tools/gpu_tests.sh > $W/ga.log 2>&1
cat $W/ga/cuda_tests.txt; cp $W/ga/cuda_tests.txt $OUT/
