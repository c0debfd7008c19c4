#!/usr/bin/env bash
# Session 77 call 3 (carry [".whl"]; ~2.5 min; run inline as this command): issue 34's offline row, `atlas bench
# throughput` 1,000 x 512 in / 256 out on the Qwen3-8B shape, bf16, FP8 block (the defaults), bf16 again.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
for r in "bf16 /tmp/q8" "fp8 /tmp/q8-fp8" "bf16b /tmp/q8"; do
  set -- $r
  timeout 170 python3 -m atlas.cli bench throughput --model $2 --load-format dummy --skip-tokenizer-init \
    --max-model-len 4096 --gpu-memory-utilization 0.9 --num-prompts 1000 --input-len 512 --output-len 256 \
    --output-json $OUT/offline_$1.json > $OUT/offline_$1.log 2>&1
  echo "$1: exit $?"
done
