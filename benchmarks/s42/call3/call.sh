#!/usr/bin/env bash
# Device call 3 (session 42): the CUDA test files of the DeepSeek, gpt-oss, 8-bit KV, DFlash, speculation-policy and
# mixed-graph paths on the final sources (the server wheels carried: the engine imports msgspec). Call 4 is this
# script with other FILES, LIMIT and W (call4/call.sh).
set -u
OUT=${OUT:-/tmp/out}; W=${W:-/tmp/call3}; rm -rf $W; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
WORK=$W/wa OUT=$W/ga FILES="${FILES:-deepseek_cuda:210 gpt_oss_cuda:85 kv_cache_dtype:60 dflash:45 speculation_policy:25 mixed_graphs:20}" \
  timeout "${LIMIT:-570}" bash tools/gpu_tests.sh > $W/ga.log 2>&1
cat $W/ga/cuda_tests.txt; cp $W/ga/cuda_tests.txt $OUT/
