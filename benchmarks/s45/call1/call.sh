#!/usr/bin/env bash
# Device call 1 (session 45): issue 36's row at two and four front ends, with the engine's hand-over time split out
# of its queue (atlas_request_handover_seconds) and streamed responses watching disconnects with one task.
mkdir -p $OUT; INPUT_LEN=128 RUNS="256:1024:2 256:1024:4" timeout 420 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
grep -E "^serve_|TTFT|engine|peer" $OUT/serve.log
