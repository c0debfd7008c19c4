#!/usr/bin/env bash
# Session 77 call 5 (carry [".whl"]; ~5 min): after the one-row FP8 default became rt-n2k2048w4s1 (call 4's sweep):
# tests/test_fp8_cuda.py whole, then issue 34's batch-1 row on the new default against bf16 and the old tile
# (`--tuning fp8_gemv=1:rt-n4k2048w4s1`), 128 in / 256 out, median of 3, the bf16 run again at the end.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q tests/test_fp8_cuda.py > $OUT/tests_fp8.log 2>&1
echo "test_fp8_cuda: exit $?; $(tail -n 1 $OUT/tests_fp8.log)"
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
lat() {  # NAME MODEL [TUNING]
  timeout 100 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1 --input-len 128 --output-len 256 \
    --num-iters 3 --num-iters-warmup 1 --output-json $OUT/b1_$1.json ${3:+--tuning "$3"} > $OUT/b1_$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' $OUT/b1_$1.log | tail -n 1 | cut -c1-200)"
}
lat bf16 /tmp/q8
lat fp8 /tmp/q8-fp8
lat fp8_n4 /tmp/q8-fp8 "fp8_gemv=1:rt-n4k2048w4s1"
lat bf16_again /tmp/q8
echo "done at ${SECONDS}s"
