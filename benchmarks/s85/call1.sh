#!/usr/bin/env bash
# Session 85, call 1 (carry [".whl"]; ~9.5 min): (1) the MXFP4 expert kernels' CUDA test (the grouped kernel's bf16
# pairs decode, moe_mxfp4_dot_pairs, against the float32 decode bit for bit, its one-hot decoding check); (2)
# gpt-oss-20b's decode step at 1, 64 and 256 requests with the knob off and on, alternated; (3) session 84's owed
# moe_route_in_experts timing (DeepSeek-V2-Lite, Qwen3-30B-A3B at batch 1, on and off); (4) that change's CUDA tests
# in what time is left. `atlas bench latency --input-len 128 --output-len 64 --num-iters 3`, --config-only
# checkpoints, --load-format dummy.
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for s in gpt-oss-20b deepseek-v2-lite qwen3-30b-a3b; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
LIMIT=${LIMIT:-570}
cuda_tests mxfp4 150 1 tests/test_moe_mxfp4.py
lat() {  # NAME SHAPE BATCHES LIMIT [extra args...]
  local name=$1 shape=$2 batches=$3 limit=$4; shift 4
  timeout $limit python3 -m atlas.cli bench latency --model /tmp/$shape --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size $batches --input-len 128 \
    --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json $OUT/p/lat_$name.json "$@" > /tmp/lat_$name.log 2>&1
  echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/p/lat_$name.json 2>/dev/null)"
}
lat oss_off_1 gpt-oss-20b 64,256 120 --tuning moe_mxfp4_dot_pairs=0
lat oss_on_1 gpt-oss-20b 64,256 120 --tuning moe_mxfp4_dot_pairs=1
lat oss_off_2 gpt-oss-20b 64,256 120 --tuning moe_mxfp4_dot_pairs=0
lat oss_on_2 gpt-oss-20b 64,256 120 --tuning moe_mxfp4_dot_pairs=1
lat v2_on deepseek-v2-lite 1 90 --tuning moe_route_in_experts=1
lat v2_off deepseek-v2-lite 1 90 --tuning moe_route_in_experts=0
lat a3b_on qwen3-30b-a3b 1 90 --tuning moe_route_in_experts=1
lat a3b_off qwen3-30b-a3b 1 90 --tuning moe_route_in_experts=0
left=$(( LIMIT - SECONDS - 5 )); [ $left -gt 40 ] && cuda_tests deepseek_routed $left 1 tests/test_deepseek_cuda.py \
  -k "choosing or (moe_kernels and float32) or bf16_tokens"
for f in /tmp/lat_*.log; do echo "== $f"; tail -n 4 $f; done > $OUT/lat_logs.txt 2>&1
echo "done at ${SECONDS}s"
