#!/usr/bin/env bash
# Session 85, call 2 (carry [".whl"]; ~9 min): the CUDA tests with the defaults call 1 decided (the gpt-oss file: the
# MXFP4 model eager and in CUDA graphs against its dequantized model; the MoE files; the rest of the DeepSeek file),
# then gpt-oss-20b's step at 256 requests profiled (kernels a step, time by kind).
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT=${LIMIT:-570}
cuda_tests gpt_oss 150 2 tests/test_gpt_oss_cuda.py
cuda_tests moe_families 120 2 tests/test_moe_families.py
cuda_tests moe_fp8 100 2 tests/test_moe_fp8.py
left=$(( LIMIT - SECONDS - 100 )); [ $left -gt 60 ] && cuda_tests deepseek $left 1 tests/test_deepseek_cuda.py
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
timeout $(( LIMIT - SECONDS - 5 )) python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy \
  --skip-tokenizer-init --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 256 \
  --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json /tmp/p/lat_prof.json \
  --profile /tmp/p/prof > /tmp/p/lat_prof.log 2>&1; echo "profile exit $?"
head -n 45 /tmp/p/prof/latency_*_summary.txt 2>/dev/null | cut -c1-170 | tee $OUT/prof256.txt
echo "done at ${SECONDS}s"
