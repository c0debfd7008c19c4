#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~5 min each part): issue 38's policy rows after session 77's onset
# rate (requests that have accepted nothing yet read by the recent rate of first acceptances; replayed on the CPU:
# BENCHMARKS.md section 3), each speculative engine interleaved with the plain one (--interleave, 4 passes, the median of the
# paired ratios), as session 76's spec_policy_interleaved.sh. PART=ngram (default): n-gram adaptive on random prompts
# at 64 and 256 streams (0.957x at 64 before); PART=ngram-low: at 1 and 16; PART=dflash: DFlash adaptive (random
# drafter) at 64 and 256 with 6,200 KV pages an engine (0.973 / 0.965x before).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
case ${PART:-ngram} in
  ngram) POLICIES=adaptive METHODS=ngram CONC=64,256 EXTRA="--interleave --repeats 4 --num-gpu-blocks-override 6200" \
           timeout 540 bash tools/gpu_spec_policy.sh ;;
  ngram-low) POLICIES=adaptive METHODS=ngram CONC=1,16 EXTRA="--interleave --repeats 4 --kv-cache-memory 14GiB" \
           timeout 540 bash tools/gpu_spec_policy.sh ;;
  dflash) POLICIES=adaptive METHODS=dflash CONC=64,256 EXTRA="--interleave --repeats 4 --num-gpu-blocks-override 6200" \
           timeout 540 bash tools/gpu_spec_policy.sh ;;
esac
echo "done at ${SECONDS}s"
