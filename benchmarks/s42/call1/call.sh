#!/usr/bin/env bash
# Device call 1 (session 42): the server on the final sources with issue 36's workload (128-token random prompts,
# 256 output tokens) and the aiohttp load client: 256 streams with 2 and 4 front ends, 64 streams, 1 stream.
set -u
OUT=${OUT:-/tmp/out}
INPUT_LEN=128 RUNS="256:1024:2 256:1024:4 64:512:2 1:16:2" timeout 560 bash tools/gpu_serve.sh 2>&1 | tail -60
ls -la "$OUT"
