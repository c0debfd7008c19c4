#!/usr/bin/env bash
# Session 68 call 2 (carry [".whl"]; ~9.5 min): the CUDA tests after session 67's layer, model, sampler and runner
# changes (LoRA slots in Linear, allowed_token_ids / bad_words in the sampler, the slot table in the runner): the LoRA
# CUDA test (PEFT's tokens in float32 and the eager engine's in bfloat16 from the step and mixed-step graphs, mixed
# with base rows) with the core, FP8, mixed-graph, family and speculation CUDA files, 4 pytest-xdist workers; then
# what --enable-lora costs the base model's decode step (s67/call1's bench, one pass: Qwen3-8B shape, batch 1 and 64,
# no LoRA / 1 slot / 4 slots of rank 16 on every adaptable layer, no adapter loaded: the worst case).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests all 370 4 tests/test_lora_cuda.py tests/test_cuda.py tests/test_fp8_cuda.py tests/test_mixed_graphs.py \
  tests/test_gpt_oss_cuda.py tests/test_sliding_window_cuda.py tests/test_hybrid_cuda.py tests/test_deepseek_cuda.py \
  tests/test_speculation_policy.py tests/test_kv_cache_dtype.py
grep -E "PASSED|FAILED|ERROR" $OUT/tests_all.log | grep -c PASSED
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
bench() {  # NAME FLAGS...
  local name=$1; shift
  timeout 65 python3 -m atlas.cli bench latency --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 --output-len 64 \
    --num-iters 3 --num-iters-warmup 1 "$@" --output-json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch [0-9]+:|LoRA:' $OUT/$name.log | tr '\n' ' ' | sed 's/[0-9-]* [0-9:,]* INFO atlas[.a-z_]*: //g')"
}
bench base
bench lora1 --enable-lora --max-loras 1 --max-lora-rank 16
bench lora4 --enable-lora --max-loras 4 --max-lora-rank 16
tar -czf /tmp/c.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/c.tgz $OUT/call2.tgz
