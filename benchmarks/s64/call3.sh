#!/usr/bin/env bash
# Session 64 call 3 (not run: for a later session; carry [".whl"], ~3 min): the random Qwen3-0.6B-shaped draft model
# on the Qwen3-8B shape, drafting right behind the verify step (the default) against after the read-back
# (--tuning draft_after_verify=0), alternated twice in one call: s61/call5 (2.42x / 2.22x plain at 1 / 16) and
# s61/call1 (2.29x / 2.16x) were separate runs. BENCHMARKS.md 3.4.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-0.6b --out /tmp/q06 --config-only > /dev/null
for pass in 1 2; do
  for knob in 1 0; do
    timeout 80 python3 -m atlas.cli bench spec-cost --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
      --speculative draft_model --draft-model /tmp/q06 --draft-lengths 3 --batch-size 1,16 --input-len 128 \
      --output-len 64 --num-iters 3 --gpu-memory-utilization 0.85 --max-model-len 4096 \
      --tuning draft_after_verify=$knob --output-json $OUT/draft_${knob}_$pass.json > $OUT/draft_${knob}_$pass.log 2>&1
    echo "draft_after_verify=$knob pass $pass: exit $?"; grep -E "^(plain|draft_model)" $OUT/draft_${knob}_$pass.txt 2>/dev/null
  done
done
