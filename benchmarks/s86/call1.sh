#!/usr/bin/env bash
# Session 86, call 1 (carry [".whl"]; ~6 min): the MXFP4 row tiles' down with a token's choices side by side
# (moe_mxfp4_down_choices, on) on the GPU: its CUDA tests (the kernels at gpt-oss-20b's shape, the model eager and in
# CUDA graphs), then gpt-oss-20b's batch-1 step (`atlas bench latency --batch-size 1 --input-len 128 --output-len 64
# --num-iters 3`, --config-only checkpoint, --load-format dummy) with it on and off, alternated twice; the step with
# the experts' grouped path at one token (MOE_PAIRS_MAX_TOKENS = 0, a tree of its own); each form's step profiled
# with PDL off (each kernel's own time).
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests mxfp4 100 1 tests/test_moe_mxfp4.py
cuda_tests gpt_oss 100 2 tests/test_gpt_oss_cuda.py
mkdir -p /tmp/t/G && cp -r atlas /tmp/t/G/ && sed -i 's/^MOE_PAIRS_MAX_TOKENS = 4$/MOE_PAIRS_MAX_TOKENS = 0/' \
  /tmp/t/G/atlas/layers/moe.py && grep -c "^MOE_PAIRS_MAX_TOKENS = 0" /tmp/t/G/atlas/layers/moe.py
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
lat() {  # NAME ROOT [extra args...]
  local name=$1 root=$2; shift 2
  (cd $root && PYTHONPATH=$root:$PYTHONPATH timeout 100 python3 -m atlas.cli bench latency --model /tmp/oss \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/p/lat_$name.json "$@" > $OUT/p/lat_$name.log 2>&1
   echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/p/lat_$name.json 2>/dev/null)")
}
lat on_1 $PWD; lat off_1 $PWD --tuning moe_mxfp4_down_choices=0; lat on_2 $PWD
lat off_2 $PWD --tuning moe_mxfp4_down_choices=0; lat grouped /tmp/t/G
for f in on off; do
  knob=$([ $f = on ] && echo pdl=0 || echo "pdl=0,moe_mxfp4_down_choices=0")
  lat prof_$f $PWD --tuning $knob --profile /tmp/prof_$f
  head -n 40 /tmp/prof_$f/latency_*_summary.txt | cut -c1-160 > $OUT/prof_$f.txt; head -n 22 $OUT/prof_$f.txt
done
echo "done at ${SECONDS}s"
