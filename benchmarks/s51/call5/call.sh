#!/usr/bin/env bash
# Session 51, call 5: call 4's latency rows again (call 4 had set PYTHONPATH without tools/device_site.sh's wheels,
# so `atlas bench` could not import msgspec). Its files did not come back (their names hold "="): the figures are
# the output lines in results.txt beside this script.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh; mkdir -p $OUT
for run in "gpt-oss-20b moe_mxfp4=1" "gpt-oss-20b moe_mxfp4=0" "qwen3-30b-a3b pdl=0"; do
  read -r shape knobs <<< "$run"
  [ -e /tmp/$shape ] || python3 tools/make_random_checkpoint.py --shape $shape --out /tmp/$shape --config-only > /dev/null
  timeout 60 python3 -m atlas.cli bench latency --model /tmp/$shape --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 \
    --output-len 64 --num-iters 2 --num-iters-warmup 1 --tuning $knobs --output-json $OUT/${shape}_$knobs.json \
    > $OUT/${shape}_$knobs.log 2>&1
  echo "$shape $knobs: exit $?; $(grep -E 'atlas batch (1|64):' $OUT/${shape}_$knobs.log | tr '\n' ' ')"
done
