#!/usr/bin/env bash
# Session 70 call 4 (carry [".whl"]; ~4 min, on the warm machine): fp8_gemv_prefetch on by default: (1) the FP8 CUDA
# tests on this tree; (2) batch 1 (128 in / 256 out), Qwen3-8B shape: bf16, FP8 block (default: prefetch on), FP8
# block with fp8_gemv_prefetch=0; batch 256 FP8 default and with the knob off (the knob touches one-row GEMVs only).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 200 python3 -m pytest -q -m cuda tests/test_fp8_cuda.py -n 4 -p no:cacheprovider -rA > $OUT/tests_fp8.log 2>&1
echo "fp8 tests exit $?; $(grep -E "[0-9]+ (passed|failed|skipped|errors?)" $OUT/tests_fp8.log | tail -n 1)"
grep -E "^FAILED|^ERROR" $OUT/tests_fp8.log | head
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
b() {  # NAME BATCH MODEL [TUNING]
  timeout 60 python3 -m atlas.cli bench latency --model $3 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none ${4:+--tuning "$4"} --batch-size $2 \
    --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 >> $OUT/b.log 2>&1
  echo "$1: exit $?; $(grep -E "atlas batch $2:" $OUT/b.log | tail -n 1)"
}
b bf16_b1 1 /tmp/q8
b fp8_b1 1 /tmp/q8-fp8
b fp8_off_b1 1 /tmp/q8-fp8 fp8_gemv_prefetch=0
b fp8_b256 256 /tmp/q8-fp8
b fp8_off_b256 256 /tmp/q8-fp8 fp8_gemv_prefetch=0
