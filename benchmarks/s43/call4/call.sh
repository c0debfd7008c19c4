#!/usr/bin/env bash
# Device call 4 (session 43), on call 1's sources: issue 36's workload at two front ends, with the offline peer's
# queue / prefill split beside the server engine's.
RUNS="256:1024:2" INPUT_LEN=128 timeout 360 bash tools/gpu_serve.sh > "${OUT:-/tmp/out}/serve.log" 2>&1
