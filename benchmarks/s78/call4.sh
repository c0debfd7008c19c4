#!/usr/bin/env bash
# Session 78 call 4 (carry [".whl"]; ~6 min; call 3 cut down after the device refused several starts): issue 41's
# gpt-oss-20b shape (MXFP4 experts): the MXFP4 CUDA tests (row tiles included), the batch-1 step with the experts in
# row tiles (--tuning moe_row_tiles=1) and without, one profile of the step with PDL off (each kernel's own time);
# first issue 34's split-K probe (benchmarks/s78/fp8_splitk_probe.py: block-FP8 GEMMs at 128-512 rows, K in halves on
# two streams). (The tensor-core MXFP4 probe is left out: compiled for sm_90 on the CPU its loop issues 0.33-0.46
# warp instructions a weight against the row tiles' 0.25.)
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 benchmarks/s78/fp8_splitk_probe.py --out $OUT/fp8_splitk_probe.json > $OUT/fp8_splitk_probe.log 2>&1
echo "splitk probe: exit $?"; cut -c1-260 $OUT/fp8_splitk_probe.log | tail -14
cuda_tests mxfp4 150 1 tests/test_moe_mxfp4.py
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
lat() {  # NAME TUNING [more flags]
  timeout 120 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 3 --tuning "$2" --output-json /tmp/p/lat_$1.json "${@:3}" > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; \
print(f\"{r['ms_per_step']:.3f} ms ({r['decode_roofline_fraction']:.3f})\")" /tmp/p/lat_$1.json 2>/dev/null)"
}
lat rt0 moe_row_tiles=0
lat rt1 moe_row_tiles=1
lat rt1_nopdl_prof moe_row_tiles=1,pdl=0 --profile /tmp/p/prof_rt1_nopdl
find /tmp/p -name "*.json*" -size +15M -delete
for f in /tmp/p/prof_*/latency_*_summary.txt; do echo "== $f"; head -n 40 $f | cut -c1-170; done > $OUT/summaries.txt
tar czf $OUT/lat.tgz -C /tmp p
echo "call done at ${SECONDS}s"
