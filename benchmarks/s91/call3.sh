#!/usr/bin/env bash
# Session 91, calls 3-5 (carry [".whl"]; ~3.5 min on an H100): issue 38's rows at 1 and 16 streams after session 90's
# policy change, n-gram (random prompts) and DFlash (random drafter) adaptive, each interleaved with the plain engine
# (4 passes, the median of the paired ratios). All three engines are loaded at once: with 14 GiB of KV each the third
# ran out of memory in its profiling forward on an 80 GB card (call 3; now a clear refusal, 90ea126), 7 GiB was
# refused by the plan (call 4); 4 GiB holds 16 sequences of 384 tokens many times over (call 5, these files: call3/).
mkdir -p /tmp/s91l
OUT=/tmp/s91l POLICIES=adaptive METHODS=ngram,dflash CONC=1,16 EXTRA="--interleave --repeats 4 --kv-cache-memory 4GiB" \
  PYTHONPATH=$PWD timeout 280 bash tools/gpu_spec_policy.sh 2>&1 | grep -E "^(method|plain|dflash|ngram)"
tar czf $OUT/s91_low.tgz -C /tmp s91l; echo "done at ${SECONDS}s"
