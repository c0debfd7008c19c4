#!/usr/bin/env bash
# Session 69 call 1 (<= 10 min): (1) the two CUDA tests that failed in session 69's first call for reasons of the
# tests themselves (test_lora_cuda's base-model reference sent LoRA requests to an engine without --enable-lora;
# test_gemv_rows_knob's n-gram engine ran under the adaptive policy, which drafted nothing on random prompts), fixed;
# (2) issue 34's fp8_fused_quant knob (s66/call3, trimmed to fit): `atlas bench latency` on the Qwen3-8B shape, bf16,
# FP8 block and FP8 block with the knob, decode at batch 256 (128 in / 256 out) and the TTFT of a 2,048-token
# prompt, one after another in this call (no profiles: at most 8 files come back).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fixed 140 2 tests/test_lora_cuda.py "tests/test_cuda.py::test_gemv_rows_knob_keeps_fp32_greedy_tokens"
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
run() {  # NAME MODEL [TUNING]
  local common=(--model $2 --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85
                --max-model-len 4096 --peer none ${3:+--tuning "$3"})
  timeout 95 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 256 --input-len 128 --output-len 256 \
    --num-iters 2 --num-iters-warmup 1 --output-json $OUT/$1_b256.json >> $OUT/bench.log 2>&1
  echo "$1 b256: exit $?; $(grep -E 'atlas batch' $OUT/bench.log | tail -n 1 | sed 's/[0-9-]* [0-9:,]* INFO atlas.bench.latency: //')"
  timeout 55 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 1 --input-len 2048 --output-len 2 \
    --num-iters 4 --num-iters-warmup 1 --output-json $OUT/$1_ttft.json >> $OUT/bench.log 2>&1
  echo "$1 ttft: exit $?; $(grep -iE 'ttft|prefill' $OUT/bench.log | tail -n 1)"
}
run bf16 /tmp/q8
run fp8 /tmp/q8-fp8
run fp8_fused /tmp/q8-fp8 fp8_fused_quant=1
