#!/usr/bin/env bash
# Session 55, after gdn_snapshot_tail became the default: (1) the hybrid CUDA tests on that default, with the new
# test of drafters that keep their own cache (DFlash, a draft model) on a Qwen3.5 target from CUDA graphs; (2) what a
# DFlash step costs on the Qwen3.5-9B shape (a random 5-layer, 16-token-block drafter, --config-only, dummy
# weights) against a plain decode step and an n-gram verify step of the same K, batch 1.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 330 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py -n 6 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "hybrid tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only --dflash-drafter > /dev/null
timeout 240 python3 -m atlas.cli bench spec-cost --model /tmp/q9 --load-format dummy --skip-tokenizer-init \
  --draft-model /tmp/q9/dflash-drafter --draft-lengths 7,15 --batch-size 1 --input-len 128 --output-len 48 \
  --num-iters 3 --gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 4 \
  --output-json $OUT/spec_cost_dflash.json > $OUT/spec_cost_dflash.log 2>&1
echo "spec-cost exit $?"; cat $OUT/spec_cost_dflash.txt 2>/dev/null || tail -20 $OUT/spec_cost_dflash.log
