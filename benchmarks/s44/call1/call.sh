#!/usr/bin/env bash
# Device call 1 (session 44), one H200, on session 43's final sources: the four structured-output tests (issue 35)
# and `atlas bench serve` at 256 and 1 streams with issue 36's 128-token prompts, two front ends (issues 43, 36).
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/call1 && rm -rf $W && mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
ROUNDS=0 OUT=$W/structured timeout 300 bash tools/gpu_structured.sh > $W/structured.log 2>&1
{ source tools/steps.sh; sources_hash; cat $W/structured/log.txt; } > $OUT/summary.txt 2>&1
cat $OUT/summary.txt
INPUT_LEN=128 RUNS="256:1024:2 1:16:2" timeout 270 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
tail -40 $OUT/serve.log
tar czf $OUT/call1.tar.gz -C /tmp call1
