#!/usr/bin/env bash
# `atlas bench spec` on the GPU machine: Qwen3-8B shape (random bf16 weights drawn on the device) with a random DFlash
# drafter of block 8 (K = 7), random prompts of 128 tokens, 256 greedy output tokens: plain decoding, then n-gram (its
# default settings), DFlash and the replay proposer (the ceiling: every draft accepted), at concurrency 1 to 256, under
# each speculation policy in POLICIES. From the repo root. Results: $OUT/spec_<policy>.{json,txt}, logs in
# $OUT/spec_logs.tar.gz.
#
# Knobs: POLICIES ("adaptive always"), METHODS (ngram,dflash,replay), CONC (1,16,64,256), WAVES (2: groups of
# CONC requests per row), EXTRA (more flags).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only --dflash-drafter \
  --dflash-block-size 8 > /dev/null
for policy in ${POLICIES:-adaptive always}; do
  python3 -m atlas.cli bench spec --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
    --prompts random --methods "${METHODS:-ngram,dflash,replay}" --concurrency "${CONC:-1,16,64,256}" \
    --input-len 128 --output-len 256 --waves "${WAVES:-2}" --repeats 1 --speculative-policy "$policy" \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --output-json "$OUT/spec_$policy.json" ${EXTRA:-} \
    > "/tmp/logs/spec_$policy.log" 2>&1
  echo "spec $policy: exit $?"; tail -22 "/tmp/logs/spec_$policy.log"
done
tar czf "$OUT/spec_logs.tar.gz" -C /tmp logs
