#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~7 min, any card; then next_tests.sh): two knobs built after session 88's calls, off
# and on, alternated: the one-program sort of the (token, choice) pairs by expert (moe_expert_sort) and the grouped
# gate|up kernel with the activation as its epilogue (moe_grouped_act), apart and together, at gpt-oss-20b's 64 and
# 256 requests, DeepSeek-V2-Lite's and Qwen3-30B-A3B's 64; then the MoE kernels' CUDA cases (tests/moe_cases.py: the
# sort against the stable argsort exactly, FusedExperts with each knob bit for bit as without). Timings first.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for s in gpt-oss-20b qwen3-30b-a3b deepseek-v2-lite; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
lat() { latency_rows "$1" "/tmp/$2" "${@:3}"; }  # NAME MODEL BATCHES [extra args...] (tools/device_site.sh)
S="--tuning moe_expert_sort=1"; A="--tuning moe_grouped_act=1"; B="--tuning moe_expert_sort=1,moe_grouped_act=1"
lat oss_off1 gpt-oss-20b 64,256; lat oss_sort1 gpt-oss-20b 64,256 $S; lat oss_act1 gpt-oss-20b 64,256 $A
lat oss_both1 gpt-oss-20b 64,256 $B; lat oss_off2 gpt-oss-20b 64,256; lat oss_both2 gpt-oss-20b 64,256 $B
lat v2_off deepseek-v2-lite 64; lat v2_both deepseek-v2-lite 64 $B
lat a3b_off qwen3-30b-a3b 64; lat a3b_both qwen3-30b-a3b 64 $B
(cd tests && timeout 150 python3 moe_cases.py > $OUT/moe_cases.log 2>&1; echo "moe_cases exit $?"; tail -n 3 $OUT/moe_cases.log)
echo "done at ${SECONDS}s"
