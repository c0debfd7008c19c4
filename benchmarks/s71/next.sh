#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~10 min; supersedes s70/next.sh, whose items are here): the CUDA
# tests owed on the tree after session 71. (1) The paged-attention kernel took a chunk mask and score soft-capping
# (constexpr branches off by default): the core CUDA file, then Llama 4's and Gemma 2's CUDA tests (each mode in
# bf16 over every kind of step, split-KV and an 8-bit cache; the tiny models through the kernels and graphs against
# transformers; Cohere's and GLM-4.7-Flash's tiny models likewise). (2) The sparse-MoE families' CUDA tests,
# MiniMax-M2, ERNIE 4.5 MoE, dots.llm1, Qwen2-MoE and OLMoE now among them. (3) Session 70's: the one-set LoRA engine, the
# FP8 fused quantization on a DeepSeek-V3 MLA, the dense families' core tests. (4) On an H200: issue 34's batch-1
# row with fp8_gemv_prefetch on by default (bf16, FP8 block, FP8 block with the knob off; twice, alternated).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests core 240 4 tests/test_cuda.py tests/test_llama4.py tests/test_gemma2.py tests/test_cohere.py tests/test_glm_lite.py
cuda_tests moe 150 2 tests/test_moe_families.py
cuda_tests lora 150 2 tests/test_lora_cuda.py tests/test_mixed_graphs.py
cuda_tests fused 100 2 tests/test_fp8_cuda.py -k fused_activation
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
    b1 bf16 /tmp/q8
    b1 fp8 /tmp/q8-fp8
    b1 fp8_no_prefetch /tmp/q8-fp8 fp8_gemv_prefetch=0
  done
fi
