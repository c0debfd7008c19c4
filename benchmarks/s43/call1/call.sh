#!/usr/bin/env bash
# Device call 1 (session 43), one H200: the structured-output tests (issue 35), test_cuda, the 8-bit KV and
# mixed-graph files on this session's first sources (after session 42's last runtime and model commits).
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/call1 && rm -rf $W && mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
ROUNDS=0 OUT=$W/structured timeout 230 bash tools/gpu_structured.sh > $W/structured.log 2>&1
WORK=$W/wa OUT=$W/ga FILES="cuda:150 kv_cache_dtype:35 mixed_graphs:15" timeout 340 bash tools/gpu_tests.sh > $W/ga.log 2>&1
{ cat $W/ga/cuda_tests.txt; [ -f $W/structured/log.txt ] && { echo "== structured"; cat $W/structured/log.txt; }; } \
  > $OUT/summary.txt 2>&1
cat $OUT/summary.txt
tar czf $OUT/call1.tar.gz -C /tmp call1
