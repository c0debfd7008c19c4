#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~7 min): the fp8_gemv_prefetch knob (written in session 69 after
# its device time was spent), issue 34's batch-1 row (1.58x with gemv_prefetch on every GEMV, which slows bf16's LM
# head and the bf16 step). (1) the FP8 CUDA tests (the row tiles' prefetch against its absence, kernel and model);
# (2) `atlas bench latency` at batch 1 (128 in / 256 out) on the Qwen3-8B shape, alternated twice in this call: bf16,
# FP8 block, FP8 block with fp8_gemv_prefetch, FP8 block with gemv_prefetch.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fp8 200 3 tests/test_fp8_cuda.py
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
b1() {  # NAME MODEL [TUNING]
  timeout 50 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none ${3:+--tuning "$3"} --batch-size 1 \
    --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 >> $OUT/b1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1.log | tail -n 1)"
}
for pass in 1 2; do
  b1 bf16 /tmp/q8
  b1 fp8 /tmp/q8-fp8
  b1 fp8_fp8_prefetch /tmp/q8-fp8 fp8_gemv_prefetch=1
  b1 fp8_all_prefetch /tmp/q8-fp8 gemv_prefetch=1
done
