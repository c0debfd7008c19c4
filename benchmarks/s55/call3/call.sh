#!/usr/bin/env bash
# Session 55, after call 1 measured a 2,048-token TTFT of 139 ms (gdn_snapshot_tail off) where session 54's call 4
# measured 81 ms with the same code path: the 2,048-token runs again, 5 iterations each, the knob off and on, with
# every iteration's TTFT printed, to tell a slow machine or a warm-up effect from a regression.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
for run in "2048 0" "2048 1" "2048 0" "128 1"; do
  read -r len tail <<< "$run"
  timeout 100 python3 -m atlas.cli bench latency --model /tmp/q9 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 4 --peer none --batch-size 1 \
    --input-len $len --output-len 32 --num-iters 5 --num-iters-warmup 2 --tuning gdn_snapshot_tail=$tail \
    --output-json /tmp/r.json > /tmp/r.log 2>&1
  echo "ttft $len tail=$tail exit $?; $(grep -E 'atlas batch 1:' /tmp/r.log | cut -c 30-)"
  python3 -c "import json; print('  ttft_s', [round(t*1e3,1) for t in json.load(open('/tmp/r.json'))['runs'][0]['ttft_s']])"
  cp /tmp/r.json $OUT/ttft${len}_tail${tail}_$RANDOM.json
done
