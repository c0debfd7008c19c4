#!/usr/bin/env bash
# For the next session with a GPU, after next_tests.sh (carry [".whl"]; ~9 min): gpt-oss-20b's step at 64 and 256
# requests (`atlas bench latency --batch-size 64,256 --input-len 128 --output-len 64 --num-iters 3`, --config-only
# checkpoint, --load-format dummy) on five trees, each from its own directory:
#   H  this tree
#   B  H with the expert biases gathered and added apart again (p_no_bias_epilogue.patch)
#   A  H with the clamped SwiGLU as PyTorch ops again (p_no_act_kernel.patch)
#   O  both: the tree of session 85's call 5 (5.974 / 11.123 ms on an H100)
#   S  H with the experts' sort on uint8 keys (p_sort_u8.patch: the radix sort of 64-bit keys took 27 us a layer at
#      256 requests in session 85's profile)
# in the order O H B A S O H; then H with the experts dequantized to bf16 (`--tuning moe_mxfp4=0`), and H's
# 256-request step profiled, its files kept (the top kernels and tables).
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
P=$PWD/benchmarks/s85
tree() {  # NAME PATCH...
  local name=$1; shift
  mkdir -p /tmp/t/$name && cp -r atlas /tmp/t/$name/
  for p in "$@"; do patch -s -p1 -d /tmp/t/$name < $P/$p || echo "tree $name: $p failed"; done
}
tree H; tree B p_no_bias_epilogue.patch; tree A p_no_act_kernel.patch
tree O p_no_bias_epilogue.patch p_no_act_kernel.patch; tree S p_sort_u8.patch
grep -c "adds_biases=True" /tmp/t/{H,B,O}/atlas/layers/moe.py; grep -c "clamped_act_and_mul(h" /tmp/t/{H,A,O}/atlas/layers/moe.py
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
lat O_1 O; lat H_1 H; lat B_1 B; lat A_1 A; lat S_1 S; lat O_2 O; lat H_2 H
lat H_bf16 H --tuning moe_mxfp4=0  # (the experts dequantized to bf16 at load: README's comparison, session 51's)
(cd /tmp/t/H && PYTHONPATH=/tmp/t/H:$PYTHONPATH timeout 100 python3 -m atlas.cli bench latency --model /tmp/oss \
  --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
  --batch-size 256 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 --profile /tmp/prof \
  --output-json /tmp/prof.json > /tmp/prof.log 2>&1); echo "profile exit $?"
head -n 120 /tmp/prof/latency_*_summary.txt 2>/dev/null | cut -c1-200 > $OUT/prof256.txt; head -n 30 $OUT/prof256.txt
find /tmp/prof -size +15M -delete; tar czf $OUT/prof.tgz -C /tmp prof  # (the JSON's top 15 kernels, the tables)
echo "done at ${SECONDS}s"
