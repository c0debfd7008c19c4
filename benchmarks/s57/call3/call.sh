#!/usr/bin/env bash
# Prepared in session 56. (1) MTP drafts through a token map (--speculative-token-map, new for mtp): the Qwen3.5-9B
# shape's LM head is 2.0 GB, read once a draft; batch-1 latency plain, MTP K = 2 (policy always) and MTP K = 2 with a
# map of 32,768 ids, one call. (2) Verify steps queued before the host schedules them (--tuning prelaunch_verify,
# off by default: no gain at one stream, session 33) at 16 and 64 streams, where the host's work a step grows: the
# Qwen3-8B shape with a random DFlash drafter (K = 7) drafting every step (policy always), prelaunch off and on.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
# (0) Session 57 call 1's three failures: test_fp32_on_cuda_equals_transformers_generate[*-False] asserted the old
# default (mixed-step graphs off); it now asserts they are on and ran.
cuda_tests hybrid_fp32 150 3 "tests/test_hybrid_cuda.py::test_fp32_on_cuda_equals_transformers_generate"
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
python3 -c "import torch; torch.save(torch.arange(32768), '/tmp/map.pt')"
common=(--model /tmp/q9 --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096
        --max-num-seqs 8 --peer none --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1)
for run in "plain" "mtp" "mtp_map"; do
  extra=()
  [ $run != plain ] && extra=(--speculative mtp --num-draft-tokens 2 --speculative-policy always)
  [ $run = mtp_map ] && extra+=(--speculative-token-map /tmp/map.pt)
  timeout 120 python3 -m atlas.cli bench latency "${common[@]}" "${extra[@]}" --output-json $OUT/q9_$run.json \
    > /tmp/logs/q9_$run.log 2>&1
  echo "$run: exit $?; $(grep -E 'atlas batch 1:' /tmp/logs/q9_$run.log | cut -c 30-)"
done
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only --dflash-drafter \
  --dflash-block-size 8 > /dev/null
for pre in 0 1; do
  timeout 200 python3 -m atlas.cli bench spec --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
    --prompts random --methods dflash --concurrency 1,16,64 --input-len 128 --output-len 128 --waves 1 --repeats 1 \
    --speculative-policy always --gpu-memory-utilization 0.85 --max-model-len 4096 --tuning prelaunch_verify=$pre \
    --output-json $OUT/spec_prelaunch$pre.json > /tmp/logs/spec_prelaunch$pre.log 2>&1
  echo "prelaunch_verify=$pre: exit $?"; tail -8 /tmp/logs/spec_prelaunch$pre.log
done
