#!/usr/bin/env bash
# Session 62 call 2 (for a later session with a GPU; carry [".whl"]; ~7 min): decode of the Qwen3-8B shape, FP8 block
# against bf16, through each small-M config (tools/gpu_fp8_model_sweep.sh, --load-format dummy): batch 1, the shipped
# sum-n4k2048w4s3 against the row tiles; batch 2 and 4, the shipped W8A8 against them; batch 16 and 64, W8A8 against
# the f16 W8A16 tiles taking several scale blocks a step. Figures go to BENCHMARKS.md 2.6;
# a config that wins goes into GEMV_CONFIGS (kernels/fp8_linear.py), then call 1 again.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
OUT=$OUT CONFIGS="sum-n4k2048w4s3 rt-n4k2048w4s1 rt-n4k2048w4s2 rt-n4k2048w4s3 rt-n4k4096w8s1 rt-n2k2048w4s1 \
rt-n4k1024w4s1 rt-n2k4096w4s1 rt-n1k2048w4s1" timeout 200 bash tools/gpu_fp8_model_sweep.sh > $OUT/sweep.out 2>&1
cat $OUT/fp8_sweep.txt
for b in 2 4; do  # (the row tiles at 2 and 4 rows against the table's W8A8 there)
  mkdir -p $OUT/b$b
  OUT=$OUT/b$b BATCH=$b CONFIGS="w8a8 rt-n4k2048w4s1 rt-n4k2048w4s2 rt-n2k2048w4s1 rt-n4k1024w4s1" timeout 100 \
    bash tools/gpu_fp8_model_sweep.sh > $OUT/b$b/sweep.out 2>&1
  echo "batch $b:"; cat $OUT/b$b/fp8_sweep.txt
done
for b in 16 64; do  # (the f16 W8A16 tiles, several scale blocks a step, against W8A8 there)
  mkdir -p $OUT/b$b
  OUT=$OUT/b$b BATCH=$b CONFIGS="w8a8 f16-n64k256w8s3 f16-n64k512w8s2 f16-n32k512w4s3 f16-n128k256w8s2" timeout 90 \
    bash tools/gpu_fp8_model_sweep.sh > $OUT/b$b/sweep.out 2>&1
  echo "batch $b:"; cat $OUT/b$b/fp8_sweep.txt
done
