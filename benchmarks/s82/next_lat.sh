#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~7 min). Issue 41: DeepSeek-V2-Lite's batch-1 step (`atlas bench
# latency --batch-size 1 --input-len 128 --output-len 64 --num-iters 3`, `--config-only` checkpoint, `--load-format
# dummy`) on five trees in one call, each change of sessions 81-82 undone in turn from this one:
#   E  this tree   (the shared experts onto the routed sum, e0b5020; p4 also holds two later mends: a comment and
#                  linear_widened through _gemv_config, the same GEMV choice)
#   D  E without p4_shared_onto.patch                (q_proj | kv_a_proj_with_mqa in one GEMV, 78252ab)
#   C  D without p3_q_kv_a.patch                     (the float32 router without the cast's launch, 80f0fd3)
#   B  C without p2_router.patch                     (MLA's prologue in one launch, 62763b1)
#   A  B without benchmarks/s81/mla_changes.patch    (session 81's first tree, 7a726c2)
# in the order A E B C D, twice; then E's step profiled (kernels a step, time by kind, the device's idle gaps). Each
# tree runs from its own directory (`python3 -m` imports the working directory's atlas/ first).
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
S=$PWD/benchmarks
mk() {  # NAME FROM PATCH
  mkdir -p /tmp/t/$1 && cp -r /tmp/t/$2/atlas /tmp/t/$1/ && patch -s -R -p1 -d /tmp/t/$1 < $3 || echo "tree $1: patch failed"
}
mkdir -p /tmp/t/E && cp -r atlas /tmp/t/E/
mk D E $S/s82/p4_shared_onto.patch; mk C D $S/s82/p3_q_kv_a.patch; mk B C $S/s82/p2_router.patch
mk A B $S/s81/mla_changes.patch
grep -c "forward_onto" /tmp/t/{E,D}/atlas/models/sparse_moe.py; grep -c mla_prologue /tmp/t/{B,A}/atlas/layers/mla.py
python3 tools/make_random_checkpoint.py --shape deepseek-v2-lite --out /tmp/v2 --config-only > /dev/null
lat() {  # NAME TREE [extra args...]
  local name=$1 tree=$2; shift 2
  (cd /tmp/t/$tree && PYTHONPATH=/tmp/t/$tree:$PYTHONPATH timeout 90 python3 -m atlas.cli bench latency --model /tmp/v2 \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/p/lat_$name.json "$@" > $OUT/p/lat_$name.log 2>&1
   echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import atlas; print(atlas.__file__)"); $(python3 -c "import json,sys; \
print([(r['batch_size'], round(r['ms_per_step'], 3), round(r['decode_roofline_fraction'], 3)) for r in \
json.load(open(sys.argv[1]))['rows']])" $OUT/p/lat_$name.json 2>/dev/null)")
}
for pass in 1 2; do for t in A E B C D; do lat ${t}_$pass $t; done; done
lat E_profile E --profile /tmp/prof
head -n 40 /tmp/prof/latency_*_summary.txt 2>/dev/null | cut -c1-170
cp /tmp/prof/latency_*_summary.txt $OUT/p/ 2>/dev/null
echo "done at ${SECONDS}s"
