#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~4 min): issue 34's rows with fp8_fused_quant the default, bf16
# and FP8 block in one call on whatever card comes (batch 1 and 256 decode, 128 in / 256 out; TTFT of 2,048 tokens).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
VARIANTS="bf16 block" bash tools/gpu_fp8.sh
echo "done at ${SECONDS}s"
