#!/usr/bin/env bash
# Session 77 call 7 (carry [".whl"]; ~5 min): the attention kernel writing o_proj's FP8 rows (fp8_attention_quant, on
# by default): (1) its CUDA tests: the quantized rows byte for byte against quantize_groups_triton in bf16
# (attention_quant_cases.py), the tiny block-FP8 Qwen3 with heads of 128 giving the same greedy tokens as with every
# quantizer unfused (eager and graphs), the other fused-quantization families, and the GQA kernel's own CUDA tests
# (reference, split-KV, in a graph, no compiles once serving); (2) issue 34's batch-256 step and 2,048-token TTFT,
# Qwen3-8B shape FP8 block, with the knob and without (`--tuning fp8_attention_quant=0`), alternated, bf16 beside.
mkdir -p $OUT /tmp/l
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_cuda.py tests/test_cuda.py \
  -k "fused_activation or attention_kernel_writes or paged_attention or split_kv or no_kernel_compiles" \
  > /tmp/l/tests.log 2>&1
echo "tests: exit $?; $(tail -n 1 /tmp/l/tests.log)"
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
lat() {  # NAME MODEL BATCH IN OUT ITERS [TUNING]
  timeout 100 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size $3 --input-len $4 --output-len $5 \
    --num-iters $6 --num-iters-warmup 1 --output-json /tmp/l/$1.json ${7:+--tuning "$7"} > /tmp/l/$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' /tmp/l/$1.log | tail -n 1 | sed 's/.*INFO atlas.bench.latency: //')"
}
lat b256_fp8_on /tmp/q8-fp8 256 128 64 2
lat b256_fp8_off /tmp/q8-fp8 256 128 64 2 fp8_attention_quant=0
lat b256_bf16 /tmp/q8 256 128 64 2
lat b256_fp8_on2 /tmp/q8-fp8 256 128 64 2
lat ttft_fp8_on /tmp/q8-fp8 1 2048 2 5
lat ttft_fp8_off /tmp/q8-fp8 1 2048 2 5 fp8_attention_quant=0
lat ttft_bf16 /tmp/q8 1 2048 2 5
tar czf $OUT/call7.tgz -C /tmp l
echo "done at ${SECONDS}s"
