#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~4 min): issue 41's gpt-oss-20b shape at batch 1 with the MXFP4
# row tiles' word decode (--tuning moe_mxfp4_word_decode=1: 0.236 / 0.237 warp instructions a useful weight on sm_90
# for gate|up / down against 0.268 / 0.270, benchmarks/s79/mxfp4_decode_probe.py) against the default, alternated
# twice; then tests/test_moe_mxfp4.py -m cuda (the row tiles with and without it at gpt-oss-20b's shape, FusedExperts'
# forward through them). If it is faster, make it the default and run tests/test_gpt_oss_cuda.py on that default.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
lat() {  # NAME WORDS
  timeout 150 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 3 --tuning moe_mxfp4_word_decode=$2 --output-json $OUT/lat_$1.json > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/lat_$1.json 2>/dev/null)"
}
lat bytes_a 0
lat words_a 1
lat bytes_b 0
lat words_b 1
cuda_tests mxfp4 150 1 tests/test_moe_mxfp4.py
echo "done at ${SECONDS}s"
