#!/usr/bin/env bash
# Session 75 call 4 (carry [".whl"]; ~3 min): kernel profiles of the Qwen3-8B shape's batch-1 decode step, bf16 and
# FP8 block (the default fp8_gemv_prefetch), 10 steps each (`atlas bench latency --profile`), for where the FP8 step's
# time goes beside its GEMVs. EXTRA (flags appended to each run) and TAG (a suffix to its files' names) for reruns
# with other settings (next3.sh).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
for run in "bf16 /tmp/q8" "fp8 /tmp/q8-fp8"; do
  set -- $run
  timeout 120 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1 --input-len 128 --output-len 256 \
    --num-iters 3 --num-iters-warmup 1 --profile $OUT/prof_$1${TAG:-} --output-json $OUT/lat_$1${TAG:-}.json ${EXTRA:-} \
    > $OUT/lat_$1${TAG:-}.log 2>&1
  echo "$1${TAG:-}: exit $?; $(grep -E 'atlas batch 1:' $OUT/lat_$1${TAG:-}.log | tail -n 1)"
done
echo "done at ${SECONDS}s"
