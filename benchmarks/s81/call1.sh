#!/usr/bin/env bash
# Session 81 call 1 (carry [".whl"]; ~5 min): issue 41, DeepSeek-V2-Lite's batch-1 step (0.39 of its roofline on an
# H100 in session 76) on the session's first tree (7a726c2's atlas/, benchmarks/s81/mla_changes.patch reversed), on
# this tree (the MLA prologue in one launch) and on this tree with `--tuning mla_absorb_gemv=1` (the absorbed
# products through Triton), alternated; then this tree's step with the knob, profiled with PDL off (each kernel's
# own time: where the rest of the step goes). The CUDA tests follow in call 2.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/before && cp -r atlas /tmp/before/ && patch -s -R -p1 -d /tmp/before < benchmarks/s81/mla_changes.patch \
  && echo "before tree: $(grep -c mla_prologue /tmp/before/atlas/layers/mla.py) mentions of mla_prologue in mla.py"
python3 tools/make_random_checkpoint.py --shape deepseek-v2-lite --out /tmp/v2 --config-only > /dev/null
lat() {  # NAME TREE [TUNING] [PROFILE]
  PYTHONPATH=$2:$PYTHONPATH timeout 100 python3 -m atlas.cli bench latency --model /tmp/v2 --load-format dummy \
    --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1 \
    --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 ${4:+--profile /tmp/p/prof_$1} \
    --output-json /tmp/p/lat_$1.json ${3:+--tuning "$3"} > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' /tmp/p/lat_$1.log | tail -n 1 | cut -c1-200)"
}
lat before /tmp/before
lat prologue $PWD
lat absorb $PWD mla_absorb_gemv=1
lat prologue2 $PWD
lat absorb2 $PWD mla_absorb_gemv=1
lat absorb_nopdl $PWD mla_absorb_gemv=1,pdl=0 profile
find /tmp/p -name "*.json*" -size +15M -delete
head -n 70 /tmp/p/prof_absorb_nopdl/latency_b1_in128_atlas_table.txt 2>/dev/null | cut -c1-200 > $OUT/table.txt
tar czf $OUT/prof.tgz -C /tmp p
echo "done at ${SECONDS}s"
