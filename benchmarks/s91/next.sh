#!/usr/bin/env bash
# For the next session with an H200 (carry [".whl"]), the card issues 34, 38 and 41 set their bars on; each part a
# call of its own on one warm machine, in this order (PART=...):
#   spec  (~8 min): issue 38's rows after session 90's policy change at 64 / 256 streams (benchmarks/s90/next.sh) and
#         at 1 / 16 (benchmarks/s91/call3.sh); on an H100 this session: DFlash 0.980-1.01x, n-gram 0.967-1.01x.
#   steps (~6 min): benchmarks/s91/call1.sh without its tests: the Qwen3-8B batch-1 profiles (bf16, FP8; PDL off and
#         on), the four skeletons, gemv=auto at batch 1 (session 90 found gpt-oss's small GEMVs at 0.61 of the copy
#         rate on the H200, 0.80 on an H100).
#   combine (~5 min, any card): the attention_fused_combine knob (built after this session's calls; off): its CUDA
#         tests, then batch-1 steps of the Qwen3-8B shape (bf16, FP8 block) and gpt-oss-20b with and without it,
#         alternated (session 91's profile: the combine kernel 36 a step, 0.077 ms on an H100).
#   ttft (~3 min): issue 34's TTFT row (0.720x bf16 on the H200 in session 90, bar 0.7): the 2,048-token prefill of
#         the Qwen3-8B shape profiled in bf16 and FP8 block (tools/gpu_fp8.sh with PROFILE=1: kernels by kind, the
#         quantizers' share), with the batch-1 rows beside it.
#   moe-fp8 (~5 min): issue 34's MoE row, last measured in session 49 (V2-Lite FP8 1.00x bf16 at batch 1, 0.91x at
#         64): DeepSeek-V2-Lite and Qwen3-30B-A3B in bf16 and FP8 block at batch 1 and 64 (tools/gpu_fp8.sh).
set -u
case ${PART:-spec} in
  spec) FINAL=$OUT; bash benchmarks/s90/next.sh; OUT=$FINAL bash benchmarks/s91/call3.sh ;;
  steps) TESTS=0 bash benchmarks/s91/call1.sh ;;
  combine) export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh; FINAL=$OUT; OUT=/tmp/s91c
           mkdir -p $OUT; cuda_tests combine 150 1 tests/test_cuda.py -k split_kv
           python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
           python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
           python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
           F="--tuning attention_fused_combine=1"
           for m in q8 q8-fp8 oss; do
             latency_rows ${m}_off1 /tmp/$m 1; latency_rows ${m}_on1 /tmp/$m 1 $F
             latency_rows ${m}_off2 /tmp/$m 1; latency_rows ${m}_on2 /tmp/$m 1 $F
             tar czf $FINAL/s91_combine.tgz -C /tmp s91c
           done ;;
  ttft) PROFILE=1 BATCHES=1 VARIANTS="bf16 block" timeout 500 bash tools/gpu_fp8.sh ;;
  moe-fp8) for s in deepseek-v2-lite qwen3-30b-a3b; do
             SHAPE=$s BATCHES=1,64 TTFT=0 VARIANTS="bf16 block" timeout 280 bash tools/gpu_fp8.sh
           done ;;
esac
echo "done at ${SECONDS}s"
