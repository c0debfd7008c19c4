#!/usr/bin/env bash
# Device call 1 (session 47): issue 36's rows at two and four front ends, each twice (the p50 moved by tenths between runs) on session 46's front end (direct routes,
# batched engine messages, the one-pass token-list check), with the engine's hand-over split out of its queue.
mkdir -p $OUT; INPUT_LEN=128 RUNS="256:1024:2 256:1024:4 256:1024:2 256:1024:4" timeout 575 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
grep -E "^serve_|TTFT|engine|peer" $OUT/serve.log
