#!/usr/bin/env bash
# Session 81 call 1 (carry [".whl"]; ~6 min): (1) the CUDA tests owed on 2007627 (the MXFP4 row tiles' scale helper):
# tests/test_moe_mxfp4.py and tests/test_gpt_oss_cuda.py; (2) issue 41: where DeepSeek-V2-Lite's batch-1 step goes
# (0.39 of its roofline, the farthest of the MoE shapes: 27 layers in 4.18 ms where Qwen3-30B-A3B's 48 take 3.34),
# kernel by kernel with PDL off (each kernel's own time) and on, and Qwen3-30B-A3B's with PDL off beside it;
# `atlas bench latency --profile`, the tables tarred into one file.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests mxfp4 150 1 tests/test_moe_mxfp4.py
cuda_tests gpt_oss 200 1 tests/test_gpt_oss_cuda.py
python3 tools/make_random_checkpoint.py --shape deepseek-v2-lite --out /tmp/v2 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
lat() {  # NAME MODEL [TUNING]
  timeout 120 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 2 --num-iters-warmup 1 --profile /tmp/p/prof_$1 --output-json /tmp/p/lat_$1.json ${3:+--tuning "$3"} \
    > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' /tmp/p/lat_$1.log | tail -n 1 | cut -c1-200)"
}
lat v2_nopdl /tmp/v2 pdl=0
lat v2 /tmp/v2
lat moe_nopdl /tmp/moe pdl=0
find /tmp/p -name "*.json*" -size +15M -delete
for f in /tmp/p/prof_*/latency_b1_in128_atlas_table.txt; do echo "== $f"; head -n 60 $f | cut -c1-200; done > $OUT/tables.txt
tar czf $OUT/prof.tgz -C /tmp p
echo "done at ${SECONDS}s"
