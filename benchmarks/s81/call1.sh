#!/usr/bin/env bash
# Session 81 call 1 (carry [".whl"]; ~8 min): (1) the CUDA tests owed on 2007627 (the MXFP4 row tiles' scale helper):
# tests/test_moe_mxfp4.py and tests/test_gpt_oss_cuda.py, last, in the time left; (2) the MLA prologue in one launch (issue 41): its kernel
# cases, CUDA graph and recompilation test (tests/test_fused_ops.py) and the DeepSeek model tests on CUDA
# (tests/test_deepseek_cuda.py: fp32 against transformers, bf16 argmax, graphs, prefix hits, MTP); (3) DeepSeek-V2-Lite's
# batch-1 step (0.39 of its roofline on an H100 in session 76) on this tree and on the tree before the prologue
# (benchmarks/s81/mla_prologue.patch reversed), alternated, and this tree's step profiled with PDL off (each kernel's
# own time: where the rest of the step goes).
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests fused_ops 100 2 tests/test_fused_ops.py
cuda_tests deepseek 170 1 tests/test_deepseek_cuda.py
mkdir -p /tmp/before && cp -r atlas /tmp/before/ && patch -s -R -p1 -d /tmp/before < benchmarks/s81/mla_prologue.patch \
  && echo "before tree: $(grep -c mla_prologue /tmp/before/atlas/layers/mla.py) mentions of mla_prologue in mla.py"
python3 tools/make_random_checkpoint.py --shape deepseek-v2-lite --out /tmp/v2 --config-only > /dev/null
lat() {  # NAME TREE [TUNING] [PROFILE]
  PYTHONPATH=$2:$PYTHONPATH timeout 100 python3 -m atlas.cli bench latency --model /tmp/v2 --load-format dummy \
    --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1 \
    --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 ${4:+--profile /tmp/p/prof_$1} \
    --output-json /tmp/p/lat_$1.json ${3:+--tuning "$3"} > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' /tmp/p/lat_$1.log | tail -n 1 | cut -c1-200)"
}
lat v2_after $PWD
lat v2_before /tmp/before
lat v2_after2 $PWD
lat v2_before2 /tmp/before
lat v2_after_nopdl $PWD pdl=0 profile
find /tmp/p -name "*.json*" -size +15M -delete
head -n 70 /tmp/p/prof_v2_after_nopdl/latency_b1_in128_atlas_table.txt 2>/dev/null | cut -c1-200 > $OUT/table.txt
tar czf $OUT/prof.tgz -C /tmp p
# (the owed MXFP4 tests last, in the time left)
cuda_tests mxfp4 $(( 480 - SECONDS )) 1 tests/test_moe_mxfp4.py
cuda_tests gpt_oss $(( 570 - SECONDS )) 1 tests/test_gpt_oss_cuda.py
echo "done at ${SECONDS}s"
