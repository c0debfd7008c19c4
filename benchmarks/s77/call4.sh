#!/usr/bin/env bash
# Session 77 call 4 (carry [".whl"]; ~4 min): issue 34's batch-1 row on an H100 is 1.3 % short of 1.75x with the
# row tiles chosen on the H200 (session 64: rt-n4k2048w4s1). The in-model sweep of other row tiles on this card:
# `tools/gpu_fp8_model_sweep.sh` (atlas bench latency, batch 1, 128 in / 64 out, median of 3; each FP8 config through
# `--tuning fp8_gemv=1:CONFIG`), bf16 and the default in the same call, the default once more at the end for drift.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
CONFIGS="rt-n4k2048w4s1 rt-n2k2048w4s1 rt-n1k2048w4s1 rt-n4k4096w4s1 rt-n2k4096w4s1 rt-n4k2048w8s1 rt-n2k2048w2s1 rt-n4k1024w4s1 rt-n4k2048w4s2 rt-n4k2048w4s1" \
  bash tools/gpu_fp8_model_sweep.sh
echo "done at ${SECONDS}s"
