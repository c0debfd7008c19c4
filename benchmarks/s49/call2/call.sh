#!/usr/bin/env bash
# Prepared in session 48 for the next GPU session: issue 34's MoE rows, FP8 checkpoints whose routed experts now stay
# FP8 (the Triton expert kernels dequantize in registers) against the bf16 shape in the same call: Qwen3-30B-A3B and
# DeepSeek-V2-Lite (the named shape), decode at batch 1 and 64 (128 in / 256 out, median of 3).
mkdir -p $OUT
SHAPE=qwen3-30b-a3b VARIANTS="bf16 block" BATCHES=1,64 TTFT=0 timeout 280 bash tools/gpu_fp8.sh > $OUT/qwen3_30b.log 2>&1
SHAPE=deepseek-v2-lite VARIANTS="bf16 block" BATCHES=1,64 TTFT=0 timeout 280 bash tools/gpu_fp8.sh > $OUT/dsv2lite.log 2>&1
grep -E "exit|step|tok/s|Error|error" $OUT/qwen3_30b.log $OUT/dsv2lite.log | head -40
