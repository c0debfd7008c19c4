#!/usr/bin/env bash
# Session 82, call 1b (~5 min; 518 s of device time left after eight refused starts): call1.sh cut to what matters
# most, each part only while time is left (logs under $OUT as they come): the GEMV cases (the float32 routers'
# widening load), the DeepSeek bf16 / CUDA-graph / MTP model tests (MLA's prologue and the routers in place), one
# before / after pair of DeepSeek-V2-Lite's batch-1 step (the before tree: this one without the prologue,
# benchmarks/s81/mla_changes.patch reversed, run from its own directory), then the prologue's own case tests.
END=${END:-300}
mkdir -p $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
left() { echo $(( END - SECONDS )); }
cuda_tests gemv 45 1 tests/test_cuda.py -k gemv_matches
cuda_tests deepseek 150 1 tests/test_deepseek_cuda.py -k "bf16 or graph or mtp"
mkdir -p /tmp/before && cp -r atlas /tmp/before/ && patch -s -R -p1 -d /tmp/before < benchmarks/s81/mla_changes.patch \
  && echo "before tree: $(grep -c mla_prologue /tmp/before/atlas/layers/mla.py) mentions of mla_prologue in mla.py"
python3 tools/make_random_checkpoint.py --shape deepseek-v2-lite --out /tmp/v2 --config-only > /dev/null
lat() {  # NAME TREE [TUNING]   (run from TREE: `-m` imports the working directory's atlas/ first)
  local limit=$(left); [ $limit -gt 75 ] && limit=75; [ $limit -lt 20 ] && { echo "$1: no time left"; return; }
  (cd $2 && PYTHONPATH=$2:$PYTHONPATH timeout $limit python3 -m atlas.cli bench latency --model /tmp/v2 \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/p/lat_$1.json ${3:+--tuning "$3"} > $OUT/p/lat_$1.log 2>&1
   echo "$1: exit $? at ${SECONDS}s; $(python3 -c "import atlas; print(atlas.__file__)"); $(grep -E 'atlas batch' $OUT/p/lat_$1.log | tail -n 1 | cut -c1-200)")
}
lat before /tmp/before
lat after $PWD
l=$(left); [ $l -gt 30 ] && cuda_tests fused_ops $l 2 tests/test_fused_ops.py
echo "done at ${SECONDS}s"
