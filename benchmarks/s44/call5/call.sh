#!/usr/bin/env bash
# Device call 5 (session 44), on call 4's sources: batch-1 decode of the gpt-oss-20b and DeepSeek-V2-Lite shapes with
# the fused MoE kernels on and off in the same run (the device tool's command line, as a script; the gpt-oss "unfused"
# JSON did not come back: too many files, its figure is from the call's printed summary).
export PYTHONPATH=/tmp/site:$PWD
for shape in gpt-oss-20b deepseek-v2-lite; do
  python3 tools/make_random_checkpoint.py --shape $shape --out /tmp/$shape --config-only > /dev/null
  for run in fused:"" unfused:"moe_fused_routing=0,moe_fused_pairs=0"; do
    name=${run%%:*} knobs=${run#*:}
    timeout 70 python3 -m atlas.cli bench latency --model /tmp/$shape --load-format dummy --skip-tokenizer-init \
      --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
      --num-iters 2 --num-iters-warmup 1 ${knobs:+--tuning $knobs} --output-json $OUT/${shape}_b1_$name.json \
      > $OUT/${shape}_b1_$name.log 2>&1
    echo "$shape $name exit $?"
  done
done
cd $OUT && python3 -c "
import json,glob
for f in sorted(glob.glob('*_b1_*.json')):
    r=json.load(open(f))['rows'][0]; print(f, round(r['ms_per_step'],3), round(r['decode_roofline_fraction'],3), round(r['decode_tok_per_s'],1))"
