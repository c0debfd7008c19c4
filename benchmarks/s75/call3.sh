#!/usr/bin/env bash
# Session 75 call 3 (carry [".whl"]; ~90 s; run as one command line): issue 34's batch-1 row on the lent H100:
# bf16, FP8 block (fp8_gemv_prefetch on, the default), FP8 block without the prefetch, and bf16 again.
export PYTHONPATH=$PWD; source tools/device_site.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
for run in "bf16 /tmp/q8" "fp8 /tmp/q8-fp8" "fp8_no_prefetch /tmp/q8-fp8 fp8_gemv_prefetch=0" "bf16 /tmp/q8"; do
  set -- $run
  timeout 60 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none ${3:+--tuning "$3"} --batch-size 1 --input-len 128 \
    --output-len 256 --num-iters 3 --num-iters-warmup 1 >> $OUT/b1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1.log | tail -n 1)"
done
git rev-parse HEAD
