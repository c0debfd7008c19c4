#!/usr/bin/env bash
# For the next session with an H200 (carry [".whl"]), the card issues 34, 38 and 41 set their bars on; each part a
# call of its own on one warm machine, in this order (PART=...):
#   spec  (~8 min): issue 38's rows after session 90's policy change at 64 / 256 streams (benchmarks/s90/next.sh) and
#         at 1 / 16 (benchmarks/s91/call3.sh); on an H100 this session: DFlash 0.980-1.01x, n-gram 0.967-1.01x.
#   steps (~6 min): benchmarks/s91/call1.sh without its tests: the Qwen3-8B batch-1 profiles (bf16, FP8; PDL off and
#         on), the four skeletons, gemv=auto at batch 1 (session 90 found gpt-oss's small GEMVs at 0.61 of the copy
#         rate on the H200, 0.80 on an H100).
#   moe-fp8 (~5 min): issue 34's MoE row, last measured in session 49 (V2-Lite FP8 1.00x bf16 at batch 1, 0.91x at
#         64): DeepSeek-V2-Lite and Qwen3-30B-A3B in bf16 and FP8 block at batch 1 and 64 (tools/gpu_fp8.sh).
set -u
case ${PART:-spec} in
  spec) FINAL=$OUT; bash benchmarks/s90/next.sh; OUT=$FINAL bash benchmarks/s91/call3.sh ;;
  steps) TESTS=0 bash benchmarks/s91/call1.sh ;;
  moe-fp8) for s in deepseek-v2-lite qwen3-30b-a3b; do
             SHAPE=$s BATCHES=1,64 TTFT=0 VARIANTS="bf16 block" timeout 280 bash tools/gpu_fp8.sh
           done ;;
esac
echo "done at ${SECONDS}s"
