#!/usr/bin/env bash
# Session 79, call 4 (carry [".whl"]; ~2.5 min): issue 38's n-gram engine at 256 streams, its decode steps held plain and
# adaptive, against the plain engine's (benchmarks/s79/ngram_plain_overhead.py), Qwen3-8B shape, random bf16 weights.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
timeout 130 python3 benchmarks/s79/ngram_plain_overhead.py --model /tmp/q8 --load-format dummy --batch-size 256 \
  --output-len 128 --iters 2 --passes 2 --num-gpu-blocks-override 4400 --out $OUT/ngram_plain_overhead.json \
  > $OUT/ngram_plain_overhead.log 2>&1
echo "exit $?"; grep "^pass" $OUT/ngram_plain_overhead.log; tail -3 $OUT/ngram_plain_overhead.log
echo "done at ${SECONDS}s"
