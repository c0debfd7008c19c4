#!/usr/bin/env bash
# Device call 2 (session 47): the speculation policy's table (adaptive) after session 37's policy changes (an empty
# proposal counts as zero gain, probes before any verify step is timed, a floor of 1 on the cost ratio), which were
# never measured on the GPU; then issue 36's 64- and 1-stream rows at four front ends (two front ends: sessions 42-44).
mkdir -p $OUT
POLICIES=adaptive timeout 330 bash tools/gpu_spec_policy.sh > $OUT/spec.log 2>&1
grep -E "^spec|plain|ngram|dflash|replay" $OUT/spec.log | tail -30
INPUT_LEN=128 RUNS="64:512:4 1:16:4" timeout 230 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
grep -E "^serve_|TTFT|TPOT|engine|peer|output tokens" $OUT/serve.log
rm -f $OUT/spec_logs.tar.gz $OUT/pip.txt  # (the serve tarball holds every log of /tmp/logs; 8 files come back at most)
