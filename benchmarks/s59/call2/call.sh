#!/usr/bin/env bash
# Prepared in session 58. The draft-length ladder (--tuning draft_lengths, off by default) on the shipped model and
# its drafter (K = 7), held-out code prompts, adaptive policy: plain and DFlash interleaved in one process, at 1-256
# requests, without the ladder and with lengths 1 and 3 (each run its own process, one call). Keep the ladder off by
# default unless it wins where it drafts and loses nowhere.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
for lengths in none 1:3; do
  tuning=(); [ "$lengths" != none ] && tuning=(--tuning "draft_lengths=$lengths")
  name=ladder_${lengths//:/-}
  timeout 270 python3 -m atlas.cli bench spec --methods dflash --gpu-memory-utilization 0.2 --concurrency 1,16,64,256 \
    --waves 4 --repeats 3 --interleave --schedule waves "${tuning[@]}" --output-json $OUT/$name.json \
    > /tmp/logs/$name.log 2>&1
  echo "$name: exit $?"; tail -10 /tmp/logs/$name.log
done
cp /tmp/logs/*.log $OUT/
