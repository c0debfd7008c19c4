#!/usr/bin/env bash
# Device call 2 (session 41), two H200s: the CUDA tests on this session's final sources, one queue per GPU, and
# the structured-output tests (issue 35) on GPU 1. PART=a: the long files; PART=b: the serve run (GPU 0) beside
# the remaining files (GPU 1). Everything comes back in one archive plus a summary.
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/call2 && mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
if [ "${PART:-a}" = a ]; then
  ( CUDA_VISIBLE_DEVICES=1 ROUNDS=0 OUT=$W/structured timeout 200 bash tools/gpu_structured.sh
    CUDA_VISIBLE_DEVICES=1 WORK=$W/w1 OUT=$W/g1 FILES="deepseek_cuda:140 gpt_oss_cuda:75" bash tools/gpu_tests.sh ) > $W/gpu1.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 WORK=$W/w0 OUT=$W/g0 FILES="cuda:170 sliding_window_cuda:100 kv_cache_dtype:50 mixed_graphs:20" \
    bash tools/gpu_tests.sh > $W/gpu0.log 2>&1
  wait
else
  CUDA_VISIBLE_DEVICES=1 WORK=$W/w1b OUT=$W/g1b FILES="fused_ops:70 dflash:30 hybrid_cuda:70" bash tools/gpu_tests.sh > $W/gpu1b.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 RUNS="256:1024:2 1:32:2" OUT=$W/serve timeout 330 bash tools/gpu_serve.sh > $W/serve.log 2>&1
  wait
fi
{ for f in $W/g*/cuda_tests.txt; do echo "== $f"; grep -E "exit|FAILED|ERROR|sha1" $f; done
  [ -f $W/structured/log.txt ] && { echo "== structured"; cat $W/structured/log.txt; }
  [ -f $W/serve.log ] && { echo "== serve"; cat $W/serve.log; }; } > $OUT/summary_${PART:-a}.txt 2>&1
cat $OUT/summary_${PART:-a}.txt
tar czf $OUT/call2${PART:-a}.tar.gz -C /tmp call2
