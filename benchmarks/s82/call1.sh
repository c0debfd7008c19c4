#!/usr/bin/env bash
# Session 82, call 1 (~8 min; 908 s of device time left): benchmarks/s81/next.sh reordered (the DeepSeek model tests,
# one before/after pair, the prologue's own tests, then the rest), its logs written under $OUT as they come (a call
# cut short still returns them). First the GEMV cases, which now include the float32 routers' widening load
# (gemv.linear_widened: a bf16 row against a float32 W without the cast's launch).
# For the next session with a GPU (carry [".whl"]; ~9 min). Session 81's call ran short (45 s of device time left
# after it): (1) the MLA prologue's own CUDA tests (tests/test_fused_ops.py -m cuda: its cases in three dtypes and an
# 8-bit cache, the CUDA graph and recompilation test) and the DeepSeek file (the bf16 models in graphs, MTP, prefix
# hits; its fp32 models against transformers passed in session 81); (2) DeepSeek-V2-Lite's batch-1 step on the tree
# before the prologue against this one, alternated, in one call. Session 81's "before" run was not that tree:
# `python3 -m` puts the working directory ahead of PYTHONPATH, so it ran the repository's atlas/ (identical times,
# 2.912 / 2.911 ms); here the before tree runs from its own directory. Then the owed MXFP4 tests.
mkdir -p $OUT $OUT/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests gemv 60 1 tests/test_cuda.py -k gemv_matches
cuda_tests deepseek 170 1 tests/test_deepseek_cuda.py -k "bf16 or graph or mtp"
mkdir -p /tmp/before && cp -r atlas /tmp/before/ && patch -s -R -p1 -d /tmp/before < benchmarks/s81/mla_changes.patch \
  && echo "before tree: $(grep -c mla_prologue /tmp/before/atlas/layers/mla.py) mentions of mla_prologue in mla.py"
python3 tools/make_random_checkpoint.py --shape deepseek-v2-lite --out /tmp/v2 --config-only > /dev/null
lat() {  # NAME TREE [TUNING]   (run from TREE: `-m` imports the working directory's atlas/ first)
  (cd $2 && PYTHONPATH=$2:$PYTHONPATH timeout 90 python3 -m atlas.cli bench latency --model /tmp/v2 --load-format dummy \
    --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1 \
    --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/p/lat_$1.json ${3:+--tuning "$3"} > $OUT/p/lat_$1.log 2>&1
   echo "$1: exit $?; $(python3 -c "import atlas; print(atlas.__file__)"); $(grep -E 'atlas batch' $OUT/p/lat_$1.log | tail -n 1 | cut -c1-200)")
}
lat before /tmp/before
lat prologue $PWD
cuda_tests fused_ops 120 2 tests/test_fused_ops.py
lat before2 /tmp/before
lat prologue2 $PWD
lat knob_off $PWD mla_fused_prologue=0

left=$(( 520 - SECONDS )); [ $left -gt 60 ] && cuda_tests mxfp4 $left 1 tests/test_moe_mxfp4.py tests/test_gpt_oss_cuda.py
echo "done at ${SECONDS}s"
