#!/usr/bin/env bash
# Session 70 call 3 (carry [".whl"]; ~7 min, on the machine calls 1-2 warmed): (1) the family, speculation-policy and
# 8-bit KV CUDA files that call 1's cut left unreported, every verdict printed (-rA); (2) the batch-1 row of call 2
# again (bf16, FP8 block, with fp8_gemv_prefetch, with gemv_prefetch), a second pass on the same machine.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 330 python3 -m pytest -q -m cuda tests/test_gpt_oss_cuda.py tests/test_sliding_window_cuda.py \
  tests/test_hybrid_cuda.py tests/test_deepseek_cuda.py tests/test_speculation_policy.py tests/test_kv_cache_dtype.py \
  -n 4 -p no:cacheprovider -rA > $OUT/tests_families.log 2>&1
echo "family tests exit $?; $(grep -E "[0-9]+ (passed|failed|skipped|errors?)" $OUT/tests_families.log | tail -n 1)"
grep -E "^FAILED|^ERROR" $OUT/tests_families.log | head
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
b1() {  # NAME MODEL [TUNING]
  timeout 50 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none ${3:+--tuning "$3"} --batch-size 1 \
    --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 >> $OUT/b1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1.log | tail -n 1)"
}
b1 fp8_all_prefetch /tmp/q8-fp8 gemv_prefetch=1
b1 fp8_fp8_prefetch /tmp/q8-fp8 fp8_gemv_prefetch=1
b1 fp8 /tmp/q8-fp8
b1 bf16 /tmp/q8
