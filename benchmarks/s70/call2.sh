#!/usr/bin/env bash
# Session 70 call 2 (carry [".whl"]; ~8 min, on the machine call 1 warmed): (1) the core CUDA files on the final tree
# (call 1's wider set was cut at 370 s with 81 passed and none failed, on an H100 that compiled every kernel cold),
# every test's verdict printed (-rA); (2) issue 34's batch-1 row, one pass: bf16, FP8 block, FP8 block with
# fp8_gemv_prefetch, FP8 block with gemv_prefetch (benchmarks/s69/next_fp8_prefetch.sh's bench).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 300 python3 -m pytest -q -m cuda tests/test_lora_cuda.py tests/test_cuda.py tests/test_mixed_graphs.py \
  tests/test_fp8_cuda.py -n 4 -p no:cacheprovider -rA > $OUT/tests_core.log 2>&1
echo "core tests exit $?; $(grep -E "[0-9]+ (passed|failed|skipped|errors?)" $OUT/tests_core.log | tail -n 1)"
grep -E "^FAILED|^ERROR" $OUT/tests_core.log | head
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
b1() {  # NAME MODEL [TUNING]
  timeout 50 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none ${3:+--tuning "$3"} --batch-size 1 \
    --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 >> $OUT/b1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1.log | tail -n 1)"
}
b1 bf16 /tmp/q8
b1 fp8 /tmp/q8-fp8
b1 fp8_fp8_prefetch /tmp/q8-fp8 fp8_gemv_prefetch=1
b1 fp8_all_prefetch /tmp/q8-fp8 gemv_prefetch=1
