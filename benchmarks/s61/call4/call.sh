#!/usr/bin/env bash
# Session 61 call 4: MTP drafting right behind the verify step on a small trained model, where a step is host work.
# Trains BENCHMARKS.md 8's 9 M-parameter DeepSeek-V3-architecture model with its MTP module (4 minutes: call 3's 2 left no time to train), then
# `atlas bench spec --methods mtp` (K = 3, every step drafting, held-out code, float32, where outputs must equal plain decoding's) at 1 and 16 requests: drafting
# behind the verify step (the default), then after the read-back (--tuning draft_after_verify=0), each run with
# plain decoding in it. Carry [".whl", ".stdlib"] (benchmarks/s59/call2/call.sh says how to build .stdlib).
mkdir -p $OUT /tmp/logs /tmp/stdlib
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
tar -xJf .stdlib/stdlib-3.11.7.tar.xz -C /tmp/stdlib
timeout 300 python3 tools/train_mtp_model.py --out /tmp/mtp-model --time-budget-minutes 4 --stdlib-dir /tmp/stdlib \
  > /tmp/logs/train.log 2>&1
echo "train: exit $?"; tail -3 /tmp/logs/train.log | cut -c1-200
for behind in 1 0; do
  timeout 90 python3 -m atlas.cli bench spec --model /tmp/mtp-model --methods mtp --num-draft-tokens 3 \
    --concurrency 1,16 --prompts heldout-code --stdlib-dir /tmp/stdlib --dtype float32 --gpu-memory-utilization 0.1 \
    --speculative-policy always --waves 3 --repeats 2 --tuning draft_after_verify=$behind \
    --output-json $OUT/mtp_behind$behind.json > /tmp/logs/mtp_behind$behind.log 2>&1
  echo "draft_after_verify=$behind: exit $?"; grep -A4 "^method" /tmp/logs/mtp_behind$behind.log | cut -c1-220
done
cp /tmp/mtp-model/train_report.json $OUT/ 2>/dev/null
cp /tmp/logs/*.log $OUT/ 2>/dev/null; tar czf /tmp/all.tgz -C $OUT . && mv /tmp/all.tgz $OUT/
