#!/usr/bin/env bash
# Prepared in session 56 (moved out of call 3 for time). Verify steps queued before the host schedules them
# (--tuning prelaunch_verify, off by default: no gain at one stream, session 33) at 16 and 64 streams, where the
# host's work a step grows: the Qwen3-8B shape with a random DFlash drafter (K = 7) drafting every step (policy
# always), prelaunch off and on.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only --dflash-drafter \
  --dflash-block-size 8 > /dev/null
for pre in 0 1; do
  timeout 170 python3 -m atlas.cli bench spec --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
    --prompts random --methods dflash --concurrency 16,64 --input-len 128 --output-len 128 --waves 1 --repeats 1 \
    --speculative-policy always --gpu-memory-utilization 0.85 --max-model-len 4096 --tuning prelaunch_verify=$pre \
    --output-json $OUT/spec_prelaunch$pre.json > /tmp/logs/spec_prelaunch$pre.log 2>&1
  echo "prelaunch_verify=$pre: exit $?"; tail -8 /tmp/logs/spec_prelaunch$pre.log
done
cd $OUT && tar czf results.tgz --remove-files *.json *.txt *.log 2>/dev/null; ls $OUT
