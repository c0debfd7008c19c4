#!/usr/bin/env bash
# Session 74 call 1 (carry [".whl"]; under 10 min): session 73's call 3 (the CUDA tests issue 37 still owes: the two
# hybrid tests and MiniMax-M2's router test against Atlas's CPU path where the GPU machine's transformers predates its
# fix, the fused-ops file, Apertus and GraniteMoeShared), then on an H200 issue 34's batch-1 row (s71/next.sh's b1:
# bf16, FP8 block with fp8_gemv_prefetch on by default, and with it off), a second alternated pass if time is left.
mkdir -p $OUT
bash benchmarks/s73/call3.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
# HunYuan (added this session): the dense model's core CUDA tests and the MoE model's router test
cuda_tests hunyuan 120 2 tests/test_cuda.py tests/test_moe_families.py -k "HunYuan or hunyuan"
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
b1() {  # NAME MODEL [TUNING]
  timeout 50 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none ${3:+--tuning "$3"} --batch-size 1 \
    --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 >> $OUT/b1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1.log | tail -n 1)"
}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  for pass in 1 2; do
    [ $SECONDS -lt 400 ] || break
    echo "pass $pass at ${SECONDS}s"
    b1 bf16 /tmp/q8
    b1 fp8 /tmp/q8-fp8
    b1 fp8_no_prefetch /tmp/q8-fp8 fp8_gemv_prefetch=0
  done
fi
echo "done at ${SECONDS}s"
