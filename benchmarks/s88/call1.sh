#!/usr/bin/env bash
# Session 88, call 1 (carry [".whl"]; ~7 min): the norm + GEMV against the fused kernel alone (benchmarks/s88/fused_norm_micro.py); the
# gemv_fused_norm knob (a decode step's RMSNorms inside the one-row GEMVs after them) off and on, alternated, at batch 1 for gpt-oss-20b (q|k|v and router), Qwen3-30B-A3B and
# DeepSeek-V2-Lite (q|k|v, MLA's q|kv_a) and Qwen3-8B (q|k|v and gate|up); then its CUDA tests (the kernel's cases in
# bf16, the two models' greedy tokens). The essentials first (the micro-benchmark, gpt-oss and Qwen3-8B once each, the
# tests), then the repeats. (Session 87's owed moe_grouped_gather call:
# benchmarks/s87/next.sh.)
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for s in gpt-oss-20b qwen3-30b-a3b qwen3-8b deepseek-v2-lite; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
lat() {  # NAME MODEL BATCHES [extra args...]
  local name=$1 model=$2 batches=$3; shift 3
  timeout 120 python3 -m atlas.cli bench latency --model /tmp/$model \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size $batches --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
  echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/$name.json 2>/dev/null)"
}
timeout 90 python3 benchmarks/s88/fused_norm_micro.py 2>&1 | tail -n 9
N="--tuning gemv_fused_norm=1"
lat oss_off1 gpt-oss-20b 1; lat oss_on1 gpt-oss-20b 1 $N
lat q8_off qwen3-8b 1; lat q8_on qwen3-8b 1 $N
grep -h -iE "error|Traceback" $OUT/oss_on1.log | head -5
cuda_tests norm 150 2 tests/test_cuda.py tests/test_gpt_oss_cuda.py -k "gemv_matches or fused_norm"
lat oss_off2 gpt-oss-20b 1; lat oss_on2 gpt-oss-20b 1 $N
lat a3b_off qwen3-30b-a3b 1; lat a3b_on qwen3-30b-a3b 1 $N
lat v2_off deepseek-v2-lite 1; lat v2_on deepseek-v2-lite 1 $N
echo "done at ${SECONDS}s"
