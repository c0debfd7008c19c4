#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~4 min): issue 38's DFlash step is 1.34x a plain step on an H100
# (verify alone 1.23x) although the 8-row verify GEMMs through cuBLAS read their weights at 0.72-0.95 of the copy
# rate per shape (session 75's `atlas bench gemv --rows 8`), about the 1-row GEMV's rate over the step's bytes. So
# where does the verify step's extra 1.3 ms go? `atlas bench spec-cost --profile` (torch.profiler over each engine's
# steps: kernels a step, time by kind, device idle between kernels), with programmatic dependent launch on (the
# default) and off (`--tuning pdl=0`, each kernel's time its own). If the gaps between the cuBLAS kernels (which take
# no part in PDL) hold it, the fix is the launches, not the GEMM tiles.
mkdir -p $OUT /tmp/prof
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only --dflash-drafter > /dev/null
for tuning in "" "pdl=0"; do
  name=${tuning:+nopdl}; name=${name:-pdl}
  timeout 150 python3 -m atlas.cli bench spec-cost --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --draft-model /tmp/q8/dflash-drafter --draft-lengths 7 \
    --batch-size 1 --input-len 128 --output-len 64 --profile /tmp/prof/$name ${tuning:+--tuning "$tuning"} \
    --output-json $OUT/spec_cost_$name.json > $OUT/spec_cost_$name.log 2>&1
  echo "spec-cost $name: exit $?"; tail -n 6 $OUT/spec_cost_$name.log | cut -c1-160
done
find /tmp/prof -name "*.json*" -size +15M -delete  # (the traces; the summaries stay)
tar czf $OUT/spec_cost_profiles.tar.gz -C /tmp prof
echo "done at ${SECONDS}s"
