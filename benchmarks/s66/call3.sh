#!/usr/bin/env bash
# Session 66 call 3 (written without a GPU: no machine was lent; for a later session; ~9 min): the fp8_fused_quant
# knob, for issue 34's batch-256 (1.15x bf16 against 1.3x asked) and TTFT (0.79x against 0.7x) rows. A block-FP8
# layer on cuBLASLt's block path quantizes its activations in a launch of its own; with the knob the RMSNorm before
# q|k|v and gate|up and the gated activation before down write the FP8 rows themselves (the same bits). (1) The FP8
# CUDA tests (the fused kernels against the unfused ones on the GPU, the tiny block-FP8 model's tokens with the knob
# on and off, eager and in graphs); (2) `atlas bench latency` on the Qwen3-8B shape: bf16, FP8 block, FP8 block with
# the knob, decode at batch 256 (128 in / 256 out) and the TTFT of a 2,048-token prompt, as tools/gpu_fp8.sh runs
# them; the FP8 rows with a torch.profiler summary (kernels by kind: the quantizers' share before and after).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fp8 240 3 tests/test_fp8_cuda.py
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
run() {  # NAME MODEL [TUNING]
  local common=(--model $2 --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85
                --max-model-len 4096 --peer none ${3:+--tuning "$3"})
  local prof=(); [ "$1" != bf16 ] && prof=(--profile $OUT/profile_$1)
  timeout 110 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 256 --input-len 128 --output-len 256 \
    --num-iters 3 --num-iters-warmup 1 --output-json $OUT/$1_b256.json "${prof[@]}" > $OUT/$1_b256.log 2>&1
  echo "$1 b256: exit $?; $(grep -E 'atlas batch' $OUT/$1_b256.log | sed 's/[0-9-]* [0-9:,]* INFO atlas.bench.latency: //')"
  timeout 80 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 1 --input-len 2048 --output-len 2 \
    --num-iters 5 --num-iters-warmup 1 --output-json $OUT/$1_ttft.json "${prof[@]}" > $OUT/$1_ttft.log 2>&1
  echo "$1 ttft: exit $?; $(grep -iE 'ttft|prefill' $OUT/$1_ttft.log | tail -n 2 | tr '\n' ' ')"
}
run bf16 /tmp/q8
run fp8 /tmp/q8-fp8
run fp8_fused /tmp/q8-fp8 fp8_fused_quant=1
tar -czf /tmp/c.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/c.tgz $OUT/call3.tgz
