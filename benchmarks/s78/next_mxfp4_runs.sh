#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~5 min): issue 41's gpt-oss-20b shape, the MXFP4 row tiles' step
# that pads its 2,880 columns least (--tuning moe_mxfp4_row_runs=0: 32 runs, 2 warps; 0.268 warp instructions a useful
# weight on sm_90 against the default 64's 0.357, benchmarks/s78/mxfp4_row_runs_sass.py) against the default,
# alternated twice at batch 1 and once at 64; then the CUDA tests owed since 64ac440 made the row tiles the default
# (tests/test_gpt_oss_cuda.py) and the MXFP4 kernels' at the runs now tested (tests/test_moe_mxfp4.py -m cuda).
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
lat() {  # NAME RUNS BATCHES
  timeout 150 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size $3 --input-len 128 --output-len 64 \
    --num-iters 3 --tuning moe_mxfp4_row_runs=$2 --output-json $OUT/lat_$1.json > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/lat_$1.json 2>/dev/null)"
}
lat r64a 64 1,64
lat r0a 0 1,64
lat r64b 64 1
lat r0b 0 1
cuda_tests mxfp4 150 1 tests/test_moe_mxfp4.py
cuda_tests gpt_oss 200 1 tests/test_gpt_oss_cuda.py
echo "done at ${SECONDS}s"
