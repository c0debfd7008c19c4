#!/usr/bin/env bash
# Session 86, call 2 (carry [".whl"]; ~6 min): the MXFP4 row tiles' "pairs" decode (moe_mxfp4_decode=pairs: a byte's
# two codes placed by two multiplies, x times 2^63) on the GPU: gpt-oss-20b's batch-1 step (the command of call 1)
# with bits and pairs alternated twice, then pairs with the gate|up of 4 and 8 columns a program
# (moe_mxfp4_gate_up_cols), the L2 prefetch of the next layer's q|k|v weight from the down kernel
# (moe_l2_prefetch) against bits alone, alternated twice, the GEMVs' configs timed at load (gemv=auto), the kernels'
# CUDA tests (every decode form, the choices kernel on and off, with a prefetch), the gpt-oss model's CUDA tests on a
# tree whose defaults are the pairs decode and the prefetch, and pairs' step profiled with PDL off (each kernel's own
# time), in that order (the timings first: a call cut short still brings them).
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
lat() {  # NAME [extra args...]
  local name=$1; shift
  timeout 100 python3 -m atlas.cli bench latency --model /tmp/oss \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/p/lat_$name.json "$@" > $OUT/p/lat_$name.log 2>&1
  echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/p/lat_$name.json 2>/dev/null)"
}
lat bits_1; lat pairs_1 --tuning moe_mxfp4_decode=pairs; lat bits_2; lat pairs_2 --tuning moe_mxfp4_decode=pairs
lat pairs_cols4 --tuning moe_mxfp4_decode=pairs,moe_mxfp4_gate_up_cols=4
lat pairs_cols8 --tuning moe_mxfp4_decode=pairs,moe_mxfp4_gate_up_cols=8
lat prefetch_1 --tuning moe_l2_prefetch=1; lat bits_3; lat prefetch_2 --tuning moe_l2_prefetch=1
lat gemv_auto --tuning gemv=auto  # (the one-row GEMVs, 0.80 of the copy rate in call 1: each shape's config timed)
cuda_tests mxfp4 100 1 tests/test_moe_mxfp4.py
mkdir -p /tmp/t/P && cp -r atlas tests tools pyproject.toml /tmp/t/P/ && sed -i 's/moe_mxfp4_decode: str = field(default="bits"/moe_mxfp4_decode: str = field(default="pairs"/' \
  /tmp/t/P/atlas/config.py && sed -i 's/moe_l2_prefetch: bool = field(default=False/moe_l2_prefetch: bool = field(default=True/' \
  /tmp/t/P/atlas/config.py && grep -c 'default="pairs"\|moe_l2_prefetch: bool = field(default=True' /tmp/t/P/atlas/config.py
(cd /tmp/t/P && PYTHONPATH=/tmp/t/P:$PYTHONPATH cuda_tests gpt_oss_pairs 100 2 tests/test_gpt_oss_cuda.py)
lat prof_pairs --tuning pdl=0,moe_mxfp4_decode=pairs --profile /tmp/prof_pairs
head -n 40 /tmp/prof_pairs/latency_*_summary.txt | cut -c1-160 > $OUT/prof_pairs.txt; head -n 18 $OUT/prof_pairs.txt
echo "done at ${SECONDS}s"
