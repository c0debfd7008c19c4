#!/usr/bin/env bash
# Session 80, call 5 (carry [".whl"]; ~4 min): the MXFP4 word decodes after W's tile layout fix (51c4527: at 16 runs, one
# warp, their loops hold no shuffles: e4m3 350 instructions a step against bits' 513, Triton 3.6's sm_90 compile):
# tests/test_moe_mxfp4.py -m cuda, then gpt-oss-20b's batch-1 step with both kernels at 16 runs in e4m3 and in words,
# and gate|up alone so, alternated twice against the default.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
cuda_tests mxfp4 150 1 tests/test_moe_mxfp4.py
lat() {  # NAME STEPS
  timeout 150 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 3 ${2:+--tuning "moe_mxfp4_row_steps=$2"} --output-json /tmp/p/lat_$1.json > /tmp/p/lat_$1.log 2>&1
  echo "$1 [$2]: exit $?; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" /tmp/p/lat_$1.json 2>/dev/null)"
}
for pass in a b; do
  lat default_$pass ""
  lat F_$pass "gate_up:16:1:e4m3;down:16:1:e4m3"
  lat G_$pass "gate_up:16:1:e4m3"
  lat H_$pass "gate_up:16:1:words;down:16:1:words"
done
tar czf $OUT/lat.tar.gz -C /tmp p
echo "done at ${SECONDS}s"
