#!/usr/bin/env bash
# Device call 2 (session 43), on call 1's sources: what call 1 did not reach (the machine ran about a quarter slower
# than in session 42: the structured suite's last test was cut at call 1's 230 s, and test_cuda's 320 s left
# nothing for the 8-bit KV and mixed-graph files), then the DFlash, speculation-policy, DeepSeek and hybrid files.
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/call2 && rm -rf $W && mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
ROUNDS=0 OUT=$W/structured TESTS=test_structured_engine.py::test_json_schema_greedy_and_sampled_outputs_validate \
  timeout 70 bash tools/gpu_structured.sh > $W/structured.log 2>&1
cat $W/structured/log.txt > $OUT/summary.txt
WORK=$W/wa OUT=$W/ga FILES="deepseek_cuda:110 hybrid_cuda:45 kv_cache_dtype:40 dflash:25 speculation_policy:18 mixed_graphs:12" \
  timeout 505 bash tools/gpu_tests.sh > $W/ga.log 2>&1
cat $W/ga/cuda_tests.txt >> $OUT/summary.txt; cat $OUT/summary.txt
tar czf $OUT/call2.tar.gz -C /tmp call2
