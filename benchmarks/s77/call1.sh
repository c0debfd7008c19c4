#!/usr/bin/env bash
# Session 77 call 1 (carry [".whl"]; ~6 min): (1) Granite's CUDA pair after 6ea5ee0 (its `variant` now inherited
# from Llama's); (2) issue 34: where the Qwen3-8B shape's FP8 steps go, kernel by kernel, against bf16: batch 1 with
# PDL and with `--tuning pdl=0` (each kernel's own time), and batch 256 (PDL on; its GEMMs take no part in PDL),
# `atlas bench latency --profile`, every profile tarred into one file.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -x tests/test_cuda.py -k "Granite" > $OUT/tests_granite.log 2>&1
echo "granite cuda: exit $?; $(tail -n 1 $OUT/tests_granite.log)"
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
lat() {  # NAME MODEL BATCH OUT_LEN [TUNING]
  timeout 150 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size $3 --input-len 128 --output-len $4 \
    --num-iters 2 --num-iters-warmup 1 --profile /tmp/p/prof_$1 --output-json /tmp/p/lat_$1.json ${5:+--tuning "$5"} \
    > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' /tmp/p/lat_$1.log | tail -n 1 | cut -c1-200)"
}
lat b1_bf16 /tmp/q8 1 128
lat b1_fp8 /tmp/q8-fp8 1 128
lat b1_bf16_nopdl /tmp/q8 1 128 pdl=0
lat b1_fp8_nopdl /tmp/q8-fp8 1 128 pdl=0
lat b256_bf16 /tmp/q8 256 64
lat b256_fp8 /tmp/q8-fp8 256 64
find /tmp/p -name "*.json*" -size +15M -delete
for f in /tmp/p/prof_*/latency_*_summary.txt; do echo "== $f"; head -n 24 $f | cut -c1-170; done > $OUT/summaries.txt
tar czf $OUT/prof.tgz -C /tmp p
echo "done at ${SECONDS}s"
