#!/usr/bin/env bash
# Session 80, call 4 (carry [".whl"]; ~5 min): tests/test_gpt_oss_cuda.py on this tree (the MXFP4 row tiles' wrappers
# now read their step from mxfp4_row_config: the default launch unchanged), then issue 38's DFlash row at 256 streams
# (random drafter, adaptive) with 8 interleaved passes in A B, B A order, 6,200 KV pages an engine.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests gpt_oss 150 1 tests/test_gpt_oss_cuda.py
POLICIES=adaptive METHODS=dflash CONC=256 EXTRA="--interleave --repeats 8 --num-gpu-blocks-override 6200" \
  timeout $(( 560 - SECONDS )) bash tools/gpu_spec_policy.sh
rm -f $OUT/spec_logs.tar.gz
echo "done at ${SECONDS}s"
