#!/usr/bin/env bash
# Device call 5 (session 43): issue 36's workload at two front ends with uvloop and httptools carried (the wheels of
# sessions 34-43 lacked both; the first lines say whether the GPU image has them of its own).
OUT=${OUT:-/tmp/out}
{ for m in uvloop httptools; do python3 -c "import $m" 2>/dev/null && echo "image has $m" || echo "image lacks $m"; done
} | tee "$OUT/image.txt"
RUNS="256:1024:2" INPUT_LEN=128 timeout 200 bash tools/gpu_serve.sh > "$OUT/serve.log" 2>&1
tail -16 "$OUT/serve.log"
