#!/usr/bin/env bash
# Session 87, call 3 (carry [".whl"]; ~7 min): the one-token down kernel's L2 prefetch of the next layer's q|k|v
# weight rebuilt (each program asks for its part, from one thread) against the new defaults (the pairs decode, 4
# gate|up columns a program), alternated twice at gpt-oss-20b's batch 1; the defaults at 1, 64 and 256 requests; the
# MXFP4 kernels' CUDA tests and the gpt-oss model's on a tree whose default has the prefetch on; then issue 38's DFlash
# step without and with a 32,768-id token map (benchmarks/s77/next_dflash_token_map.sh). Timings first.
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
lat() {  # NAME BATCHES [extra args...]
  local name=$1 batches=$2; shift 2
  timeout 120 python3 -m atlas.cli bench latency --model /tmp/oss \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size $batches --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/p/$name.json "$@" > $OUT/p/$name.log 2>&1
  echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/p/$name.json 2>/dev/null)"
}
lat def_1 1; lat pf_1 1 --tuning moe_l2_prefetch=1; lat def_2 1; lat pf_2 1 --tuning moe_l2_prefetch=1
lat gpf 1 --tuning gemv_prefetch=1  # (the one-row GEMVs load their first tile before the PDL wait)
lat def_all 1,64,256
cuda_tests mxfp4 120 1 tests/test_moe_mxfp4.py
mkdir -p /tmp/t/P && cp -r atlas tests tools pyproject.toml /tmp/t/P/ && sed -i \
  's/moe_l2_prefetch: bool = field(default=False/moe_l2_prefetch: bool = field(default=True/' /tmp/t/P/atlas/config.py \
  && grep -c 'moe_l2_prefetch: bool = field(default=True' /tmp/t/P/atlas/config.py
(cd /tmp/t/P && PYTHONPATH=/tmp/t/P:$PYTHONPATH cuda_tests gpt_oss_prefetch 120 2 tests/test_gpt_oss_cuda.py)
bash benchmarks/s77/next_dflash_token_map.sh 2>&1 | tail -n 12
echo "done at ${SECONDS}s"
