#!/usr/bin/env bash
# Device call 2 (session 42), one H200: the structured-output tests (issue 35) and test_cuda on the final sources.
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/call2 && mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
ROUNDS=0 OUT=$W/structured timeout 250 bash tools/gpu_structured.sh > $W/structured.log 2>&1
WORK=$W/wa OUT=$W/ga FILES="cuda:150" timeout 320 bash tools/gpu_tests.sh > $W/ga.log 2>&1
{ for f in $W/g*/cuda_tests.txt; do echo "== $f"; cat $f; done
  [ -f $W/structured/log.txt ] && { echo "== structured"; cat $W/structured/log.txt; }; } > $OUT/summary.txt 2>&1
cat $OUT/summary.txt
tar czf $OUT/call2.tar.gz -C /tmp call2
