#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~7 min). (1) The CUDA tests owed by 4bc7867 / 45105e0 (the grouped
# expert kernel adds the expert biases in its epilogue; no GPU ran it): the MXFP4 kernels at gpt-oss-20b's shape, the
# gpt-oss model eager and in CUDA graphs, the FP8 MoE and MoE-family files (their grouped kernel's launch changed).
# (2) gpt-oss-20b's step at 64 and 256 requests on this tree (H) and on H without the bias epilogue
# (p_bias_epilogue.patch undone: the gathered bias rows and their adds, session 85's calls 3-5) and on S, H with the
# experts' sort on uint8 keys (p_sort_u8.patch: the radix sort of 64-bit keys took 27 us a layer at 256 requests in
# session 85's profile), order H B S H B S, each tree from its own directory. (3) H's 256-request step profiled, its files kept (the top kernels and tables: the MoE glue around the
# grouped kernel: sorts, gathers, adds, the activation; 628 elementwise launches a step in session 85's call 2).
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests mxfp4 80 1 tests/test_moe_mxfp4.py
cuda_tests gpt_oss 80 2 tests/test_gpt_oss_cuda.py
cuda_tests moe 120 2 tests/test_moe_fp8.py tests/test_moe_families.py
mkdir -p /tmp/t/H /tmp/t/B /tmp/t/S && cp -r atlas /tmp/t/H/ && cp -r atlas /tmp/t/B/ && cp -r atlas /tmp/t/S/
patch -s -R -p1 -d /tmp/t/B < benchmarks/s85/p_bias_epilogue.patch || echo "tree B: patch failed"
patch -s -p1 -d /tmp/t/S < benchmarks/s85/p_sort_u8.patch || echo "tree S: patch failed"
grep -c "adds_biases" /tmp/t/{H,B}/atlas/layers/moe.py; grep -c "torch.uint8) if" /tmp/t/{H,S}/atlas/layers/moe.py
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
lat() {  # NAME TREE [extra args...]
  local name=$1 tree=$2; shift 2
  (cd /tmp/t/$tree && PYTHONPATH=/tmp/t/$tree:$PYTHONPATH timeout 90 python3 -m atlas.cli bench latency --model /tmp/oss \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size 64,256 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/p/lat_$name.json "$@" > $OUT/p/lat_$name.log 2>&1
   echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/p/lat_$name.json 2>/dev/null)")
}
for pass in 1 2; do lat H_$pass H; lat B_$pass B; lat S_$pass S; done
(cd /tmp/t/H && PYTHONPATH=/tmp/t/H:$PYTHONPATH timeout 100 python3 -m atlas.cli bench latency --model /tmp/oss \
  --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
  --batch-size 256 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 --profile /tmp/prof \
  --output-json /tmp/prof.json > /tmp/prof.log 2>&1); echo "profile exit $?"
head -n 120 /tmp/prof/latency_*_summary.txt 2>/dev/null | cut -c1-200 > $OUT/prof256.txt; head -n 30 $OUT/prof256.txt
find /tmp/prof -size +15M -delete; tar czf $OUT/prof.tgz -C /tmp prof  # (the JSON's top 15 kernels, the tables)
echo "done at ${SECONDS}s"
