#!/usr/bin/env bash
# Session 60, call 4: MoE routers through the small-M GEMV at one row (benchmarks/s60/router_gemv.patch) against
# cuBLAS (the patch reversed), alternated in one call: `atlas bench latency` at batch 1 (and 64 for Qwen3-30B-A3B)
# on the Qwen3-30B-A3B, DeepSeek-V2-Lite (float32 router) and gpt-oss-20b (router with a bias) shapes,
# --load-format dummy; then the CUDA tests of every family whose router changed.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
for s in qwen3-30b-a3b deepseek-v2-lite gpt-oss-20b; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
bench() {  # NAME SHAPE BATCHES
  timeout 100 python3 -m atlas.cli bench latency --model /tmp/$2 --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size $3 --input-len 128 --output-len 64 \
    --num-iters 3 --num-iters-warmup 1 --output-json $OUT/$1.json > $OUT/$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' $OUT/$1.log | tr '\n' ' ' | sed 's/[0-9-]* [0-9:,]* INFO atlas.bench.latency: //g')"
}
for pass in 1 2; do
  bench q30_gemv_$pass qwen3-30b-a3b 1,64
  git apply -R benchmarks/s60/router_gemv.patch && bench q30_cublas_$pass qwen3-30b-a3b 1,64
  git apply benchmarks/s60/router_gemv.patch
done
bench v2_gemv deepseek-v2-lite 1
bench oss_gemv gpt-oss-20b 1
git apply -R benchmarks/s60/router_gemv.patch
bench v2_cublas deepseek-v2-lite 1
bench oss_cublas gpt-oss-20b 1
git apply benchmarks/s60/router_gemv.patch
git diff --stat
cuda_tests moe 330 4 tests/test_moe_families.py tests/test_deepseek_cuda.py tests/test_moe_fp8.py \
  tests/test_gpt_oss_cuda.py tests/test_hybrid_cuda.py
tar -czf /tmp/c.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/c.tgz $OUT/call4.tgz
