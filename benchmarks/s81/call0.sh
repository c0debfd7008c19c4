#!/usr/bin/env bash
# Session 81, calls 1 and 2 in one (carry [".whl"]; ~7 min) for a short budget: the MLA prologue's kernel cases
# (tests/test_fused_ops.py -m cuda), DeepSeek-V2-Lite's batch-1 step before / prologue / with mla_absorb_gemv=1
# (benchmarks/s81/call1.sh's runs, without the profile), then tests/test_deepseek_cuda.py in the time left.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests fused_ops 90 2 tests/test_fused_ops.py
mkdir -p /tmp/before && cp -r atlas /tmp/before/ && patch -s -R -p1 -d /tmp/before < benchmarks/s81/mla_changes.patch \
  && echo "before tree: $(grep -c mla_prologue /tmp/before/atlas/layers/mla.py) mentions of mla_prologue in mla.py"
python3 tools/make_random_checkpoint.py --shape deepseek-v2-lite --out /tmp/v2 --config-only > /dev/null
lat() {  # NAME TREE [TUNING]
  PYTHONPATH=$2:$PYTHONPATH timeout 90 python3 -m atlas.cli bench latency --model /tmp/v2 --load-format dummy \
    --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1 \
    --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json /tmp/p/lat_$1.json ${3:+--tuning "$3"} > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' /tmp/p/lat_$1.log | tail -n 1 | cut -c1-200)"
}
lat before /tmp/before
lat prologue $PWD
lat absorb $PWD mla_absorb_gemv=1


tar czf $OUT/lat.tgz -C /tmp p
left=$(( 420 - SECONDS )); echo "deepseek tests get ${left}s"
[ $left -gt 30 ] && cuda_tests deepseek $left 1 tests/test_deepseek_cuda.py
echo "done at ${SECONDS}s"
