#!/usr/bin/env bash
# Prepared in session 49 for the next GPU session: issue 41's Gemma-3-12B figure. The published text model's shape
# (40 of 48 layers windowed at 1,024 tokens), random weights (--load-format dummy), 8k context: 8,192-token prompts,
# 128 tokens out, batch 1 and 8, with the sliding-window layers' pages released as they leave the window (KV cache
# groups, the default) and without (`--tuning kv_cache_groups=0`: one page table for every layer). Each run's JSON
# holds the memory plan (`kv_pool`: pages, page bytes and the token capacity of the same KV budget) and the decode
# step time; per sequence, the KV memory is the plan's budget over the 8k sequences it holds.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape gemma-3-12b --out /tmp/gemma --config-only > /dev/null
for run in groups: one-table:kv_cache_groups=0; do
  IFS=: read -r name knobs <<< "$run"
  timeout 240 python3 -m atlas.cli bench latency --model /tmp/gemma --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 8448 --batch-size 1,8 --input-len 8192 \
    --output-len 128 --num-iters 2 --num-iters-warmup 1 ${knobs:+--tuning $knobs} \
    --output-json $OUT/gemma_$name.json > $OUT/gemma_$name.log 2>&1
  echo "$name: exit $?"; grep -E "KV cache:|atlas batch (1|8):" $OUT/gemma_$name.log | tail -3
done
tar -czf /tmp/call4.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call4.tgz $OUT/
