#!/usr/bin/env bash
# Session 60, call 3: where a batch-1 decode step goes now (issue 41's MoE step at 0.467 of its roofline, issue 34's
# FP8 step at 1.19x bf16): the Qwen3-30B-A3B shape with PDL (the default) and without (`--tuning pdl=0`: each kernel's
# time its own), and the Qwen3-8B shape with block-FP8 linear layers, four profiled steps each (`--profile`; the last
# attribution was session 50's, before the rows-form down kernel and the model-dtype routers).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
for run in moe:/tmp/moe: moe-nopdl:/tmp/moe:pdl=0 fp8-8b:/tmp/q8-fp8:; do
  IFS=: read -r name model knobs <<< "$run"
  timeout 150 python3 -m atlas.cli bench latency --model $model --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 2 --num-iters-warmup 1 ${knobs:+--tuning $knobs} --profile $OUT/prof_$name --profile-steps 4 \
    --output-json $OUT/b1_$name.json > $OUT/b1_$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1_$name.log | tail -1)"
  head -40 $OUT/prof_$name/latency_in128_summary.txt 2>/dev/null
done
tar -czf /tmp/call3.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call3.tgz $OUT/
