#!/usr/bin/env bash
# Session 57 call 5: a DFlash engine's plain steps keep the captured rows in a backlog and write the drafter's context
# K/V in batches (--tuning draft_context_backlog, on by default since this commit). (1) The CUDA tests of that path
# (the plain stretch test on CUDA, the DFlash CUDA tests). (2) A plain engine's decode step against the DFlash engine's
# plain step with the backlog, written each step, and with no context (tools/dflash_plain_overhead.py), Qwen3-8B shape,
# random drafter of block 8 (K = 7), as session 47 call 4. (3) `atlas bench spec` plain against DFlash with the
# adaptive policy at 1-256 requests (the random drafter: the worst case), as session 47 call 3.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests dflash 150 3 tests/test_speculation_policy.py tests/test_dflash.py
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only --dflash-drafter \
  --dflash-block-size 8 > /dev/null
timeout 170 python3 tools/dflash_plain_overhead.py --model /tmp/q8 --draft-model /tmp/q8/dflash-drafter \
  --load-format dummy --batch-size 1,16,64,256 --output-len 128 --iters 3 --out $OUT/overhead.json > /tmp/logs/overhead.log 2>&1
echo "overhead exit $?"; python3 -c "
import json; r = json.load(open('$OUT/overhead.json'))
for k, v in r['x_plain'].items(): print(k, ' '.join(f'b{b} {r[\"rows_ms_per_step\"][k][b]:.3f} ms ({x:.3f}x)' for b, x in v.items()))"
timeout 150 python3 -m atlas.cli bench spec --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
  --prompts random --methods dflash --concurrency 1,16,64,256 --input-len 128 --output-len 256 --waves 2 --repeats 1 \
  --speculative-policy adaptive --gpu-memory-utilization 0.85 --max-model-len 4096 \
  --output-json $OUT/spec_adaptive.json > /tmp/logs/spec_adaptive.log 2>&1
echo "spec adaptive: exit $?"; grep -v " INFO " /tmp/logs/spec_adaptive.log | tail -12
cp /tmp/logs/*.log $OUT/
cd $OUT && tar czf results.tgz --remove-files *.json *.txt *.log 2>/dev/null; ls $OUT
