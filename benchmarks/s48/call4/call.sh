#!/usr/bin/env bash
# Device call 4 (session 48): issue 36's 256-stream row at two front ends once more on the same tree as call 3 (its
# TTFT p50 there was 1.500x offline's, at the target's bound), on the machine call 3 left warm.
mkdir -p $OUT; INPUT_LEN=128 RUNS="256:1024:2" timeout 200 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
grep -E "^serve_|requests ok|TTFT|TPOT|engine|peer|offline" $OUT/serve.log
