#!/usr/bin/env bash
# Device call 6 (session 44), on 1ecb5be (sources hash 5cb7a519b55e): issue 36's row at two front ends after the front
# end sends a one-prompt request to the engine before its handler first yields (the device tool's command line).
mkdir -p $OUT; INPUT_LEN=128 RUNS="256:1024:2" timeout 185 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1; tail -14 $OUT/serve.log
