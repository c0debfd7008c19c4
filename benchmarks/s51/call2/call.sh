#!/usr/bin/env bash
# Prepared in session 50: programmatic dependent launch on MoE models. Session 50 measured the Qwen3-30B-A3B shape's
# batch-1 step at 3.72 ms without PDL (`--tuning pdl=0`) against 4.07 with it. Before PDL goes off for MoE models:
# batch 1 and 64 of the three MoE shapes, PDL on and off, in one call; and the down kernel that loads a token's
# choices in one tile (`--tuning moe_down_rows=1`, off by default until timed). (Session 51 left out `moe_pdl=0`
# for time.)
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
# (session 51: the FP8 graphs test that call 1 found refused by its memory share under three workers, now at a fixed
#  KV size)
timeout 90 python3 -m pytest -q -m cuda tests/test_moe_fp8.py -k cuda_graphs -p no:cacheprovider -rfE > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log
for shape in qwen3-30b-a3b deepseek-v2-lite gpt-oss-20b; do
  python3 tools/make_random_checkpoint.py --shape $shape --out /tmp/$shape --config-only > /dev/null
  for knobs in pdl=1 pdl=0 moe_down_rows=1; do
    timeout 60 python3 -m atlas.cli bench latency --model /tmp/$shape --load-format dummy --skip-tokenizer-init \
      --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 \
      --output-len 64 --num-iters 2 --num-iters-warmup 1 --tuning $knobs --output-json $OUT/${shape}_$knobs.json \
      > $OUT/${shape}_$knobs.log 2>&1
    echo "$shape $knobs: exit $?; $(grep -E 'atlas batch (1|64):' $OUT/${shape}_$knobs.log | tr '\n' ' ')"
  done
done
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
