#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~5 min): first tests/test_moe_mxfp4.py -m cuda (the row tiles in
# each decode form at gpt-oss-20b's shape, FusedExperts' forward through them: the e4m3 form's inline PTX runs here
# first), then issue 41's gpt-oss-20b shape at batch 1 with the MXFP4 row tiles' decode forms (--tuning
# moe_mxfp4_decode=bits|words|e4m3: 0.268 / 0.236 / 0.179 warp instructions a useful weight for gate|up on sm_90,
# benchmarks/s79/mxfp4_decode_probe.py), alternated twice. If one is faster and its tests passed, make it the default
# and run tests/test_gpt_oss_cuda.py on that default.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
cuda_tests mxfp4 150 1 tests/test_moe_mxfp4.py
lat() {  # NAME DECODE
  timeout 150 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 3 --tuning moe_mxfp4_decode=$2 --output-json $OUT/lat_$1.json > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/lat_$1.json 2>/dev/null)"
}
for pass in a b; do
  lat bits_$pass bits
  lat words_$pass words
  lat e4m3_$pass e4m3
done
echo "done at ${SECONDS}s"
