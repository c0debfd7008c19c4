#!/usr/bin/env bash
# Session 84, call 5 (carry [".whl"]; ~9 min): the router's choice made inside the routed experts' gate|up kernel
# (moe_route_in_experts, on) against the router's own kernel then gate|up (off): `atlas bench latency --batch-size 1
# --input-len 128 --output-len 64 --num-iters 3` on the --config-only DeepSeek-V2-Lite and Qwen3-30B-A3B checkpoints
# (--load-format dummy), the knob alternated twice; V2-Lite's step profiled with it on; then the CUDA tests of the
# change (the DeepSeek file whole, the FP8 MoE file, the MoE families' CUDA cases).
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for s in deepseek-v2-lite qwen3-30b-a3b; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
lat() {  # NAME SHAPE [extra args...]
  local name=$1 shape=$2; shift 2
  timeout 100 python3 -m atlas.cli bench latency --model /tmp/$shape --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 \
    --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json $OUT/p/lat_$name.json "$@" > /tmp/lat_$name.log 2>&1
  echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/p/lat_$name.json 2>/dev/null)"
}
for pass in 1 2; do
  lat v2_on_$pass deepseek-v2-lite; lat v2_off_$pass deepseek-v2-lite --tuning moe_route_in_experts=0
  lat a3b_on_$pass qwen3-30b-a3b; lat a3b_off_$pass qwen3-30b-a3b --tuning moe_route_in_experts=0
done
lat v2_on_profile deepseek-v2-lite --profile /tmp/prof
head -n 16 /tmp/prof/latency_*_summary.txt 2>/dev/null | cut -c1-170
cuda_tests deepseek 280 1 tests/test_deepseek_cuda.py
cuda_tests moe_fp8 60 2 tests/test_moe_fp8.py
left=$(( 570 - SECONDS )); [ $left -gt 40 ] && cuda_tests families $left 2 tests/test_moe_families.py
echo "done at ${SECONDS}s"
