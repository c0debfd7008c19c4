#!/usr/bin/env bash
# Session 67 call 1 (written without a GPU: no machine was lent; for a later session; ~6 min; carry [".whl"] for
# peft, the tests' reference): LoRA adapters (--enable-lora). (1) The CUDA test: adapters in the step and mixed-step
# graphs give PEFT's tokens in float32 and the eager engine's in bfloat16, mixed with base-model rows; with the FP8
# and GEMV model tests (Linear.forward and takes_quantized_rows changed; a layer without adapters takes its old path).
# (2) What enabling LoRA costs the base model's decode step (every slot's two matmuls run whatever the batch asks):
# `atlas bench latency` on the Qwen3-8B shape at batch 1 and 64, without --enable-lora and with 1 and 4 slots of rank
# 16 on every adaptable layer (no --lora-modules: the worst case), alternated twice.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests lora 240 3 tests/test_lora_cuda.py tests/test_fp8_cuda.py -k "lora or greedy"
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
bench() {  # NAME FLAGS...
  local name=$1; shift
  timeout 90 python3 -m atlas.cli bench latency --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 --output-len 64 \
    --num-iters 3 --num-iters-warmup 1 "$@" --output-json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch [0-9]+:|LoRA:' $OUT/$name.log | tr '\n' ' ' | sed 's/[0-9-]* [0-9:,]* INFO atlas[.a-z_]*: //g')"
}
for pass in 1 2; do
  bench base_$pass
  bench lora1_$pass --enable-lora --max-loras 1 --max-lora-rank 16
  bench lora4_$pass --enable-lora --max-loras 4 --max-lora-rank 16
done
tar -czf /tmp/c.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/c.tgz $OUT/call1.tgz
