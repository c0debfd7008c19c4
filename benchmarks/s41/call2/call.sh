#!/usr/bin/env bash
# Device call 2 (session 41), one H200: PART=a: the structured-output tests (issue 35) and test_cuda on this
# session's final sources; PART=b: the serve run at 256 streams with the aiohttp load client. Everything comes back as one archive plus a summary.
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/call2 && mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
if [ "${PART:-a}" = a ]; then
  ROUNDS=0 OUT=$W/structured timeout 190 bash tools/gpu_structured.sh > $W/structured.log 2>&1
  WORK=$W/wa OUT=$W/ga FILES="cuda:170" bash tools/gpu_tests.sh > $W/ga.log 2>&1
else
  RUNS="256:1024:2" OUT=$W/serve timeout 200 bash tools/gpu_serve.sh > $W/serve.log 2>&1
fi
{ for f in $W/g*/cuda_tests.txt; do echo "== $f"; grep -E "exit|FAILED|ERROR|sha1" $f; done
  [ -f $W/structured/log.txt ] && { echo "== structured"; cat $W/structured/log.txt; }
  [ -f $W/serve.log ] && { echo "== serve"; cat $W/serve.log; }; } > $OUT/summary_${PART:-a}.txt 2>&1
cat $OUT/summary_${PART:-a}.txt
tar czf $OUT/call2${PART:-a}.tar.gz -C /tmp call2
