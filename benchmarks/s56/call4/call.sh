#!/usr/bin/env bash
# Session 56: FP8 block-scaled decode at 16-64 rows. Call 2 measured the Qwen3.5-9B shape at batch 64 2.6x slower in
# FP8 than in bf16 (20.5 against 7.8 ms a step): up to 64 rows the W8A16 kernel runs with 16-column tiles
# (W8A16_CONFIG), so every program reads the whole of x again. The Qwen3-8B shape at batch 16, 32 and 64, bf16 and
# FP8 with the small-M table's rows 9-64 (--tuning fp8_gemv; rows 1-8 keep the table's) on wider tiles and on the
# W8A8 path (activations quantized, cuBLASLt block scaling), one engine a variant.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8f --config-only --fp8 block > /dev/null
low="1:sum-n4k2048w4s3;2:dot-n16k128w4s4;4:dot-n16k128w4s4;8:dot-n16k128w4s4"
for run in "bf16 -" "table -" "n32 dot-n32k128w4s4" "n64 dot-n64k128w4s4" "n128 dot-n128k128w8s3" "f16n64 f16-n64k128w4s4" \
           "w8a8 w8a8" "mixed 16:dot-n32k128w4s4;32:dot-n64k128w4s4;64:w8a8"; do
  read -r name cfg <<< "$run"
  model=/tmp/q8f; tuning=()
  [ "$name" = bf16 ] && model=/tmp/q8
  if [ "$cfg" != - ]; then
    case "$cfg" in *:*) table="$low;$cfg";; *) table="$low;16:$cfg;32:$cfg;64:$cfg";; esac
    tuning=(--tuning "fp8_gemv=$table")
  fi
  timeout 90 python3 -m atlas.cli bench latency --model $model --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 16,32,64 --input-len 128 \
    --output-len 64 --num-iters 3 --num-iters-warmup 1 "${tuning[@]}" --output-json $OUT/fp8_$name.json \
    > /tmp/logs/fp8_$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch [0-9]+:' /tmp/logs/fp8_$name.log | cut -c 30- | sed 's/atlas.bench.latency: //' | tr '\n' ' ')"
done
