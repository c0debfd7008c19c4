#!/usr/bin/env bash
# Device call 3 (session 44), on call 1's sources: issue 36's row with late scheduling beside it, at two and four
# front ends (the device tool's command line, as a script).
mkdir -p $OUT && INPUT_LEN=128 RUNS="256:1024:2:late_scheduling=1 256:1024:4 256:1024:4:late_scheduling=1 256:1024:2" \
  timeout 560 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
grep -E "^serve_|server / offline|TTFT ms|engine|held" $OUT/serve.log
grep -h "scheduling held" /tmp/logs/*.server.log | tail -8
