#!/usr/bin/env bash
# Session 52, run on the machine call 4 left warm (the command as given to the device tool): what a verify step of
# a hybrid model costs when every draft is rejected (`atlas bench spec-cost`, fixed drafts, Qwen3.5-9B shape).
mkdir -p $OUT; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
timeout 150 python3 -m atlas.cli bench spec-cost --model /tmp/q9 --load-format dummy --skip-tokenizer-init \
  --gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 4 --draft-lengths 2,4 --batch-size 1 \
  --input-len 128 --output-len 48 --output-json $OUT/spec_cost_q9.json > $OUT/spec_cost_q9.log 2>&1
echo "exit $?"; tail -n 8 $OUT/spec_cost_q9.log
