#!/usr/bin/env bash
# Device call 4 (session 47): where the DFlash engine's 4-5 % goes while the policy keeps it plain (call 3: DFlash
# with the random drafter 0.951-0.964x plain at 1-256 requests, n-gram 0.974-1.01x): a plain engine's decode step
# against the DFlash engine's plain step, with and without the drafter's context write behind it
# (tools/dflash_plain_overhead.py), Qwen3-8B shape, random drafter of block 8 (K = 7) as in call 3.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only --dflash-drafter \
  --dflash-block-size 8 > /dev/null
timeout 400 python3 tools/dflash_plain_overhead.py --model /tmp/q8 --draft-model /tmp/q8/dflash-drafter \
  --load-format dummy --batch-size 1,16,64,256 --output-len 128 --iters 3 --out $OUT/overhead.json > $OUT/overhead.log 2>&1
echo "exit $?"; grep -v " INFO " $OUT/overhead.log | tail -45
