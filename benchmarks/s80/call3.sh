#!/usr/bin/env bash
# Session 80, call 3 (carry [".whl"]; ~5 min). Issue 41: tests/test_moe_mxfp4.py -m cuda (the row tiles through the
# new moe_mxfp4_row_steps knob: each kernel's own step, 128 runs, 2-3 stages, every decode form), then gpt-oss-20b's
# batch-1 step with the per-kernel steps that call 2's kernels-alone sweep put first (gate|up: 16 runs, e4m3 or bits,
# one stage; down: 64 runs, two stages), alternated twice against the default (both kernels 32 runs, bits, 1 stage).
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
  lat A_$pass "gate_up:16:1:e4m3;down:64:2:bits"
  lat B_$pass "gate_up:16:1:bits;down:64:2:bits"
  lat C_$pass "down:64:2:bits"
  lat D_$pass "gate_up:16:1:e4m3;down:128:2:bits"
  lat E_$pass "down:128:1:bits"
done
tar czf $OUT/lat.tar.gz -C /tmp p
echo "done at ${SECONDS}s"
