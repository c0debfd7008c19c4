#!/usr/bin/env bash
# Session 84, call 5 (carry [".whl"]; ~9 min): the router's choice made inside the routed experts' gate|up kernel
# (moe_route_in_experts=1; off by default until this runs) against the router's own kernel then gate|up (off): `atlas bench latency --batch-size 1
# --input-len 128 --output-len 64 --num-iters 3` on the --config-only DeepSeek-V2-Lite and Qwen3-30B-A3B checkpoints
# (--load-format dummy), V2-Lite's knob alternated twice, A3B's once; then the CUDA tests of the change that fit in LIMIT
# seconds (its own cases first, a V2-Lite model with it among them, the rest of the DeepSeek file, FP8 MoE, MoE families).
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
# (LIMIT: the call's seconds; the bench rows first, then as many of the tests as fit, the change's own first)
LIMIT=${LIMIT:-570}
for pass in 1 2; do
  lat v2_on_$pass deepseek-v2-lite --tuning moe_route_in_experts=1; lat v2_off_$pass deepseek-v2-lite --tuning moe_route_in_experts=0
done
lat a3b_on_1 qwen3-30b-a3b --tuning moe_route_in_experts=1; lat a3b_off_1 qwen3-30b-a3b --tuning moe_route_in_experts=0
cuda_tests deepseek_routed $(( LIMIT - SECONDS - 5 )) 1 tests/test_deepseek_cuda.py \
  -k "choosing or (moe_kernels and float32) or bf16_tokens"
left=$(( LIMIT - SECONDS - 5 )); [ $left -gt 60 ] && cuda_tests deepseek_rest $left 1 tests/test_deepseek_cuda.py \
  -k "not (choosing or (moe_kernels and float32) or bf16_tokens)"
left=$(( LIMIT - SECONDS - 5 )); [ $left -gt 40 ] && cuda_tests moe_fp8 $left 2 tests/test_moe_fp8.py
left=$(( LIMIT - SECONDS - 5 )); [ $left -gt 40 ] && cuda_tests families $left 2 tests/test_moe_families.py
echo "done at ${SECONDS}s"
