#!/usr/bin/env bash
# Session 77 call 6 (carry [".whl"]; ~2.5 min; run inline as this command): the one-row FP8 tiles around call 4's best
# (two W rows a program), at the 256 output tokens, the new default first and last.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
TOKENS=256 CONFIGS="rt-n2k2048w4s1 rt-n2k2048w2s1 rt-n2k1024w4s1 rt-n2k1024w2s1 rt-n1k1024w4s1 rt-n2k2048w4s1" \
  bash tools/gpu_fp8_model_sweep.sh
rm -f $OUT/fp8_sweep.tar.gz
