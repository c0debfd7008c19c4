#!/usr/bin/env bash
# Device call 2 (session 44), on call 1's sources: test_cuda, the 8-bit KV and mixed-graph files (issue 35's
# kernels and graphs), then the FP8 held-out perplexity through the real FP8 kernels (issue 34).
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/call2 && rm -rf $W && mkdir -p $W
WORK=$W/wa OUT=$W/ga FILES="cuda:150 kv_cache_dtype:35 mixed_graphs:15" timeout 450 bash tools/gpu_tests.sh > $W/ga.log 2>&1
cp $W/ga/cuda_tests.txt $OUT/summary.txt; cat $OUT/summary.txt
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 tools/fp8_perplexity.py --max-tokens 1000000 --output-json $OUT/fp8_ppl.json \
  > $OUT/fp8_ppl.log 2>&1
tail -12 $OUT/fp8_ppl.log
tar czf $OUT/call2.tar.gz -C /tmp call2
