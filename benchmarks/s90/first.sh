#!/usr/bin/env bash
# Session 90, the first call on whatever card comes (carry [".whl"]; under 10 min). Timings first; every file into
# one archive ($OUT/s90_first.tgz). On an H200 (where issues 34 and 41 set their bars): issue 34's rows
# (benchmarks/s75/next2.sh: Qwen3-8B bf16 and FP8 block at batch 1 and 256, TTFT of 2,048 tokens), then the MoE
# families' batch-1 rows (gpt-oss-20b in the default pairs decode and words-fma, alternated; DeepSeek-V2-Lite;
# Qwen3-30B-A3B). On an H100: gpt-oss-20b's batch-1 step in the default pairs decode against session 89's FMA
# decodes (words-fma in both one-token kernels, down on 8 or 4 warps; gate|up words-fma with down pairs-fma on 4
# warps) and against the grouped tensor-core kernel at one token (moe_pairs_max_tokens=0 with the one-program sort and
# the activation epilogue and the scales' fold), alternated; at 64 and 256 requests with the scales' fold
# (moe_mxfp4_fold) off and on; then the MXFP4 kernels' cases and the gpt-oss model's CUDA tests in the time left.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
FINAL=$OUT; OUT=/tmp/s90; mkdir -p $OUT
card=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$card"
for s in gpt-oss-20b deepseek-v2-lite qwen3-30b-a3b; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
lat() { latency_rows "$1" "/tmp/$2" "${@:3}"; tar czf $FINAL/s90_first.tgz -C /tmp s90; }
W="--tuning moe_mxfp4_decode=words-fma"
W4="--tuning moe_mxfp4_decode=words-fma,moe_mxfp4_row_steps=down:0:1:words-fma:4"
M="--tuning moe_mxfp4_row_steps=gate_up:0:1:words-fma;down:0:1:pairs-fma:4"
G="--tuning moe_pairs_max_tokens=0,moe_expert_sort=1,moe_grouped_act=1,moe_mxfp4_fold=1"
F="--tuning moe_mxfp4_fold=1"
if echo "$card" | grep -q H200; then
  OUT=$OUT VARIANTS="bf16 block" bash tools/gpu_fp8.sh
  tar czf $FINAL/s90_first.tgz -C /tmp s90
  lat oss_pairs1 gpt-oss-20b 1; lat oss_words1 gpt-oss-20b 1 $W; lat oss_pairs2 gpt-oss-20b 1
  lat v2 deepseek-v2-lite 1; lat a3b qwen3-30b-a3b 1
else
  lat oss_pairs1 gpt-oss-20b 1; lat oss_words1 gpt-oss-20b 1 $W; lat oss_grouped1 gpt-oss-20b 1 $G
  lat oss_words4_1 gpt-oss-20b 1 $W4; lat oss_pairs2 gpt-oss-20b 1
  lat oss_many gpt-oss-20b 64,256; lat oss_many_fold gpt-oss-20b 64,256 $F
  left=$(( 580 - SECONDS )); [ $left -gt 150 ] && left=150
  (cd tests && timeout $left python3 moe_mxfp4_cases.py gpt-oss-20b > $OUT/moe_mxfp4_cases.log 2>&1; echo "moe_mxfp4_cases exit $?"; tail -n 4 $OUT/moe_mxfp4_cases.log)
  tar czf $FINAL/s90_first.tgz -C /tmp s90
  left=$(( 590 - SECONDS )); [ $left -gt 30 ] && cuda_tests gpt_oss $left 2 tests/test_gpt_oss_cuda.py
fi
tar czf $FINAL/s90_first.tgz -C /tmp s90
echo "done at ${SECONDS}s"
