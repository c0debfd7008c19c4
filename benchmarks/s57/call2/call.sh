#!/usr/bin/env bash
# Prepared in session 56: FP8 block-scaled against bf16 at batch 1, 16, 64 and 256 (Qwen3-8B shape) and 1 and 64
# (Qwen3.5-9B shape) with rows 9-64 on the W8A8 path (SMALL_M 8), for BENCHMARKS 2.6 and 14 (session 56 measured
# 16-64 through --tuning fp8_gemv before the table changed).
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
for shape in qwen3-8b qwen3.5-9b; do
  sizes=1,16,64,256; [ $shape = qwen3.5-9b ] && sizes=1,64
  for fp8 in "" block; do
    out=/tmp/$shape${fp8:+-fp8}
    python3 tools/make_random_checkpoint.py --shape $shape --out $out --config-only ${fp8:+--fp8 $fp8} > /dev/null
    timeout 120 python3 -m atlas.cli bench latency --model $out --load-format dummy --skip-tokenizer-init \
      --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size $sizes --input-len 128 \
      --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json $OUT/${shape}${fp8:+_fp8}.json \
      > /tmp/logs/${shape}${fp8:+_fp8}.log 2>&1
    echo "$shape ${fp8:-bf16}: exit $?; $(grep -E 'atlas batch [0-9]+:' /tmp/logs/${shape}${fp8:+_fp8}.log | cut -c 30- | sed 's/atlas.bench.latency: //' | tr '\n' ' ')"
  done
done
