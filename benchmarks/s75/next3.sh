#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~2 min): where the Qwen3-8B shape's FP8 batch-1 step goes, each
# kernel's own time: the bf16 and FP8 block profiles of call4.sh again with `--tuning pdl=0` (under PDL the kernels'
# spans overlap: 7.3 ms of kernels in a 3.28 ms busy step), beside the PDL step time of the same run.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
for run in "bf16 /tmp/q8" "fp8 /tmp/q8-fp8"; do
  set -- $run
  for pdl in 1 0; do
    timeout 120 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
      --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1 --input-len 128 --output-len 256 \
      --num-iters 3 --num-iters-warmup 1 --tuning pdl=$pdl $( [ $pdl = 0 ] && echo --profile $OUT/prof_$1_nopdl ) \
      > $OUT/lat_$1_pdl$pdl.log 2>&1
    echo "$1 pdl=$pdl: exit $?; $(grep -E 'atlas batch 1:' $OUT/lat_$1_pdl$pdl.log | tail -n 1)"
  done
done
cd $OUT && tar czf prof.tgz prof_* && rm -rf prof_*
echo "done at ${SECONDS}s"
