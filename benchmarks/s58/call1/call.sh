#!/usr/bin/env bash
# Prepared in session 57 (its device time was spent). The speculation policy's table (BENCHMARKS.md 3) again after
# session 57's changes: the DFlash context backlog (on by default; its own figures are benchmarks/s57/call5) and the
# replay proposer's settling passes (--replay-settle 2: the ceiling with every draft accepted, also for the prompt
# that parts from plain decoding's path in bf16). Plain, n-gram, the random DFlash drafter and replay at 1-256
# requests under the adaptive policy (the default), Qwen3-8B shape: tools/gpu_spec_policy.sh.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
POLICIES=adaptive timeout 560 bash tools/gpu_spec_policy.sh
